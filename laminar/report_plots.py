"""The figures of `laminar report`: each section of report.html is drawn here with matplotlib
(Agg only, no display) and embedded as a base64 PNG, so the page needs nothing but itself.

A section whose rows a run lacks (an older run has no eval or span rows) comes back as a note
instead of an empty plot; with several runs the curves of all of them share the axes.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# the colour of each span `what` on the timeline (rollouts, then the trainer)
SPAN_COLOURS = {"generate": "#1f77b4", "idle": "#d9d9d9", "pull": "#ff7f0e", "eval": "#9467bd",
                "wait": "#bdbdbd", "train": "#2ca02c", "push": "#d62728"}
IDLE = ("idle", "wait")
EVENT_COLOURS = {"repack": "#e377c2", "failure": "#000000", "relay_failure": "#8c564b",
                 "trainer_restart": "#d62728", "resume": "#17becf", "join": "#2ca02c",
                 "leave": "#7f7f7f", "chain": "#bcbd22"}
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf"]
LINESTYLES = ["-", "--", ":", "-."]
WIDTH_IN, DPI = 12.5, 100


@dataclass
class Run:
    """One run directory's rows, split by kind; `final` is the run's own report.json."""

    name: str
    path: Path
    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]] = field(default_factory=list)
    spans: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)


@dataclass
class Section:
    """One labelled figure of the page: a PNG, a note in its place, or both (a note saying
    which of several runs had nothing to draw)."""

    title: str
    caption: str
    png: str | None = None
    note: str | None = None


def pyplot():
    """matplotlib.pyplot on the Agg backend: the report never opens a window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def encode_png(fig) -> str:
    """The figure as base64 PNG (for a data: URI), closed afterwards."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    pyplot().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else np.nan


def _line(ax, x: list[float], y: list[float], **kw: Any) -> None:
    """A curve through the points that have a value (a step without one leaves no gap, and a
    lone point still shows as a dot)."""
    pts = [(a, b) for a, b in zip(x, y) if np.isfinite(a) and np.isfinite(b)]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    if len(pts) == 1 and not kw.get("marker"):
        kw["marker"] = "o"
    ax.plot(xs, ys, **kw)


def _style(run_i: int, metric_i: int, n_runs: int) -> dict[str, Any]:
    """One run: a colour per metric. Several: a colour per run, a line style per metric."""
    if n_runs == 1:
        return {"color": PALETTE[metric_i % len(PALETTE)], "ls": "-"}
    return {"color": PALETTE[run_i % len(PALETTE)], "ls": LINESTYLES[metric_i % len(LINESTYLES)]}


def _label(run: Run, metric: str, n_runs: int) -> str:
    return metric if n_runs == 1 else f"{run.name} · {metric}"


def _missing(runs: list[Run], lacking: list[Run], what: str) -> str | None:
    if not lacking:
        return None
    if len(runs) == 1:
        return f"This run has {what}."
    return f"{', '.join(r.name for r in lacking)}: {what}."


def _two_panels(title: str):
    fig, axes = pyplot().subplots(1, 2, figsize=(WIDTH_IN, 3.9), layout="constrained")
    fig.suptitle(title, fontsize=11)
    for ax in axes:
        ax.grid(alpha=0.3)
    return fig, axes


def _finish_legend(fig, axes) -> None:
    """One legend for the figure, right of the panels, with every panel's curves once."""
    seen = {lab: h for ax in axes for h, lab in zip(*ax.get_legend_handles_labels())}
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="outside right upper", fontsize=8, frameon=False)


def draw_series(axes, runs: list[Run], pick, metrics: list[tuple[str, str]], marker: str = "") -> None:
    """Metric curves of every run against wall-clock seconds (axes[0]) and trainer step
    (axes[1]); `pick(run)` gives the rows, `metrics` (key, legend name)."""
    for i, run in enumerate(runs):
        rows = pick(run)
        if not rows:
            continue
        t = [_num(r.get("time")) for r in rows]
        s = [_num(r.get("step")) for r in rows]
        for j, (key, name) in enumerate(metrics):
            y = [_num(r.get(key)) for r in rows]
            kw = _style(i, j, len(runs)) | {"marker": marker, "ms": 4, "lw": 1.2}
            _line(axes[0], t, y, label=_label(run, name, len(runs)), **kw)
            _line(axes[1], s, y, **kw)
    axes[0].set_xlabel("wall-clock time since run start (s)")
    axes[1].set_xlabel("trainer step")


