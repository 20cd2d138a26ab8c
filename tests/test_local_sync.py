"""The one-process runtime (`cluster.backend: local`) end to end on the tiny model: the same
rollout loop, trainer and pools as on a cluster, and exact resume from a checkpoint."""

from __future__ import annotations

import json

from laminar.config import load_config
from laminar.metrics import read_metrics, read_rows
from laminar.modes import run_training as run

SMALL = ["cluster.backend=local", "sft.enabled=false", "task.reverse.max_len=8", "rollout.max_new_tokens=9",
         "rollout.group_size=4", "trainer.prompts_per_step=4", "task.eval_prompts=8",
         "trainer.threads=1", "trainer.lr=1e-3"]


def test_sync_run_logs_every_step(tmp_path):
    cfg = load_config("examples/reverse-sync.yaml", SMALL + [f"run_dir={tmp_path}", "trainer.total_steps=2"])
    result = run(cfg)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward", "exact_match", "response_len_p50", "response_len_p99",
                "throughput_tokens_per_s", "gen_tokens_per_s", "loss", "staleness_hist"):
        assert key in rows[0], key
    assert rows[0]["staleness_hist"] == {"0": 16}  # sync: every sample fresh
    # the engine-trainer mismatch on those fresh tokens: the native engine's fp32 numerics
    # against the trainer's forward (measured here: mean ~1e-7, p99 ~5e-7)
    for r in rows:
        assert r["engine_backend"] == "native"
        assert 0.0 <= r["logprob_abs_diff_mean"] < 1e-5 and 0.0 <= r["logprob_abs_diff_p99"] < 1e-4
    evals = read_rows(tmp_path, "eval")  # held-out: at the start, at the end
    assert [(e["step"], e["version"]) for e in evals] == [(0, 0), (2, 2)]
    assert all(e["num_prompts"] == 8 and 0.0 <= e["greedy_reward"] <= 1.0 for e in evals)
    assert result["heldout_last"]["version"] == 2
    spans = read_rows(tmp_path, "span")
    assert {s["who"] for s in spans} >= {"rollout0", "trainer"}
    assert "train" in {s["what"] for s in spans if s["who"] == "trainer"}  # push: < 5 ms here
    assert (tmp_path / "checkpoints" / "step_000002" / "model" / "config.json").is_file()

    from laminar.report import main as report

    summary = report(str(tmp_path))
    assert summary["steps"] == 2 and summary["staleness_hist"] == {0: 32}
    assert (tmp_path / "report.png").stat().st_size > 0


def test_resume_gives_the_identical_next_step(tmp_path):
    full = tmp_path / "full"
    cfg = load_config("examples/reverse-sync.yaml",
                      SMALL + [f"run_dir={full}", "trainer.total_steps=3", "trainer.checkpoint_every=2"])
    run(cfg)
    ckpt = full / "checkpoints" / "step_000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["version"] == 2 and state["prompts"]["sampler"]["position"] == 8

    resumed = tmp_path / "resumed"
    cfg = load_config("examples/reverse-sync.yaml",
                      SMALL + [f"run_dir={resumed}", "trainer.total_steps=3",
                              f"trainer.from_checkpoint={ckpt}"])
    run(cfg)
    step3 = read_metrics(full)[-1]
    again = read_metrics(resumed)
    assert [r["step"] for r in again] == [3]
    for key in ("loss", "reward", "grad_norm", "response_tokens"):
        assert again[0][key] == step3[key], key


def test_held_out_evaluations_on_a_wall_clock_schedule(tmp_path):
    """trainer.eval_every_s: the newest version is scored every so many seconds (here at every
    poll), each version once, and the bench's held-out curve times each point by its version's
    publication."""
    from laminar.bench.learning import heldout_curve

    cfg = load_config("examples/reverse-sync.yaml", SMALL + [
        f"run_dir={tmp_path}", "trainer.total_steps=3", "trainer.eval_every=0",
        "trainer.eval_every_s=0.001"])
    run(cfg)
    versions = [e["version"] for e in read_rows(tmp_path, "eval")]
    assert sorted(versions) == [0, 1, 2, 3]
    curve = heldout_curve(read_rows(tmp_path))
    published = {r["version"]: r["time"] for r in read_metrics(tmp_path)}
    assert [p[1] for p in curve] == [0, 1, 2, 3]
    assert [p[0] for p in curve] == [0.0] + [published[v] for v in (1, 2, 3)]
    assert 0.0 < curve[1][0] < curve[2][0] < curve[3][0]  # seconds since the rollouts started
