"""`calc` learns in laminar mode (slow: about 10-15 minutes on 2 cores; `pytest -m slow`):
examples/calc.yaml as shipped, warm start then RL on the embedded Ray cluster with the real
sandbox, and the held-out exact match after RL is above the warm start's. docs/agentic.md
quotes the numbers of a run of exactly this."""

from __future__ import annotations

from pathlib import Path

import pytest

from laminar.config import load_config
from laminar.metrics import read_rows
from laminar.modes import run_training

EXAMPLE = Path(__file__).parent.parent / "examples" / "calc.yaml"


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 10-15 min on 2 cores: above the suite's 600 s per test
def test_calc_heldout_exact_match_rises_above_the_warm_start(tmp_path, ray_cluster):
    cfg = load_config(str(EXAMPLE), [f"run_dir={tmp_path}"])
    report = run_training(cfg)
    evals = [e for e in read_rows(tmp_path, "eval")]
    start, end = evals[0], evals[-1]
    assert start["step"] == 0 and end["step"] == cfg.trainer.total_steps
    print(f"calc held-out greedy exact match {start['greedy_exact_match']:.3f} -> "
          f"{end['greedy_exact_match']:.3f}")
    assert end["greedy_exact_match"] > start["greedy_exact_match"]
    assert report["exactly_once"]["ok"]
    steps = read_rows(tmp_path, "step")
    assert max(x for r in steps for x in r["turns"]) >= 2  # real tool use
    assert sum(r["tool_calls"].get("ok", 0) for r in steps[-1:]) > 0