def score_section(runs: list[Run]) -> Section:
    title = "Held-out score"
    caption = ("Exact match on the held-out prompts, greedy and sampled decoding, from the eval "
               "rows (step 0: the warm start before any update).")
    lacking = [r for r in runs if not r.evals]
    note = _missing(runs, lacking, "no eval rows (a run from before held-out evaluation was "
                                   "logged, or trainer.eval_every was never reached)")
    if len(lacking) == len(runs):
        return Section(title, caption, note=note)
    fig, axes = _two_panels("held-out exact match (eval rows)")
    draw_series(axes, runs, lambda r: r.evals, [("greedy_exact_match", "greedy"),
                                                ("sampled_exact_match", "sampled")], marker="o")
    for ax in axes:
        ax.set_ylabel("exact match (fraction of prompts)")
        ax.set_ylim(-0.03, 1.03)
    _finish_legend(fig, axes)
    return Section(title, caption, png=encode_png(fig), note=note)


def reward_section(runs: list[Run]) -> Section:
    fig, axes = _two_panels("training reward (step rows)")
    draw_series(axes, runs, lambda r: r.steps, [("reward", "mean reward"),
                                                ("exact_match", "exact match")])
    for ax in axes:
        ax.set_ylabel("reward / exact match (0..1)")
    _finish_legend(fig, axes)
    return Section("Training reward", "Mean reward and exact-match rate of each trained batch.",
                   png=encode_png(fig))


def mismatch_section(runs: list[Run]) -> Section:
    """Off-policy metrics of every step (docs/staleness.md): |log pi_trainer - log pi_behaviour|
    at p99 over every trained token (staleness and engine mismatch together) and over the
    staleness-0 ones (the engines' numerics alone), then the importance ratio's p99 and the share
    of tokens a correction masked."""
    title = "Off-policy: mismatch and importance ratios"
    caption = ("Left: p99 of |log π_trainer − log π_behaviour| per trained token, over all tokens "
               "(staleness and engine mismatch together) and over staleness-0 tokens (the "
               "engines' numerics), log scale. Right: the importance ratio's p99 and the share of "
               "tokens trainer.correction masked (docs/staleness.md).")
    lacking = [r for r in runs if not any(x.get("logprob_abs_diff_all_p99") is not None for x in r.steps)]
    note = _missing(runs, lacking, "no mismatch metrics in its step rows (a run from before "
                                   "they were logged)")
    if len(lacking) == len(runs):
        return Section(title, caption, note=note)
    fig, axes = pyplot().subplots(1, 2, figsize=(WIDTH_IN, 3.9), layout="constrained")
    fig.suptitle("mismatch and importance ratios by trainer step", fontsize=11)
    for i, run in enumerate(runs):
        s = [_num(r.get("step")) for r in run.steps]
        for j, (key, name) in enumerate([("logprob_abs_diff_all_p99", "|Δ log p| p99, all tokens"),
                                         ("logprob_abs_diff_p99", "|Δ log p| p99, staleness 0")]):
            _line(axes[0], s, [_num(r.get(key)) for r in run.steps], lw=1.2,
                  label=_label(run, name, len(runs)), **_style(i, j, len(runs)))
        for j, (key, name) in enumerate([("is_ratio_p99", "ratio p99"),
                                         ("correction_masked", "share masked")]):
            _line(axes[1], s, [_num(r.get(key)) for r in run.steps], lw=1.2,
                  label=_label(run, name, len(runs)), **_style(i, j + 2, len(runs)))
    axes[0].set_yscale("log")
    axes[0].set_ylabel("nats")
    axes[1].set_ylabel("ratio / share")
    for ax in axes:
        ax.set_xlabel("trainer step")
        ax.grid(alpha=0.3)
    _finish_legend(fig, axes)
    return Section(title, caption, png=encode_png(fig), note=note)


