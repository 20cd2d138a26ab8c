"""Tables, the Fig. 11-style chart, and the fidelity report in docs/simulator.md.

Parts:
- `point_table`, `grid_table`, `local_table`: rich tables on stdout (simulated vs paper).
- `ratio_errors`: laminar/baseline ratios, simulated vs the paper, per point.
- `plot`: grouped bars per model and scale, the paper's values as markers.
- `fig9_check`, `fig18_rows`, `repack_ablation`: the other checks of the report.
- `write_report`: replaces every `<!-- BEGIN name -->...<!-- END name -->` section of the
  markdown file with freshly generated content; the prose around them is left alone.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from laminar.sim import costs, paper
from laminar.sim.calibration import Calibration
from laminar.sim.core import paper_setup
from laminar.sim.replica import Replica
from laminar.sim.schedules import laminar as laminar_schedule

_console = Console(width=150)
TOL, HEADLINE_TOL = 0.25, 0.15


def fmt_k(x: float) -> str:
    return f"{x / 1e3:.1f}k"


def ratio_errors(point: dict[str, Any]) -> dict[str, tuple[float, float, float]]:
    """baseline -> (simulated ratio, paper ratio, sim/paper - 1)."""
    tp, ref = point["throughput_by_mode"], paper.FIG11[point["model"]][point["gpus"]]
    out = {}
    for b in paper.BASELINES:
        if b in tp and "laminar" in tp:
            sim, pap = tp["laminar"] / tp[b], ref["laminar"] / ref[b]
            out[b] = (sim, pap, sim / pap - 1.0)
    return out


def tolerance(model: str, gpus: int, b: str) -> float:
    return HEADLINE_TOL if (model, gpus, b) == paper.HEADLINE[:3] else TOL


def point_table(point: dict[str, Any]) -> None:
    m, g = point["model"], point["gpus"]
    ref = paper.FIG11[m][g]
    t = Table(title=f"{m} @ {g} GPUs — simulated vs paper (Fig. 11)")
    for col in ("mode", "trainer/rollout GPUs", "sim tok/s", "paper tok/s", "iteration s",
                "staleness", "laminar/x sim", "laminar/x paper"):
        t.add_column(col, justify="right")
    errs = ratio_errors(point)
    for mode, tp in point["throughput_by_mode"].items():
        d = point["details"][mode]
        r = errs.get(mode)
        t.add_row(mode, f"{d['trainer_gpus']}/{d['rollout_gpus']}", fmt_k(tp), fmt_k(ref[mode]),
                  f"{d['iteration_s']:.0f}", _staleness(d["staleness"]),
                  f"{r[0]:.2f}" if r else "", f"{r[1]:.2f}" if r else "")
    _console.print(t)


def _staleness(hist: dict[Any, int]) -> str:
    total = sum(hist.values()) or 1
    return " ".join(f"{k}:{v / total:.0%}" for k, v in sorted(hist.items(), key=lambda kv: int(kv[0])))


def grid_table(points: list[dict[str, Any]]) -> None:
    t = Table(title="Fig. 11 grid — laminar/baseline ratio, simulated (paper)")
    for col in ("model", "GPUs", "laminar sim (paper)") + paper.BASELINES:
        t.add_column(col, justify="right")
    for p in points:
        errs = ratio_errors(p)
        lam = p["throughput_by_mode"].get("laminar")
        t.add_row(p["model"], str(p["gpus"]),
                  f"{fmt_k(lam)} ({fmt_k(paper.FIG11[p['model']][p['gpus']]['laminar'])})" if lam else "",
                  *[f"{errs[b][0]:.2f} ({errs[b][1]:.2f})" if b in errs else "" for b in paper.BASELINES])
    _console.print(t)


def local_table(local: dict[str, Any], cal: Calibration, modes: tuple[str, ...], seed: int,
                warmup: int, measure: int) -> dict[str, Any]:
    from laminar.sim.local import local_setup, measured_throughput
    from laminar.sim.schedules import SCHEDULES

    results = {m: SCHEDULES[m](local_setup(m, local, cal, seed), warmup, measure) for m in modes}
    tp = {m: r.throughput for m, r in results.items()}
    measured = measured_throughput(local)
    t = Table(title="This machine — predicted (measured) throughput")
    for col in ("mode", "predicted tok/s", "laminar/x predicted", "measured tok/s",
                "laminar/x measured"):
        t.add_column(col, justify="right")
    for m, x in tp.items():
        mx = measured.get(m) if measured else None
        t.add_row(m, f"{x:.0f}", f"{tp['laminar'] / x:.2f}" if "laminar" in tp else "",
                  f"{mx:.0f}" if mx else "",
                  f"{measured['laminar'] / mx:.2f}" if mx and "laminar" in measured else "")
    _console.print(t)
    return {"model": "local", "throughput_by_mode": tp, "measured_throughput_by_mode": measured,
            "details": {m: r.as_dict() for m, r in results.items()}}


def plot(points: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in paper.MODELS if any(p["model"] == m for p in points)]
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 3.8), squeeze=False)
    colors = dict(sync="#9e9e9e", one_step="#90caf9", stream="#4db6ac", partial="#ffb74d",
                  laminar="#c62828")
    for ax, model in zip(axes[0], models):
        pts = sorted((p for p in points if p["model"] == model), key=lambda p: p["gpus"])
        modes = [m for m in (*paper.BASELINES, "laminar")
                 if m in pts[0]["throughput_by_mode"]]
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(pts))]
            ax.bar(xs, [p["throughput_by_mode"][mode] / 1e3 for p in pts], width,
                   color=colors[mode], label=f"{paper.PAPER_NAMES[mode]} ({mode})")
            ax.scatter(xs, [paper.FIG11[model][p["gpus"]][mode] / 1e3 for p in pts],
                       marker="_", s=120, color="black", zorder=3,
                       label="paper (Fig. 11)" if i == 0 else None)
        ax.set_xticks(range(len(pts)), [str(p["gpus"]) for p in pts])
        ax.set_xlabel("GPUs")
        ax.set_title(f"Qwen2.5-{model.upper()}")
        ax.set_ylabel("throughput (k tokens/s)")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- the other checks ------------------------------------------------------------------------

def fig9_check(cal: Calibration, seeds: int = 8) -> dict[str, float]:
    """One 32B TP4 replica generating a 512-trajectory batch, mean landmarks over seeds."""
    setup = paper_setup("laminar", "32b", 128, cal.with_overrides(decode_quantum=1))
    keys = ("kv_full_s", "queue_empty_s", "remaining_at_405s", "batch_done_s")
    acc = dict.fromkeys(keys, 0.0)
    for seed in range(seeds):
        setup.seed = seed
        r = Replica(0, setup.curve, setup.kv_capacity, setup.max_running, setup.prefill, 1)
        r.add(0.0, [tr for g in setup.make_workload().groups(32) for tr in g])
        left, full, qlast, at405, t = 512, None, 0.0, None, 0.0
        while (nxt := r.next_time()) is not None:
            t = nxt
            left -= len(r.advance_to(t))
            full = t if full is None and r.kv >= 0.97 * r.kv_capacity else full
            qlast = t if r.waiting else qlast
            at405 = left if at405 is None and t >= 405 else at405
        for k, v in zip(keys, (full if full is not None else math.inf, qlast, at405 or 0, t)):
            acc[k] += v / seeds
    return acc


def fig18_rows() -> list[tuple[str, int, float, float]]:
    return [(name, machines, costs.relay_broadcast_s(costs.QWEN25[name], machines), measured)
            for name in ("32b", "72b")
            for machines, measured in zip(paper.FIG18_MACHINES, paper.FIG18[name])]


def repack_ablation(cal: Calibration, warmup: int, measure: int) -> dict[str, float]:
    """Laminar 32B @ 128 GPUs (the paper's Table 1 setting) with and without repack."""
    on = laminar_schedule.run(paper_setup("laminar", "32b", 128, cal), warmup, measure, True)
    off = laminar_schedule.run(paper_setup("laminar", "32b", 128, cal), warmup, measure, False)
    return dict(train_on=on.throughput, train_off=off.throughput, gen_on=on.gen_throughput,
                gen_off=off.gen_throughput, repacks=on.repacks, moved=on.moved_trajs)


# --- the markdown report ---------------------------------------------------------------------

def write_report(path: Path, points: list[dict[str, Any]], cal: Calibration, warmup: int,
                 measure: int, args: Any) -> None:
    from laminar.sim.report_md import sections

    text = path.read_text() if path.exists() else ""
    command = "laminar simulate --report " + shlex.quote(str(path)) + (" --quick" if args.quick else "")
    for name, body in sections(points, cal, warmup, measure, command).items():
        block = f"<!-- BEGIN {name} -->\n{body.rstrip()}\n<!-- END {name} -->"
        pattern = re.compile(rf"<!-- BEGIN {name} -->.*?<!-- END {name} -->", re.S)
        if pattern.search(text):
            text = pattern.sub(lambda _: block, text)
        else:
            text += f"\n{block}\n"
    path.write_text(text)
    plot(points, path.parent / "simulator-fig11.png")
    print(f"wrote {path} and {path.parent / 'simulator-fig11.png'}")
