"""Run metrics: one JSON object per trainer step appended to RUN_DIR/metrics.jsonl, and a short
line on the console. `summarize` turns a list of trajectories into the per-step numbers."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from laminar.types import Trajectory

# console column -> metric key, format
CONSOLE = [("reward", "reward", ".3f"), ("exact", "exact_match", ".2f"),
           ("len p50", "response_len_p50", ".0f"), ("p99", "response_len_p99", ".0f"),
           ("tok/s", "throughput_tokens_per_s", ".0f"), ("loss", "loss", "+.4f")]


def summarize(trajs: list[Trajectory]) -> dict[str, Any]:
    lengths = np.array([len(t.response_ids) for t in trajs])
    staleness = Counter(t.staleness for t in trajs if t.staleness is not None)
    return {
        "reward": float(np.mean([t.reward for t in trajs])),
        "exact_match": float(np.mean([t.exact_match for t in trajs])),
        "response_len_p50": float(np.percentile(lengths, 50)),
        "response_len_p99": float(np.percentile(lengths, 99)),
        "batch_tokens": int(sum(t.num_tokens for t in trajs)),
        "response_tokens": int(lengths.sum()),
        "staleness_hist": {str(k): v for k, v in sorted(staleness.items())},
    }


def set_aside(path: Path) -> None:
    """Move an earlier run's file out of the way (name.<time>.jsonl) instead of mixing runs."""
    if path.exists():
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
        path.rename(path.with_name(f"{path.stem}.{stamp}{path.suffix}"))


class MetricsLogger:
    def __init__(self, run_dir: str | Path, total_steps: int, console: bool = True,
                 fresh: bool = True) -> None:
        """`fresh`: a new run; an earlier run's metrics in the same directory are kept aside
        as metrics.<time>.jsonl rather than mixed in (a resumed run appends instead)."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fresh:
            set_aside(self.path)
        self.total_steps = total_steps
        self.console = console
        self.t0 = time.time()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": round(time.time() - self.t0, 3), **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.console:
            cols = [f"{name} {metrics[key]:{fmt}}" for name, key, fmt in CONSOLE
                    if metrics.get(key) is not None]
            print(f"step {step:>4}/{self.total_steps} | " + " | ".join(cols), flush=True)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reward_trend(rows: list[dict[str, Any]], window: int = 10) -> tuple[float, float]:
    """Mean training reward over the first and the last `window` steps of a run."""
    rewards = [r["reward"] for r in rows if "reward" in r]
    k = max(1, min(window, len(rewards) // 2))
    return float(np.mean(rewards[:k])), float(np.mean(rewards[-k:]))
