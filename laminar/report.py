"""`laminar report RUN_DIR [RUN_DIR ...]`: runs at a glance, from their metrics.jsonl.

One run: prints a summary (steps, reward first → last, throughput after warm-up, staleness
histogram, push stall and pull latency), writes RUN_DIR/report.png (reward, throughput and
staleness in one image) and RUN_DIR/report.html, a self-contained page (figures embedded, no
network) with held-out score, reward, throughput, staleness, KV use, environment latency and
the timeline of every rollout and the trainer. Several runs: their curves share the axes in
one page, by default the first run's parent directory's report.html. A `laminar bench modes`
results .json renders as the throughput-per-schedule bar chart.
"""

from __future__ import annotations

import html
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from laminar.config import ConfigError
from laminar.metrics import read_rows, reward_trend
from laminar import report_plots as plots
from laminar.report_plots import (Run, Section, kv_section, latency_section, overview_png,
                                  mismatch_section, reward_section, score_section, staleness_section,
                                  throughput_section, timeline_section)

WARMUP = 3
PASS = ("pass a run directory (a config's run_dir, e.g. runs/reverse) or the .json of "
        "`laminar bench modes --out`")


def summarize_run(rows: list[dict[str, Any]]) -> dict[str, Any]:
    first, last = reward_trend(rows)
    tail = [r for r in rows[WARMUP:] if r.get("throughput_tokens_per_s")]
    hist: Counter = Counter()
    for r in rows:
        hist.update({int(k): v for k, v in (r.get("staleness_hist") or {}).items()})

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


def _rows(path: Path) -> list[dict[str, Any]]:
    """Every row of RUN_DIR/metrics.jsonl; a line that is not a JSON object is a ConfigError
    naming the file and line (a hand-edited or truncated file), not a traceback."""
    file = path / "metrics.jsonl"
    try:
        rows = read_rows(path)
        if all(isinstance(r, dict) for r in rows):
            return rows
    except json.JSONDecodeError:
        pass
    bad = next(n for n, line in enumerate(file.read_text().splitlines(), 1)
               if line.strip() and not _is_object(line))
    raise ConfigError(f"'{file}' line {bad} is not a JSON object; delete or fix that line "
                      f"(each line is one row), or {PASS}")


def _is_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def _mode(path: Path, steps: list[dict[str, Any]]) -> str | None:
    """The run's mode where its rows or a saved config say it; None otherwise."""
    if steps and isinstance(steps[0].get("mode"), str):
        return steps[0]["mode"]
    for name in ("config.yaml", "config.json"):
        if (path / name).is_file():
            import yaml

            try:
                mode = (yaml.safe_load((path / name).read_text()) or {}).get("mode")
            except (yaml.YAMLError, AttributeError):
                continue
            if isinstance(mode, str):
                return mode
    return None


def load_run(run_dir: str | Path) -> Run:
    """A run directory's rows split by kind, checked: a missing directory, no metrics.jsonl or
    no trainer step yet are ConfigErrors that say what to pass instead."""
    path = Path(run_dir)
    if not path.is_dir():
        missing = "does not exist" if not path.exists() else "is not a directory"
        raise ConfigError(f"'{run_dir}' {missing}; {PASS}")
    if not (path / "metrics.jsonl").is_file():
        inside = sorted(p.parent.name for p in path.glob("*/metrics.jsonl"))
        hint = f" (it holds the runs {', '.join(inside)}: pass those)" if inside else ""
        raise ConfigError(f"'{run_dir}' has no metrics.jsonl{hint}; {PASS}")
    rows = _rows(path)
    by_kind: dict[str, list[dict[str, Any]]] = {"step": [], "eval": [], "span": [], "event": []}
    for r in rows:
        by_kind.setdefault(r.get("kind", "step"), []).append(r)
    if not by_kind["step"]:
        raise ConfigError(f"'{path / 'metrics.jsonl'}' has no trainer-step rows yet; wait for the "
                          f"run's first step, or {PASS}")
    final: Any = {}  # the run's own end report, for runs that predate eval rows
    if (path / "report.json").is_file():
        try:
            final = json.loads((path / "report.json").read_text())
        except json.JSONDecodeError:
            pass
    return Run(path.resolve().name or str(path), path, by_kind["step"], by_kind["eval"],
               by_kind["span"], by_kind["event"], final if isinstance(final, dict) else {})