def draw_train_throughput(ax, runs: list[Run]) -> None:
    for i, run in enumerate(runs):
        _line(ax, [_num(r.get("time")) for r in run.steps],
              [_num(r.get("throughput_tokens_per_s")) for r in run.steps],
              label=_label(run, "training", len(runs)), lw=1.2, **_style(i, 0, len(runs)))
    ax.set_xlabel("wall-clock time since run start (s)")
    ax.set_ylabel("training throughput (tokens/s)")
    ax.set_title("trained tokens / time between updates", fontsize=9)
    ax.set_ylim(bottom=0)


def throughput_section(runs: list[Run]) -> Section:
    fig, axes = _two_panels("throughput over time")
    draw_train_throughput(axes[0], runs)
    for i, run in enumerate(runs):
        t = [_num(r.get("time")) for r in run.steps]
        _line(axes[1], t, [_num(r.get("gen_tokens_per_s")) for r in run.steps], lw=1.4,
              label=_label(run, "generation, all rollouts", len(runs)), **_style(i, 1, len(runs)))
        if len(runs) == 1:
            ids = sorted({k for r in run.steps for k in (r.get("gen_tokens_per_s_by_rollout") or {})})
            for j, rid in enumerate(ids):
                _line(axes[1], t, [_num((r.get("gen_tokens_per_s_by_rollout") or {}).get(rid))
                                   for r in run.steps], lw=0.8, label=f"generation, {rid}",
                      **_style(0, j + 2, 1))
    axes[1].set_xlabel("wall-clock time since run start (s)")
    axes[1].set_ylabel("generation throughput (tokens/s)")
    axes[1].set_title("generated tokens / s", fontsize=9)
    axes[1].set_ylim(bottom=0)
    _finish_legend(fig, axes)
    return Section("Throughput", "Training throughput (prompt + response tokens of each global "
                   "batch over the time since the previous update; none on step 1) and "
                   "generation throughput of the rollouts.", png=encode_png(fig))


def staleness_totals(run: Run) -> dict[int, int]:
    total: dict[int, int] = {}
    for r in run.steps:
        for k, v in (r.get("staleness_hist") or {}).items():
            total[int(k)] = total.get(int(k), 0) + int(v)
    return dict(sorted(total.items()))


def draw_staleness(ax, runs: list[Run]) -> None:
    """Share of trained trajectories per staleness, bars side by side for several runs."""
    totals = [staleness_totals(r) for r in runs]
    keys = sorted({k for t in totals for k in t})
    width = 0.8 / max(1, len(runs))
    for i, (run, total) in enumerate(zip(runs, totals)):
        n = sum(total.values()) or 1
        x = np.arange(len(keys)) + (i - (len(runs) - 1) / 2) * width
        share = [100 * total.get(k, 0) / n for k in keys]
        bars = ax.bar(x, share, width, color=PALETTE[i % len(PALETTE)], label=run.name)
        if len(runs) == 1:
            ax.bar_label(bars, [str(total.get(k, 0)) for k in keys], fontsize=8, padding=2)
    ax.set_xticks(range(len(keys)), [str(k) for k in keys])
    ax.set_xlim(-0.7, max(len(keys), 4) - 0.3)  # a lone bar stays bar-sized
    ax.set_xlabel("staleness (weight versions behind the trained policy)")
    ax.set_ylabel("share of trained trajectories (%)")
    ax.set_ylim(0, 110)
    ax.grid(axis="y", alpha=0.3)


def staleness_section(runs: list[Run]) -> Section:
    fig, ax = pyplot().subplots(figsize=(WIDTH_IN * 0.6, 3.6), layout="constrained")
    draw_staleness(ax, runs)
    ax.set_title("staleness histogram (sum over all steps)", fontsize=11)
    if len(runs) > 1:
        ax.legend(fontsize=8, frameon=False)
    return Section("Staleness", "How many updates old the weights that generated each trained "
                   "trajectory were (numbers on the bars: trajectories).", png=encode_png(fig))


