"""The built-in calc task: questions, demonstrations, CalcEnv against the real sandbox, SFT masks."""

from __future__ import annotations

import asyncio
import pickle
import re

import pytest

from laminar.config import CalcTaskConfig, Config, SandboxConfig
from laminar.tasks.calc import CalcEnv
from laminar.tasks import calc
from laminar.types import PromptItem

KINDS = ["mul", "add", "range_sum", "count", "primes"]


def run(coro):
    return asyncio.run(coro)


def _primes_below(n: int) -> int:  # independent of calc's sieve: trial division
    return sum(all(k % d for d in range(2, int(k ** 0.5) + 1)) for k in range(2, n))


def _expected(prompt: str) -> int:
    """The answer recomputed from the prompt text alone (brute force where cheap)."""
    q = prompt[2:-1]
    if m := re.fullmatch(r"(\d+)([*+])(\d+)", q):
        a, b = int(m[1]), int(m[3])
        return a * b if m[2] == "*" else a + b
    if m := re.fullmatch(r"sum%(\d+) (\d+):(\d+)", q):
        k, a, b = map(int, m.groups())
        return sum(i % k for i in range(a, b))
    if m := re.fullmatch(r"count ([a-z]) in ([a-z]+)", q):
        return m[2].count(m[1])
    m = re.fullmatch(r"primes<(\d+)", q)
    assert m, f"unknown question format {prompt!r}"
    return _primes_below(int(m[1]))


@pytest.fixture(scope="module")
def questions():
    return calc.make_questions(CalcTaskConfig(), 150, seed=5)


def test_questions_are_deterministic_short_and_right(questions):
    again = calc.make_questions(CalcTaskConfig(), 150, seed=5)
    assert [(q.prompt, q.answer) for q in again] == [(q.prompt, q.answer) for q in questions]
    other = calc.make_questions(CalcTaskConfig(), 150, seed=6)
    assert [q.prompt for q in other] != [q.prompt for q in questions]
    assert {calc.parse_question(q.prompt)[0] for q in questions} == set(KINDS)
    for q in questions:
        assert q.prompt.startswith("Q:") and q.prompt.endswith("\n") and len(q.prompt) <= 60
        assert q.answer == str(_expected(q.prompt)), q.prompt
    assert [q.index for q in questions] == list(range(150))


def test_kinds_digits_and_bounded_work():
    cfg = CalcTaskConfig(kinds=["mul", "range_sum", "primes"], digits=6, tail_sigma=3.0)
    items = calc.make_questions(cfg, 400, seed=1)
    assert {calc.parse_question(q.prompt)[0] for q in items} == {"mul", "range_sum", "primes"}
    longest_primes = calc._primes_limit(calc.WORK_MAX)
    for q in items:
        kind, args = calc.parse_question(q.prompt)
        if kind == "mul":
            assert all(10 ** 5 <= x < 10 ** 6 for x in args)
        elif kind == "range_sum":
            assert calc.WORK_MIN <= args[1] - args[0] <= calc.WORK_MAX
        else:
            assert args[0] <= longest_primes
    # sigma 3 reaches the clip: the slowest questions sit at the bound
    assert max(a[1] - a[0] for k, a in map(lambda q: calc.parse_question(q.prompt), items)
               if k == "range_sum") == int(calc.WORK_MAX)


def test_demonstration_copies_the_question(questions):
    for q in questions:
        (prog, t1), (obs, t2), (ans, t3) = calc.demonstration(q)
        assert (t1, t2, t3) == (True, False, True)
        assert prog.startswith("<py>print(") and prog.endswith(")</py>") and len(prog) <= 80
        assert obs == f"\n<out>{q.answer}</out>\nA:" and ans == q.answer
        question_numbers = set(re.findall(r"\d+", q.prompt))
        program_numbers = set(re.findall(r"\d+", prog)) - {"2"}  # range(2, ...) of primes
        assert program_numbers <= question_numbers | {"2"}, (q.prompt, prog)
        if "count" in q.prompt:
            assert q.prompt.split(" in ")[1].strip() in prog
        # the program computes the answer (in-process here; the sandbox test runs it for real)
        kind, args = calc.parse_question(q.prompt)
        if (kind != "primes" or args[0] < 3000) and (kind != "range_sum" or args[1] < 10 ** 6):
            import contextlib
            import io

            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                exec(prog[4:-5], {})
            assert calc.observation_text(buf.getvalue()) == obs


