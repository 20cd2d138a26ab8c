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
    """`reward` is the mean over the trajectories whose reward worked (0 when none did);
    `failed_trajectories` counts the others, which the trainer left out."""
    lengths = np.array([len(t.response_ids) for t in trajs])
    staleness = Counter(t.staleness for t in trajs if t.staleness is not None)
    scored = [t.reward for t in trajs if t.failed is None]
    return {
        "reward": float(np.mean(scored)) if scored else 0.0,
        "failed_trajectories": len(trajs) - len(scored),
        "exact_match": float(np.mean([t.exact_match for t in trajs])),
        "response_len_p50": float(np.percentile(lengths, 50)),
        "response_len_p99": float(np.percentile(lengths, 99)),
        "batch_tokens": int(sum(t.num_tokens for t in trajs)),
        "response_tokens": int(lengths.sum()),
        "staleness_hist": {str(k): v for k, v in sorted(staleness.items())},
    }


def evenly(values: list[Any], at_most: int) -> list[Any]:
    """At most `at_most` of `values`, drawn evenly from first to last (all when fewer)."""
    if len(values) <= at_most:
        return list(values)
    return [values[i] for i in np.linspace(0, len(values) - 1, at_most).astype(int)]


def set_aside(path: Path) -> None:
    """Move an earlier run's file out of the way (name.<time>.jsonl) instead of mixing runs."""
    if path.exists():
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
        path.rename(path.with_name(f"{path.stem}.{stamp}{path.suffix}"))


KINDS = ("step", "eval", "span", "event")  # the rows of RUN_DIR/metrics.jsonl (docs/metrics.md)


class MetricsLogger:
    """RUN_DIR/metrics.jsonl: one JSON object a line, each with a `kind` (KINDS) and `time`
    (seconds since the run started); every row also goes to the `sinks` (TensorBoard, W&B,
    MLflow: laminar/sinks.py), each an object with `write(row)` and `close()`."""

    def __init__(self, run_dir: str | Path, total_steps: int, console: bool = True,
                 fresh: bool = True, sinks: list[Any] | None = None, t0: float | None = None) -> None:
        """`fresh`: a new run; an earlier run's metrics in the same directory are kept aside
        as metrics.<time>.jsonl rather than mixed in (a resumed run appends instead); `t0`:
        the unix time rows count from (default: now)."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fresh:
            set_aside(self.path)
        self.total_steps = total_steps
        self.console = console
        self.sinks = list(sinks or [])
        self.t0 = time.time() if t0 is None else t0

    def since_start(self, unix_time: float) -> float:
        return round(unix_time - self.t0, 3)

    def write(self, kind: str, row: dict[str, Any]) -> dict[str, Any]:
        """Append one row (`time`, seconds since the start, defaults to now); returns it."""
        record = {"kind": kind, "time": self.since_start(time.time()), **row}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.write(record)
        return record

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        record = self.write("step", {"step": step, **metrics})
        if self.console:
            cols = [f"{name} {metrics[key]:{fmt}}" for name, key, fmt in CONSOLE
                    if metrics.get(key) is not None]
            print(f"step {step:>4}/{self.total_steps} | " + " | ".join(cols), flush=True)
        return record

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def read_rows(run_dir: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The rows of RUN_DIR/metrics.jsonl, all or one kind's (a row without `kind`, from a run
    before kinds existed, is a step row)."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows if kind is None else [r for r in rows if r.get("kind", "step") == kind]


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The trainer-step rows."""
    return read_rows(run_dir, "step")


def reward_trend(rows: list[dict[str, Any]], window: int = 10) -> tuple[float, float]:
    """Mean training reward over the first and the last `window` steps of a run."""
    rewards = [r["reward"] for r in rows if "reward" in r]
    k = max(1, min(window, len(rewards) // 2))
    return float(np.mean(rewards[:k])), float(np.mean(rewards[-k:]))