def kv_section(runs: list[Run]) -> Section:
    fig, ax = pyplot().subplots(figsize=(WIDTH_IN, 3.3), layout="constrained")
    only_mean = []
    for i, run in enumerate(runs):
        t = [_num(r.get("time")) for r in run.steps]
        ids = sorted({k for r in run.steps for k in (r.get("kv_util_by_rollout") or {})})
        if not ids:
            only_mean.append(run)
            _line(ax, t, [100 * _num(r.get("kv_util_mean")) for r in run.steps], lw=1.2,
                  label=_label(run, "mean over rollouts", len(runs)), **_style(i, 0, len(runs)))
        for j, rid in enumerate(ids):
            _line(ax, t, [100 * _num((r.get("kv_util_by_rollout") or {}).get(rid)) for r in run.steps],
                  lw=1.0, marker=".", ms=4, label=_label(run, rid, len(runs)), **_style(i, j, len(runs)))
    ax.set_xlabel("wall-clock time since run start (s)")
    ax.set_ylabel("KV cache in use (% of capacity)")
    ax.set_title("KV-cache utilisation per rollout", fontsize=11)
    top = max([y for ln in ax.get_lines() for y in ln.get_ydata()] or [0])
    ax.set_ylim(0, min(102, max(10, 1.2 * top)))  # low use stays readable; 100 % is the cap
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    note = _missing(runs, only_mean, "no per-rollout KV rows (kv_util_by_rollout); the mean "
                                     "over rollouts is drawn instead")
    return Section("KV-cache utilisation", "Share of each rollout engine's KV-cache capacity "
                   "held by running sequences, as reported with every trainer step.",
                   png=encode_png(fig), note=note)