def test_observation_text_is_truncated():
    long = calc.observation_text("x" * 1000 + "END")
    assert long.endswith("END</out>\nA:") and len(long) < calc.OBSERVATION_CHARS + 20


# ----------------------------------------------------------------------------- the environment


def _item(prompt="Q:12*34\n", answer="408"):
    return PromptItem(0, prompt, answer)


def test_env_scores_the_final_answer_and_unclosed_tags():
    env = CalcEnv(SandboxConfig())
    assert run(env.reset(_item())) == "Q:12*34\n"
    r = run(env.step(" 408"))
    assert r.done and r.reward == 1.0 and r.info["exact_match"] is True
    r = run(env.step("407"))
    assert r.done and r.reward == 0.0 and r.info["exact_match"] is False
    r = run(env.step("<py>print(12*34)"))  # the budget ran out inside the tool call
    assert r.done and r.reward == 0.0 and r.info["exact_match"] is False
    r = run(env.step("%$#garbage"))
    assert r.done and r.reward == 0.0


def test_env_pickles_mid_episode():
    env = CalcEnv(SandboxConfig(timeout_s=1.5))
    run(env.reset(_item()))
    back = pickle.loads(pickle.dumps(env))
    assert back.answer == "408" and back.sandbox.timeout_s == 1.5 and back.stop == ("</py>",)


def _sandbox_or_skip(cfg: SandboxConfig):
    try:
        from laminar.sandbox import shared_sandbox
    except ImportError as e:
        pytest.skip(f"laminar.sandbox is not importable: {e}")
    try:
        r = asyncio.run(shared_sandbox(cfg).arun("print(6*7)"))
    except Exception as e:  # no namespaces, no backend on this machine
        pytest.skip(f"the sandbox cannot run code here: {type(e).__name__}: {e}")
    if r.status != "ok" or r.stdout.strip() != "42":
        pytest.skip(f"the sandbox cannot run code here: {r.status} {r.error}")


def test_every_kinds_demonstration_runs_in_the_sandbox(questions):
    box = SandboxConfig()
    _sandbox_or_skip(box)
    picks = {}
    for q in questions:  # the cheapest question of each kind
        kind, args = calc.parse_question(q.prompt)
        cost = {"range_sum": lambda a: a[1] - a[0], "primes": lambda a: a[0]}.get(kind, lambda a: 0)
        if kind not in picks or cost(args) < cost(calc.parse_question(picks[kind].prompt)[1]):
            picks[kind] = q
    assert set(picks) == set(KINDS)

    async def episode(q):
        env = CalcEnv(box)
        await env.reset(q)
        (prog, _), (obs, _), (ans, _) = calc.demonstration(q)
        tool = await env.step(prog)
        final = await env.step(ans)
        return tool, obs, final

    async def all_kinds():
        return await asyncio.gather(*(episode(q) for q in picks.values()))

    for (tool, obs, final), q in zip(run(all_kinds()), picks.values()):
        assert not tool.done and tool.reward == 0.0, q.prompt
        assert tool.info["tool_status"] == "ok" and tool.info["tool_s"] > 0
        assert tool.observation == obs, q.prompt  # exactly what SFT showed
        assert final.done and final.reward == 1.0 and final.info["exact_match"]


