"""`laminar report RUN_DIR`: a run at a glance, from its metrics.jsonl.

Prints a summary (steps, reward first → last, throughput after warm-up, staleness histogram,
push stall and pull latency) and writes RUN_DIR/report.png: reward, throughput and staleness
over the trainer steps.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from laminar.config import ConfigError
from laminar.metrics import read_metrics, reward_trend

WARMUP = 3


def summarize_run(rows: list[dict[str, Any]]) -> dict[str, Any]:
    first, last = reward_trend(rows)
    tail = [r for r in rows[WARMUP:] if r.get("throughput_tokens_per_s")]
    hist: Counter = Counter()
    for r in rows:
        hist.update({int(k): v for k, v in r.get("staleness_hist", {}).items()})

    def mean(key: str) -> float | None:
        values = [r[key] for r in rows[WARMUP:] if r.get(key) is not None]
        return float(np.mean(values)) if values else None

    return {
        "steps": rows[-1]["step"], "wall_s": rows[-1]["time"],
        "reward_first": first, "reward_last": last,
        "throughput_tokens_per_s": (sum(r["batch_tokens"] for r in tail)
                                    / sum(r["batch_tokens"] / r["throughput_tokens_per_s"] for r in tail)
                                    if tail else None),
        "staleness_hist": dict(sorted(hist.items())),
        "push_stall_s": mean("push_stall_s"), "pull_latency_s": mean("pull_latency_s"),
        "trainer_idle_frac": mean("trainer_idle_frac"), "rollout_idle_frac": mean("rollout_idle_frac"),
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    axes[0].plot(steps, [r["reward"] for r in rows], lw=0.8, label="reward")
    axes[0].plot(steps, [r["exact_match"] for r in rows], lw=0.8, label="exact match")
    axes[0].set_title("training reward")
    axes[0].legend()
    axes[1].plot(steps, [r.get("throughput_tokens_per_s") or np.nan for r in rows], lw=0.8)
    axes[1].set_title("training throughput (tokens/s)")
    hist = [r.get("staleness_hist", {}) for r in rows]
    for s in sorted({int(k) for h in hist for k in h}):
        axes[2].plot(steps, [h.get(str(s), 0) for h in hist], lw=0.8, label=f"staleness {s}")
    axes[2].set_title("samples per staleness")
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.set_xlabel("trainer step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(run_dir: str) -> dict[str, Any]:
    path = Path(run_dir)
    if not (path / "metrics.jsonl").is_file():
        raise ConfigError(f"'{run_dir}' has no metrics.jsonl; pass a run directory such as runs/reverse")
    rows = read_metrics(path)
    if not rows:
        raise ConfigError(f"'{run_dir}/metrics.jsonl' is empty: the run logged no trainer step yet")
    summary = summarize_run(rows)
    plot(rows, path / "report.png")
    for key, value in summary.items():
        shown = f"{value:.4g}" if isinstance(value, float) else value
        print(f"{key:>24}: {shown}")
    print(f"{'plot':>24}: {path / 'report.png'}")
    return summary
