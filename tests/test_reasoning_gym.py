"""The reasoning_gym task: prompts from reasoning-gym's generators, held out by seed and by
question, scored exactly as the generators' own score_answer scores them; bad settings and the
missing extra are one clear message; five steps train end to end on Ray."""

from __future__ import annotations

import asyncio
import json
import pickle
import subprocess
import sys
import textwrap
from importlib.util import find_spec
from pathlib import Path

import pytest

from laminar.config import ConfigError, ReasoningGymTaskConfig, TaskConfig, load_config

needs_rg = pytest.mark.skipif(find_spec("reasoning_gym") is None,
                              reason="needs the tasks extra: pip install 'laminar[tasks]'")
EXAMPLE = Path(__file__).parent.parent / "examples" / "reasoning-gym.yaml"


def run(coro):
    return asyncio.run(coro)


def rg_cfg(*datasets: dict, size: int = 200, seed: int = 0) -> ReasoningGymTaskConfig:
    return ReasoningGymTaskConfig(datasets=list(datasets), size=size, seed=seed)


def env_score(cfg: ReasoningGymTaskConfig, item, response: str) -> tuple[float, dict]:
    from laminar.tasks.reasoning_gym import ReasoningGymEnv

    env = ReasoningGymEnv(cfg)
    assert run(env.reset(item)) == item.prompt
    result = run(env.step(response))
    assert result.done and result.observation == ""
    return result.reward, result.info


@needs_rg
def test_prompts_are_deterministic_weighted_and_held_out_by_question():
    from laminar.tasks.reasoning_gym import make_prompts, oracle_answer

    cfg = rg_cfg({"name": "spell_backward", "weight": 3, "config": {"max_word_len": 5}},
                 {"name": "chain_sum", "config": {"max_terms": 3, "max_digits": 1}}, size=400)
    train, held = make_prompts(cfg, 50)
    again = make_prompts(cfg, 50)
    assert [(i.prompt, i.answer) for i in train + held] == [(i.prompt, i.answer) for i in again[0] + again[1]]
    assert [i.index for i in train] == list(range(400)) and [i.index for i in held] == list(range(50))
    assert not {i.prompt for i in held} & {i.prompt for i in train}
    assert len({i.prompt for i in held}) == 50
    sources = [json.loads(i.answer)["metadata"]["source_dataset"] for i in train]
    assert 0.65 < sources.count("spell_backward") / len(sources) < 0.85  # weight 3 : 1
    for item in train[:20]:
        assert item.prompt.endswith("\n") and oracle_answer(item) == json.loads(item.answer)["answer"]
    other = make_prompts(rg_cfg(*cfg.datasets, size=400, seed=1), 50)[0]
    assert [i.prompt for i in other] != [i.prompt for i in train]


@needs_rg
@pytest.mark.parametrize("name,config", [
    ("spell_backward", {"max_word_len": 6}),
    ("chain_sum", {"max_digits": 2}),
    ("basic_arithmetic", {"max_terms": 3, "max_digits": 2}),
    ("letter_counting", {}),
    ("number_sorting", {}),
    ("word_sequence_reversal", {}),
    ("prime_factorization", {}),
])
def test_scores_are_the_generators_own(name, config):
    """The environment's reward is the library's score_answer on the same entry, for the right
    answer, near misses (partial credit where the generator gives it) and garbage; an answer in
    <answer> tags is read from them. A scorer that raises scores 0 with the error noted."""
    import reasoning_gym

    from laminar.tasks.reasoning_gym import make_prompts

    cfg = rg_cfg({"name": name, "config": config}, size=30)
    train, _ = make_prompts(cfg, 5)
    library = reasoning_gym.create_dataset(name, **config, seed=cfg.seed + 1, size=cfg.size)
    for item in train[:10]:
        entry = library[item.index]  # the generator's own entry for this item, made afresh
        assert item.prompt == entry["question"] + "\n"
        right = entry["answer"]
        reward, info = env_score(cfg, item, right)
        assert reward == library.score_answer(right, entry) == 1.0 and info["exact_match"]
        tagged, _ = env_score(cfg, item, f"let me think <answer>{right}</answer>")
        assert tagged == 1.0
        for wrong in (right + "0", "x" + right, right[::-1] + "z", "", "banana"):
            try:
                expected, raised = library.score_answer(wrong, entry), False
            except Exception:
                expected, raised = 0.0, True
            reward, info = env_score(cfg, item, wrong)
            assert reward == pytest.approx(expected), (wrong, entry)
            assert info["exact_match"] == (expected == 1.0)
            assert ("score_error" in info) == raised


@needs_rg
def test_env_pickles_mid_episode():
    from laminar.tasks.reasoning_gym import ReasoningGymEnv, make_prompts, oracle_answer

    cfg = rg_cfg({"name": "spell_backward"}, size=10)
    item = make_prompts(cfg, 2)[1][0]
    env = ReasoningGymEnv(cfg)
    run(env.reset(item))
    moved = pickle.loads(pickle.dumps(env))
    assert run(moved.step(oracle_answer(item))).reward == 1.0


