"""The figure of `laminar bench staleness`: by `rollout.version_lag`, one line per correction,
three panels: time to the held-out target (a cross on the top edge where the median run never
reached it), final held-out score (median, with the repeats' range) and training tokens/s.

    laminar bench staleness --out F.json     # also writes F.png
    python -m laminar.bench.staleness_plot F.json [F.png]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from laminar.report_plots import PALETTE, WIDTH_IN, pyplot


def _runs(report: dict[str, Any], kind: str, lag: str, key: str) -> list[float]:
    return [r[key] for r in report.get("runs", {}).get(kind, {}).get(lag, []) if r.get(key) is not None]


def plot_staleness(report: dict[str, Any], path: str | Path) -> Path:
    plt = pyplot()
    lags = [str(lag) for lag in report["lags"]]
    x = list(range(len(lags)))
    fig, axes = plt.subplots(1, 3, figsize=(WIDTH_IN * 1.4, 3.6), layout="constrained")
    ttt_ax, final_ax, tput_ax = axes
    reached = [v for by_lag in report["time_to_target_s"].values() for v in by_lag.values()
               if v is not None]
    ceiling = (max(reached) if reached else 1.0) * 1.15
    for i, kind in enumerate(report["corrections"]):
        colour, dx = PALETTE[i % len(PALETTE)], (i - (len(report["corrections"]) - 1) / 2) * 0.06
        xs = [v + dx for v in x]
        ttt = [report["time_to_target_s"][kind].get(lag) for lag in lags]
        ttt_ax.plot([xv for xv, t in zip(xs, ttt) if t is not None], [t for t in ttt if t is not None],
                    "o", color=colour, label=kind, ms=5)  # no lines: gaps are misses
        missed = [xv for xv, t in zip(xs, ttt) if t is None]
        ttt_ax.plot(missed, [ceiling] * len(missed), "x", color=colour, ms=7, mew=2)
        finals = [report["heldout_final"][kind].get(lag) for lag in lags]
        lo = [min(_runs(report, kind, lag, "heldout_final") or [f]) if f is not None else None
              for lag, f in zip(lags, finals)]
        hi = [max(_runs(report, kind, lag, "heldout_final") or [f]) if f is not None else None
              for lag, f in zip(lags, finals)]
        pts = [(xv, f, f - a, b - f) for xv, f, a, b in zip(xs, finals, lo, hi) if f is not None]
        if pts:
            px, py, ylo, yhi = zip(*pts)
            final_ax.errorbar(px, py, yerr=[ylo, yhi], fmt="o-", color=colour, lw=1.4, ms=4,
                              capsize=2, label=kind)
        tput = [report["throughput"][kind].get(lag) for lag in lags]
        tput_ax.plot([xv for xv, t in zip(xs, tput) if t is not None], [t for t in tput if t is not None],
                     "o-", color=colour, lw=1.4, ms=4, label=kind)
    ttt_ax.set_ylim(0, ceiling * 1.08)
    ttt_ax.set_title("time to held-out target (x: not reached)", fontsize=10)
    ttt_ax.set_ylabel("seconds since the rollouts started")
    if report.get("heldout_target") is not None:
        final_ax.axhline(report["heldout_target"], color="#555555", ls=":", lw=1, label="target")
    if report.get("heldout_start") is not None:
        final_ax.axhline(report["heldout_start"], color="#999999", ls="--", lw=1, label="warm start")
    final_ax.set_title("final held-out score (median, range)", fontsize=10)
    final_ax.set_ylabel(report.get("metric", "greedy_exact_match").replace("_", " "))
    tput_ax.set_title("training tokens/s (median)", fontsize=10)
    for ax in axes:
        ax.set_xticks(x, lags)
        ax.set_xlabel("rollout.version_lag")
        ax.grid(alpha=0.3)
    final_ax.legend(fontsize=7, frameon=False)
    fig.suptitle(f"laminar bench staleness ({report['task']}): {report['steps']} steps, "
                 f"{report['repeats']} repeat(s) per cell", fontsize=11)
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    src = Path(sys.argv[1])
    print(plot_staleness(json.loads(src.read_text()),
                         sys.argv[2] if len(sys.argv) > 2 else src.with_suffix(".png")))