def _name_runs(runs: list[Run]) -> None:
    """Legend names: each run's mode where every run has a distinct one, else its directory
    name (with its parent's where two directories share a name)."""
    modes = [_mode(r.path, r.steps) for r in runs]
    if len(runs) > 1 and None not in modes and len(set(modes)) == len(runs):
        for r, m in zip(runs, modes):
            r.name = m
    elif len({r.name for r in runs}) < len(runs):
        for r in runs:
            r.name = "/".join(r.path.resolve().parts[-2:])


def _fmt(value: Any, digits: str = ".3f") -> str:
    return "–" if value is None else f"{value:{digits}}"


def header_rows(run: Run) -> list[tuple[str, str]]:
    """The lead table: held-out greedy exact match first → last eval, then reward, throughput,
    steps, wall time."""
    summary = summarize_run(run.steps)
    if run.evals:
        first, last = run.evals[0], run.evals[-1]
        greedy = (f"{_fmt(first.get('greedy_exact_match'), '.2f')} → "
                  f"{_fmt(last.get('greedy_exact_match'), '.2f')} "
                  f"(step {first.get('step')} → {last.get('step')})")
        sampled = (f"{_fmt(first.get('sampled_exact_match'), '.2f')} → "
                   f"{_fmt(last.get('sampled_exact_match'), '.2f')}")
    elif "after_eval_exact_match" in run.final:
        greedy = (f"{_fmt(run.final.get('before_eval_exact_match'), '.2f')} → "
                  f"{_fmt(run.final['after_eval_exact_match'], '.2f')} (report.json: start → end)")
        sampled = "no eval rows"
    else:
        greedy = sampled = "no eval rows"
    hist = " ".join(f"{k}:{v}" for k, v in summary["staleness_hist"].items()) or "–"
    return [
        ("held-out greedy exact match", greedy),
        ("held-out sampled exact match", sampled),
        ("training reward (first → last steps)",
         f"{summary['reward_first']:.3f} → {summary['reward_last']:.3f}"),
        ("training throughput after warm-up",
         "needs more than 3 steps" if summary["throughput_tokens_per_s"] is None
         else f"{summary['throughput_tokens_per_s']:.0f} tokens/s"),
        ("trainer steps", str(summary["steps"])),
        ("wall time", f"{summary['wall_s']:.1f} s"
         + (f" ({summary['wall_s'] / 60:.1f} min)" if summary["wall_s"] >= 60 else "")),
        ("staleness histogram", hist),
        ("rows", f"{len(run.steps)} step, {len(run.evals)} eval, {len(run.spans)} span, "
                 f"{len(run.events)} event"),
    ]


CSS = """body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;
max-width:1300px;color:#222;padding:0 16px}
h1{font-size:22px;margin-bottom:4px}
h2{font-size:17px;margin:28px 0 4px;border-bottom:1px solid #ddd;padding-bottom:3px}
p.caption{color:#555;font-size:13px;margin:2px 0 8px}
div.note{background:#fff8e1;border-left:4px solid #f0b400;padding:8px 12px;font-size:14px;margin:6px 0}
img.figure{max-width:100%;height:auto;display:block}
table{border-collapse:collapse;font-size:14px}
td,th{border:1px solid #ddd;padding:4px 10px;text-align:left}th{background:#f4f4f4}
.muted{color:#777;font-size:12px}"""

# in-page check that every figure decoded (read by tests/test_report.py through --dump-dom)
CHECK = """<script>window.addEventListener('load',function(){
var imgs=document.querySelectorAll('img.figure');var ok=0;
imgs.forEach(function(i){if(i.complete&&i.naturalWidth>0){ok++;}});
var m=document.getElementById('figure-check');m.dataset.loaded=ok;m.dataset.total=imgs.length;
m.textContent='figures loaded: '+ok+' of '+imgs.length;});</script>"""


def _section_html(section: Section) -> str:
    parts = [f"<section><h2>{html.escape(section.title)}</h2>",
             f"<p class='caption'>{html.escape(section.caption)}</p>"]
    if section.note:
        parts.append(f"<div class='note'>{html.escape(section.note)}</div>")
    if section.png:
        parts.append(f"<img class='figure' alt='{html.escape(section.title, quote=True)}' "
                     f"src='data:image/png;base64,{section.png}'>")
    return "\n".join(parts) + "</section>"