def latency_section(runs: list[Run]) -> Section:
    title = "Environment latency"
    caption = "Sampled delays of the environment (tool call) per trajectory, all steps together."
    samples = [[float(x) for r in run.steps for x in (r.get("env_latency_s") or [])] for run in runs]
    lacking = [run for run, s in zip(runs, samples) if not s]
    note = _missing(runs, lacking, "no environment-latency samples (bench.env_latency is "
                                   "off, or the run predates env_latency_s)")
    if len(lacking) == len(runs):
        return Section(title, caption, note=note)
    fig, ax = pyplot().subplots(figsize=(WIDTH_IN * 0.6, 3.6), layout="constrained")
    every = np.array([x for s in samples for x in s])
    lo, hi = max(every.min(), 1e-4), max(every.max(), 1e-3)
    log = hi / lo > 20
    bins = np.geomspace(lo, hi, 40) if log else np.linspace(0, hi, 40)
    for i, (run, s) in enumerate(zip(runs, samples)):
        if s:
            p50, p99 = np.percentile(s, [50, 99])
            ax.hist(np.clip(s, lo, None), bins=bins, histtype="step" if len(runs) > 1 else "bar",
                    color=PALETTE[i % len(PALETTE)], lw=1.4, alpha=1 if len(runs) > 1 else 0.8,
                    label=f"{run.name + ': ' if len(runs) > 1 else ''}p50 {p50:.3g} s, "
                          f"p99 {p99:.3g} s (n={len(s)})")
    if log:
        from matplotlib.ticker import FuncFormatter

        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("environment latency per trajectory (s" + (", log scale)" if log else ")"))
    ax.set_ylabel("samples")
    ax.set_title("environment latency distribution", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    return Section(title, caption, png=encode_png(fig), note=note)


def _lane_order(who: str) -> tuple[int, int, str]:
    """Trainer on top, then rollouts by number, then anything else."""
    digits = "".join(c for c in who if c.isdigit())
    return (0 if who == "trainer" else 1 if who.startswith("rollout") else 2,
            int(digits) if digits else 0, who)


def timeline_section(run: Run, n_runs: int) -> Section:
    """The paper's Fig. 3 for this run: one lane per rollout and one for the trainer, each span
    coloured by what it was doing, generate spans labelled with their weight version, events
    as vertical marks."""
    title = "Timeline" + (f" — {run.name}" if n_runs > 1 else "")
    caption = ("What every rollout and the trainer did over the run (span rows); a generate span "
               "is labelled v<N> with the weight version that generated it where it is wide "
               "enough; vertical marks are events.")
    if not run.spans:
        return Section(title, caption, note=f"{run.name} has no span rows (a run from before "
                                            "timelines were logged), so no timeline.")
    plt = pyplot()
    lanes = sorted({str(s.get("who")) for s in run.spans}, key=_lane_order)
    end = max(max(_num(s.get("end")) for s in run.spans),
              max((_num(e.get("time")) for e in run.events), default=0.0), 1e-6)
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 1.3 + 0.42 * len(lanes)), layout="constrained")
    axes_px = WIDTH_IN * DPI * 0.8  # the plot area's width in pixels, about
    labelled = 0
    for lane_i, who in enumerate(lanes):
        mine = [s for s in run.spans if str(s.get("who")) == who]
        # waiting first, as the background; a span under 3 px has no white edge and is drawn
        # 1.5 px wide so that a short generate or push still shows
        px = end / axes_px
        for what in sorted({str(s.get("what")) for s in mine}, key=lambda w: (w not in IDLE, w)):
            bars = [(_num(s["start"]), max(_num(s["end"]) - _num(s["start"]), 0.0))
                    for s in mine if str(s.get("what")) == what]
            colour = SPAN_COLOURS.get(what, "#17becf")
            wide = [b for b in bars if b[1] >= 3 * px]
            thin = [(x, max(w, 1.5 * px)) for x, w in bars if w < 3 * px]
            ax.broken_barh(wide, (lane_i - 0.38, 0.76), facecolors=colour, edgecolor="white", lw=0.4)
            ax.broken_barh(thin, (lane_i - 0.38, 0.76), facecolors=colour, lw=0)
        for s in mine:
            width_px = (_num(s["end"]) - _num(s["start"])) / px
            if s.get("what") == "generate" and s.get("version") is not None and width_px > 26 \
                    and labelled < 400:
                ax.text((_num(s["start"]) + _num(s["end"])) / 2, lane_i, f"v{s['version']}",
                        ha="center", va="center", fontsize=7, color="white", clip_on=True)
                labelled += 1
    handles = [plt.Rectangle((0, 0), 1, 1, color=SPAN_COLOURS.get(w, "#17becf"), label=w)
               for w in sorted({str(s.get("what")) for s in run.spans},
                               key=lambda w: list(SPAN_COLOURS).index(w) if w in SPAN_COLOURS else 99)]
    for what in sorted({str(e.get("what")) for e in run.events}):
        colour = EVENT_COLOURS.get(what, "#000000")
        for e in run.events:
            if str(e.get("what")) == what:
                ax.axvline(_num(e.get("time")), color=colour, ls="--", lw=1.0)
                ax.plot(_num(e.get("time")), -0.55, marker="v", color=colour, ms=8, clip_on=False)
        handles.append(plt.Line2D([], [], color=colour, ls="--", marker="v", label=f"event: {what}"))
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.45, -0.55)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("wall-clock time since run start (s)")
    ax.set_title(f"timeline of {run.name}: rollouts and trainer", fontsize=11)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8,
              frameon=False)
    return Section(title, caption, png=encode_png(fig))


def overview_png(run: Run, path: Path) -> None:
    """RUN_DIR/report.png: reward, training throughput and staleness in one image, for a
    glance outside a browser."""
    fig, axes = pyplot().subplots(1, 3, figsize=(14, 3.8), layout="constrained")
    steps = [_num(r.get("step")) for r in run.steps]
    axes[0].plot(steps, [_num(r.get("reward")) for r in run.steps], lw=1, label="mean reward")
    axes[0].plot(steps, [_num(r.get("exact_match")) for r in run.steps], lw=1, label="exact match")
    axes[0].set_xlabel("trainer step")
    axes[0].set_ylabel("reward / exact match (0..1)")
    axes[0].legend(fontsize=8)
    draw_train_throughput(axes[1], [run])
    draw_staleness(axes[2], [run])
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