def test_env_shows_errors_and_timeouts():
    box = SandboxConfig(timeout_s=1.0, cpu_s=1)
    _sandbox_or_skip(box)
    env = CalcEnv(box)
    run(env.reset(_item()))

    async def both():
        return await asyncio.gather(env.step("<py>print(1/0)</py>"),
                                    env.step("x<py>while True: pass</py>"))

    err, loop = run(both())
    assert not err.done and err.info["tool_status"] == "error"
    assert "ZeroDivisionError" in err.observation
    assert err.observation.startswith("\n<out>") and err.observation.endswith("</out>\nA:")
    assert len(err.observation) <= calc.OBSERVATION_CHARS + len("\n<out></out>\nA:")
    assert not loop.done and loop.info["tool_status"] == "timeout"
    assert "timeout" in loop.observation.lower() or "timed out" in loop.observation.lower()
    assert loop.info["tool_s"] < 5


# ----------------------------------------------------------------------------- SFT examples


def test_sft_demonstration_masks_line_up_with_segments(questions):
    from laminar.envs.template import TurnTemplate
    from laminar.models import build_char_tokenizer, encode_prompt
    from laminar.trainer.sft import demonstration_example

    tok = build_char_tokenizer()
    eos = tok.eos_token_id
    for q in questions[:20]:
        segments = calc.demonstration(q)
        ids, mask = demonstration_example(TurnTemplate(tok), q, segments, eos)
        assert len(ids) == len(mask) and ids[-1] == eos and mask[-1] == 1
        # the same ids as the rollout's: BOS + prompt, then each segment as it is
        transcript = q.prompt + "".join(text for text, _ in segments)
        assert ids == encode_prompt(tok, transcript) + [eos]
        trained = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
        context = tok.decode([i for i, m in zip(ids, mask) if not m], skip_special_tokens=False)
        assert trained == segments[0][0] + segments[2][0] + tok.eos_token
        assert context == tok.bos_token + q.prompt + segments[1][0]
        # mask runs: prompt 0s, program 1s, observation 0s, answer + EOS 1s
        runs = [(m, len(list(g))) for m, g in __import__("itertools").groupby(mask)]
        assert runs == [(0, 1 + len(q.prompt) + 0), (1, len(segments[0][0])),
                        (0, len(segments[1][0])), (1, len(segments[2][0]) + 1)]


def test_sft_cache_key_changes_with_the_task():
    from laminar.trainer.sft import cache_key

    reverse = Config()
    calc_cfg = Config(task={"name": "calc"})
    other = Config(task={"name": "calc", "calc": {"digits": 5}})
    assert len({cache_key(reverse), cache_key(calc_cfg), cache_key(other)}) == 3


def test_sft_single_turn_examples_are_prompt_then_answer():
    from laminar.models import build_char_tokenizer, encode_prompt
    from laminar.trainer.sft import answer_example

    tok = build_char_tokenizer()
    item = PromptItem(0, "abc=", "cba")
    ids, mask = answer_example(tok, item, tok.eos_token_id)
    p = encode_prompt(tok, "abc=")
    assert ids == p + tok.encode("cba", add_special_tokens=False) + [tok.eos_token_id]
    assert mask == [0] * len(p) + [1] * 4


def test_sft_on_calc_trains_and_evaluates_episodes(tmp_path):
    """Two steps of the warm start end to end: demonstrations in, held-out episodes (tool calls
    in the real sandbox, on the native engine) scored in the report."""
    import json

    from laminar.trainer.sft import run_sft

    _sandbox_or_skip(SandboxConfig())
    cfg = Config(task={"name": "calc", "eval_prompts": 4, "max_turns": 2,
                       "calc": {"num_prompts": 16}},
                 sft={"steps": 2, "batch_size": 4, "cache_dir": str(tmp_path)},
                 rollout={"max_new_tokens": 24}, trainer={"threads": 1})
    out = run_sft(cfg, log=lambda *_: None)
    report = json.loads((out / "sft_report.json").read_text())
    assert report["steps"] == 2 and 0.0 <= report["eval_exact_match"] <= 1.0
    assert "eval_turns" in report  # episodes, not single responses