def _table_html(columns: list[str], rows: list[tuple[str, list[str]]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in ["", *columns])
    body = "".join("<tr><th>" + html.escape(name) + "</th>"
                   + "".join(f"<td>{html.escape(v)}</td>" for v in values) + "</tr>"
                   for name, values in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def page(title: str, intro: str, sections: list[Section]) -> str:
    """A self-contained HTML page: inline CSS, figures as data: URIs, one inline script."""
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>{intro}"
            + "\n".join(_section_html(s) for s in sections)
            + "<p class='muted' id='figure-check'>figures loaded: not checked</p>"
            f"{CHECK}</body></html>")


def _events_html(run: Run, limit: int = 40) -> str:
    if not run.events:
        return ""
    rows = [(f"{e.get('time', 0):.1f} s", [str(e.get("what", "")), str(e.get("detail", ""))])
            for e in run.events[:limit]]
    more = f"<p class='muted'>and {len(run.events) - limit} more</p>" if len(run.events) > limit else ""
    return (f"<p class='caption'>Events of {html.escape(run.name)}</p>"
            + _table_html(["what", "detail"], rows) + more)


def run_report_html(runs: list[Run]) -> str:
    headers = [header_rows(r) for r in runs]
    table = _table_html([r.name for r in runs],
                        [(name, [h[i][1] for h in headers]) for i, (name, _) in enumerate(headers[0])])
    sections = [score_section(runs), reward_section(runs), throughput_section(runs),
                staleness_section(runs), mismatch_section(runs), kv_section(runs),
                latency_section(runs)]
    sections += [timeline_section(r, len(runs)) for r in runs]
    where = ", ".join(html.escape(str(r.path.resolve())) for r in runs)
    intro = f"<p class='muted'>{where}</p>{table}" + "".join(_events_html(r) for r in runs)
    title = f"laminar report: {runs[0].name}" if len(runs) == 1 else \
        f"laminar report: {', '.join(r.name for r in runs)}"
    return page(title, intro, sections)


LAMINAR_RED = "#d62728"


def bench_sections(results: dict[str, Any]) -> list[Section]:
    """`laminar bench modes` results: tokens/s per schedule with laminar highlighted and
    laminar's speed-up over each on its bar (the paper's Fig. 11), then the reward curves."""
    plt = plots.pyplot()
    tput: dict[str, float] = results["throughput_by_mode"]
    ratios: dict[str, float] = results.get("ratio_laminar_vs") or {}
    modes = list(tput)
    fig, ax = plt.subplots(figsize=(plots.WIDTH_IN * 0.75, 4.2), layout="constrained")
    colours = [LAMINAR_RED if m == "laminar" else "#9ecae1" for m in modes]
    bars = ax.bar(modes, [tput[m] for m in modes], color=colours, edgecolor="#333333", lw=0.6)
    labels = [f"{tput[m]:.0f}\n" + ("laminar" if m == "laminar" else
                                    f"laminar {ratios[m]:.2f}×" if m in ratios else "")
              for m in modes]
    ax.bar_label(bars, labels, fontsize=8, padding=2)
    ax.set_ylim(0, max(tput.values()) * 1.25)
    ax.set_xlabel("schedule (mode)")
    ax.set_ylabel("training throughput (tokens/s)")
    steps = results.get("steps")
    ax.set_title(f"training throughput per schedule{f' ({steps} steps)' if steps else ''}", fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    out = [Section("Throughput per schedule", "Trained tokens per second after warm-up; the "
                   "label on each bar is laminar's throughput over that schedule's.",
                   png=plots.encode_png(fig))]
    heldout = results.get("heldout_by_mode") or {}
    if heldout:
        curves = {m: [(t, score) for t, _, score in c] for m, c in heldout.items()}
        fig = _curves_figure(plt, curves, results.get("heldout_target"), "held-out greedy exact match",
                             "held-out score vs wall-clock time per schedule", marker="o")
        out.append(Section("Held-out score vs time", "The same held-out prompts, scored greedily "
                           "on the same wall-clock schedule; each point at the time its version "
                           "was published (the run with the median time to the target).",
                           png=plots.encode_png(fig)))
    curves = results.get("reward_curve_by_mode") or {}
    if curves:
        fig = _curves_figure(plt, curves, results.get("target_reward"),
                             "training reward (10-step moving mean)", "reward vs wall-clock time per schedule")
        out.append(Section("Reward vs time", "Training reward per schedule against the wall clock.",
                           png=plots.encode_png(fig)))
    return out


def _curves_figure(plt: Any, curves: dict[str, Any], target: float | None, ylabel: str, title: str,
                   marker: str | None = None) -> Any:
    """One line per schedule over wall-clock seconds, laminar in red, the target dotted."""
    fig, ax = plt.subplots(figsize=(plots.WIDTH_IN * 0.75, 3.8), layout="constrained")
    others = [c for c in plots.PALETTE if c != LAMINAR_RED]  # red is laminar's alone
    for i, (mode, curve) in enumerate(curves.items()):
        if curve:
            t, y = zip(*curve)
            colour = LAMINAR_RED if mode == "laminar" else others[i % len(others)]
            ax.plot(t, y, lw=2.2 if mode == "laminar" else 1.2, label=mode, color=colour,
                    marker=marker, ms=2.5)
    if target is not None:
        ax.axhline(target, color="#555555", ls=":", lw=1, label=f"target {target:.3f}")
    ax.set_xlabel("wall-clock time since the rollouts started (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def bench_html_path(json_path: str | Path) -> Path:
    """Where the page of a bench results file goes: beside it, results.json -> results.html."""
    path = Path(json_path)
    return path.with_suffix(".html") if path.suffix != ".html" else path.with_name(path.name + ".html")


def write_bench_html(results: dict[str, Any], path: str | Path) -> Path:
    """The page of a `laminar bench modes` result (its JSON dict): throughput per schedule
    with laminar's ratios (the paper's Fig. 11) and the reward curves."""
    if not isinstance(results, dict) or not isinstance(results.get("throughput_by_mode"), dict) \
            or not results["throughput_by_mode"]:
        raise ConfigError(f"'{path}': the results have no throughput_by_mode; pass the .json "
                          "that `laminar bench modes --out FILE` wrote")
    tput, ratios = results["throughput_by_mode"], results.get("ratio_laminar_vs") or {}
    heldout = "time_to_heldout_target_s_by_mode" in results  # else an older, reward-only result
    ttt = results.get("time_to_heldout_target_s_by_mode" if heldout else "time_to_target_s_by_mode") or {}
    rows = [("tokens/s", [f"{tput[m]:.0f}" for m in tput]),
            ("laminar / mode", [f"{ratios[m]:.2f}×" if m in ratios else "–" for m in tput]),
            ("time to held-out target" if heldout else "time to target",
             [f"{ttt[m]:.1f} s" if ttt.get(m) is not None else "–" if m not in ttt else "not reached"
              for m in tput])]
    workload = " ".join(results.get("workload") or [])
    intro = (_table_html(list(tput), rows)
             + (f"<p class='muted'>workload: {html.escape(workload)}</p>" if workload else ""))
    out = Path(path)
    out.write_text(page("laminar bench modes", intro, bench_sections(results)))
    return out


def _print_summary(summary: dict[str, Any]) -> None:
    for key, value in summary.items():
        shown = f"{value:.4g}" if isinstance(value, float) else value
        print(f"{key:>24}: {shown}")


def main(targets: str | list[str], out: str | None = None) -> dict[str, Any]:
    """Report on one run (its summary, with `html` and `plot` added), several (`runs`: name →
    summary, and `html`) or a bench modes .json (`html`); prints where the page went."""
    targets = [targets] if isinstance(targets, str) else list(targets)
    if not targets:
        raise ConfigError(f"nothing to report on; {PASS}")
    if len(targets) > 1 and any(t.endswith(".json") for t in targets):
        raise ConfigError(f"{' '.join(targets)}: a bench modes .json is reported alone; pass "
                          "one .json, or run directories only")
    if len(targets) == 1 and targets[0].endswith(".json"):
        path = Path(targets[0])
        try:
            results = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"'{path}' cannot be read as JSON ({e}); {PASS}") from None
        written = write_bench_html(results, out or bench_html_path(path))
        print(f"{'html':>24}: {written}")
        return {"html": str(written)}
    runs = [load_run(t) for t in targets]
    _name_runs(runs)
    summaries = {r.name: summarize_run(r.steps) for r in runs}
    dest = Path(out) if out else (runs[0].path / "report.html" if len(runs) == 1
                                  else runs[0].path.resolve().parent / "report.html")
    for run in runs:
        if len(runs) > 1:
            print(f"{run.name} ({run.path})")
        _print_summary(summaries[run.name])
    dest.write_text(run_report_html(runs))
    if len(runs) == 1:
        overview_png(runs[0], runs[0].path / "report.png")
        print(f"{'plot':>24}: {runs[0].path / 'report.png'}")
    print(f"{'html':>24}: {dest}")
    if len(runs) == 1:
        return summaries[runs[0].name] | {"html": str(dest), "plot": str(runs[0].path / "report.png")}
    return {"runs": summaries, "html": str(dest)}