@needs_rg
def test_build_task_and_sft_demonstrations():
    from laminar.models import build_char_tokenizer, encode_prompt
    from laminar.tasks import build_task
    from laminar.trainer.sft import build_examples

    task = build_task(TaskConfig(name="reasoning_gym", eval_prompts=4,
                                 reasoning_gym={"size": 8, "template": "Q: {question}\nA:"}))
    assert task.multi_turn and task.stop == () and len(task.train) == 8 and len(task.eval) == 4
    assert all(i.prompt.startswith("Q: Spell this word backward") and i.prompt.endswith("\nA:")
               for i in task.train)
    tok = build_char_tokenizer()
    ids, mask = build_examples(task, tok, tok.eos_token_id)[0]
    item = task.train[0]
    answer = json.loads(item.answer)["answer"]
    p = encode_prompt(tok, item.prompt)
    assert ids == p + tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
    assert mask == [0] * len(p) + [1] * (len(answer) + 1)
    rollout_side = build_task(TaskConfig(name="reasoning_gym"), prompts=False)
    assert rollout_side.train == [] and rollout_side.make_env is not None


@needs_rg
def test_bad_settings_name_the_key_the_value_and_the_fix():
    from laminar.tasks.reasoning_gym import make_prompts

    cases = [
        (rg_cfg({"name": "spell_backwards"}), r"datasets\[0\]\.name='spell_backwards' is not a "
         r"reasoning-gym generator; did you mean 'spell_backward'\?"),
        (rg_cfg({"name": "chain_sum"}, {"name": "spell_backward", "config": {"max_len": 5}}),
         r"datasets\[1\]\.config=\{'max_len': 5\} does not fit SpellBackwardConfig .*its keys: "
         r"min_word_len, max_word_len, data_file"),
        (rg_cfg({"name": "spell_backward", "config": {"min_word_len": 9, "max_word_len": 4}}),
         r"datasets\[0\]\.config=.* is refused by spell_backward"),
        (rg_cfg({"name": "chain_sum", "config": {"seed": 3}}),
         r"datasets\[0\]\.config\.seed=3: set task\.reasoning_gym\.seed instead"),
        (rg_cfg({"name": "chain_sum"}, {"name": "chain_sum"}), r"'chain_sum' is listed twice"),
        (rg_cfg({"name": "chain_sum", "config": {"max_terms": 2, "max_digits": 1}}, size=4096),
         r"task\.eval_prompts=128: only \d+ of 2560 held-out questions are new"),
    ]
    for cfg, message in cases:
        with pytest.raises(ConfigError, match=message):
            make_prompts(cfg, 128)
    with pytest.raises(ConfigError, match=r"template.*has no `\{question\}`"):
        load_config(None, ["task.reasoning_gym.template=Answer this"])


def test_missing_extra_is_one_line_naming_it(tmp_path):
    """Without reasoning-gym installed, `laminar train` says which extra to install in one line
    (exit 2, no traceback)."""
    code = textwrap.dedent(f"""
        import sys
        sys.modules["reasoning_gym"] = None  # as if not installed: importing it raises
        from laminar.cli import main
        sys.exit(main(["train", {str(EXAMPLE)!r}, "sft.cache_dir={tmp_path}",
                       "run_dir={tmp_path / 'run'}"]))
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "laminar: task.name=reasoning_gym needs the reasoning-gym package, which is not "
        "installed: pip install 'laminar[tasks]'"]


@needs_rg
def test_example_config_parses_and_its_prompts_fit():
    from laminar.tasks import build_task
    from laminar.tasks.reasoning_gym import oracle_answer

    cfg = load_config(str(EXAMPLE), [])
    task = build_task(cfg.task)
    assert len(task.train) == cfg.task.reasoning_gym.size and len(task.eval) == cfg.task.eval_prompts
    assert max(len(oracle_answer(i)) for i in task.train) < cfg.rollout.max_new_tokens
    assert max(len(i.prompt) for i in task.train) + cfg.rollout.max_new_tokens < 1024


@pytest.mark.slow  # repeats a path the default suite covers (docs/testing.md)
@needs_rg
def test_five_steps_train_end_to_end_on_ray(tmp_path, ray_cluster):
    """Real actors, engine, trainer and relays on the tiny model: every trajectory is scored by
    the environment (none failed), whole groups are trained, held-out evaluation runs on the
    environment's exact match."""
    from laminar.metrics import read_metrics, read_rows
    from laminar.modes import run_training

    cfg = load_config(None, [
        "task.name=reasoning_gym", "task.reasoning_gym.size=64", "task.eval_prompts=4",
        "task.reasoning_gym.datasets=[{name: spell_backward, config: {max_word_len: 4}}]",
        "sft.enabled=false", "rollout.max_new_tokens=8", "rollout.group_size=2",
        "rollout.num_workers=2", "cluster.virtual_nodes=2", "rollout.batch_groups=2",
        "rollout.engine.max_batch_size=8", "trainer.prompts_per_step=4", "trainer.mini_batches=2",
        "trainer.threads=1", "trainer.total_steps=5", "trainer.eval_every=0",
        "cluster.wait_timeout_s=120", "metrics.tensorboard=false", "metrics.live=off",
        "mode=laminar", f"run_dir={tmp_path}"])
    report = run_training(cfg)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    trained = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert len(trained) == len({t["traj_id"] for t in trained}) == 5 * 4 * 2
    assert all(t["failed"] is None and 0.0 <= t["reward"] <= 1.0 for t in trained)
    evals = read_rows(tmp_path, "eval")
    assert [e["step"] for e in evals] == [0, 5] and all(e["num_prompts"] == 4 for e in evals)
    assert report["exactly_once"]["ok"]
