"""`laminar bench staleness`: time to a held-out target against the staleness bound, for each
off-policy correction.

laminar mode on `bench modes`' workload (same warm start, data, seeds, rollouts, global batch),
at every `rollout.version_lag` in `--lags` x every `trainer.correction` in `--corrections`,
`--repeats` times (the cells' order rotates every repeat). The held-out target follows `bench
modes`' rule (laminar/bench/learning.py) with the least stale cell as the reference: the warm
start's score plus 90% of the final gain of the smallest lag with the first correction
(`none`, today's loss); no gain there, no target. Each cell reports the median time to reach
it (None where most repeats never did), the median final held-out score, tokens/s and the
mismatch of its steps.

    laminar bench staleness [--quick] [--lags 1,2,4,8] [--corrections none,tis,icepop,m2po]
                            [--repeats N] [--steps N] [--task reverse|calc|reasoning_gym]
                            [--metric greedy_exact_match|sampled_exact_match]
                            [--set KEY=VALUE] [--out FILE]

JSON keys: lags, corrections, default_correction (trainer.correction's default),
time_to_target_s and heldout_final (correction -> lag -> median over repeats; null where the
target was never reached / no final evaluation), mismatch_p99 (correction -> lag: the median
over steps and repeats of `logprob_abs_diff_all_p99`, |log pi_trainer - log pi_behaviour| over
every trained token, mismatch and staleness together), engine_mismatch_p99 (the same of
`logprob_abs_diff_p99`, staleness-0 tokens only: the engine's numerics), is_ratio_p99,
correction_masked, throughput (tokens/s), heldout_start, heldout_target, heldout_target_note,
steps, repeats, task, workload, quick, runs (everything per cell and repeat) and provenance.
With --out F.json it also draws F.png (laminar/bench/staleness_plot.py).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import ray

from laminar.bench import learning
from laminar.bench.modes import QUICK_STEPS, WORKLOADS, bench_config, mode_steps, rotated, run_mode
from laminar.config import ConfigError, TrainerConfig
from laminar.config.trainer import CORRECTION_PARAMS
from laminar.metrics import read_metrics
from laminar.provenance import provenance
from laminar.runtime import ray_env_defaults

LAGS = (1, 2, 4, 8)
CORRECTIONS = ("none", "tis", "icepop", "m2po")
QUICK_LAGS, QUICK_CORRECTIONS = (1, 4), ("none", "icepop")
STEPS = 40  # every cell trains mode_steps("laminar", steps): bench modes' race length
REPEATS = 2
METRIC = "greedy_exact_match"  # the held-out score of `bench modes`' target rule
# per-step keys summarised per cell: the median over the run's steps that have one
ROW_KEYS = {"mismatch_p99": "logprob_abs_diff_all_p99", "engine_mismatch_p99": "logprob_abs_diff_p99",
            "is_ratio_p99": "is_ratio_p99", "correction_masked": "correction_masked",
            "entropy": "entropy"}


def parse_list(text: str | None, default: tuple, allowed: Any, flag: str, cast: Any = str) -> list:
    """`--lags 1,4` / `--corrections none,tis`: the values, each checked; `default` if unset."""
    if not text:
        return list(default)
    values = []
    for raw in (p.strip() for p in text.split(",") if p.strip()):
        try:
            value = cast(raw)
        except ValueError:
            value = None
        if value is None or not allowed(value):
            raise ConfigError(f"{flag} {text!r}: {raw!r} is not allowed here ({flag} takes "
                              f"{'whole numbers >= 1' if cast is int else ', '.join(CORRECTION_PARAMS)})")
        values.append(value)
    return values


def cell_overrides(lag: int, correction: str) -> list[str]:
    return [f"rollout.version_lag={lag}", f"trainer.correction.kind={correction}"]


def step_medians(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """ROW_KEYS' medians over a run's step rows (None where no step had a value)."""
    out: dict[str, float | None] = {}
    for name, key in ROW_KEYS.items():
        values = [r[key] for r in rows if r.get(key) is not None]
        out[name] = float(statistics.median(values)) if values else None
    return out


def run_cell(lag: int, correction: str, steps: int, root: Path, overrides: list[str],
             task: str, metric: str = METRIC) -> dict[str, Any]:
    """One laminar run at `lag` with `correction`: `bench modes`' run_mode plus the step rows'
    mismatch medians; the held-out curve on `metric`."""
    result = run_mode("laminar", steps, root, overrides + cell_overrides(lag, correction), task,
                      metric)
    return {**result, **step_medians(read_metrics(root / "laminar"))}


def median_of(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(statistics.median(present)) if present else None


def summarize(runs: dict[str, dict[int, list[dict[str, Any]]]]) -> dict[str, Any]:
    """The target, and per correction and lag the medians over repeats (keys as JSON: str lag)."""
    corrections = list(runs)
    lags = sorted({lag for by_lag in runs.values() for lag in by_lag})
    every = [r for by_lag in runs.values() for rs in by_lag.values() for r in rs]
    starts = [r["heldout_start"] for r in every if r["heldout_start"] is not None]
    start = float(statistics.median(starts)) if starts else None
    reference = runs[corrections[0]][lags[0]]
    finals = [r["heldout_final"] for r in reference if r["heldout_final"] is not None]
    target = learning.heldout_target(start, finals) if start is not None and finals else None

    def table(fn: Any) -> dict[str, dict[str, Any]]:
        return {c: {str(lag): fn(runs[c][lag]) for lag in lags if lag in runs[c]} for c in corrections}

    return {
        "heldout_start": start, "heldout_target": target,
        "heldout_target_note": learning.NO_GAIN if start is not None and finals and target is None
        else None,
        "reference": {"correction": corrections[0], "lag": lags[0]},
        "time_to_target_s": table(lambda rs: learning.median_or_none(
            [learning.time_to_target(r["heldout"], target) if target is not None else None
             for r in rs])),
        "time_to_target_s_runs": table(lambda rs: [learning.time_to_target(r["heldout"], target)
                                                   if target is not None else None for r in rs]),
        "heldout_final": table(lambda rs: median_of([r["heldout_final"] for r in rs])),
        "throughput": table(lambda rs: median_of([r["throughput"] for r in rs])),
        **{name: table(lambda rs, n=name: median_of([r[n] for r in rs])) for name in ROW_KEYS},
    }


def main(quick: bool = False, out: str | None = None, lags: str | None = None,
         corrections: str | None = None, steps: int | None = None,
         overrides: list[str] | None = None, repeats: int | None = None,
         task: str = "reverse", metric: str | None = None) -> dict[str, Any]:
    if task not in WORKLOADS:
        raise ConfigError(f"--task {task!r}: bench staleness has a workload for {', '.join(WORKLOADS)}")
    lag_list = parse_list(lags, QUICK_LAGS if quick else LAGS, lambda v: v >= 1, "--lags", int)
    kinds = parse_list(corrections, QUICK_CORRECTIONS if quick else CORRECTIONS,
                       lambda v: v in CORRECTION_PARAMS, "--corrections")
    overrides = list(overrides or [])
    for lag in lag_list:  # a bad --set or cell fails before anything runs
        for kind in kinds:
            bench_config("laminar", 1, Path(tempfile.gettempdir()), overrides + cell_overrides(lag, kind), task)
    steps = steps or (QUICK_STEPS if quick else STEPS)
    repeats = repeats or (1 if quick else REPEATS)
    cells = [(lag, kind) for kind in kinds for lag in lag_list]
    root = Path(tempfile.mkdtemp(prefix="laminar-bench-staleness-"))
    print(f"bench staleness: {len(lag_list)} lags x {len(kinds)} corrections x {repeats} repeats, "
          f"{mode_steps('laminar', steps)} steps each; runs in {root}", flush=True)
    prov = provenance(config={f"lag{lag}-{kind}": bench_config(
        "laminar", mode_steps("laminar", steps), root / f"lag{lag}-{kind}",
        overrides + cell_overrides(lag, kind), task).model_dump(mode="json") for lag, kind in cells})
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {k: {lag: [] for lag in lag_list} for k in kinds}
    ray_env_defaults()  # as laminar's own jobs start Ray: workers at the driver's priority
    ray.init(include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        for r in range(repeats):
            for lag, kind in rotated(cells, r):
                print(f"bench staleness: repeat {r + 1}/{repeats}, version_lag {lag}, "
                      f"correction {kind} ...", flush=True)
                res = run_cell(lag, kind, steps, root / f"lag{lag}-{kind}-{r}", overrides, task,
                               metric or METRIC)
                runs[kind][lag].append(res)
                print(f"  {res['throughput']:.0f} tok/s, held-out {_fmt(res['heldout_start'])} -> "
                      f"{_fmt(res['heldout_final'])}, mismatch p99 {_fmt(res['mismatch_p99'], '.2e')}",
                      flush=True)
    finally:
        ray.shutdown()
    report: dict[str, Any] = {
        "task": task, "workload": WORKLOADS[task] + overrides, "steps": mode_steps("laminar", steps),
        "metric": metric or METRIC,
        "quick": quick, "repeats": repeats, "lags": lag_list, "corrections": kinds,
        "default_correction": TrainerConfig().correction.kind, **summarize(runs),
        "runs": {k: {str(lag): [{key: v for key, v in res.items()
                                 if key not in ("heldout", "reward_curve", "env_latency_s", "turns")}
                                for res in rs] for lag, rs in by_lag.items()}
                 for k, by_lag in runs.items()},
        "provenance": prov,
    }
    print_table(report)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1))
        print(f"wrote {out}")
        try:
            from laminar.bench.staleness_plot import plot_staleness  # matplotlib: the plots extra

            print(f"wrote {plot_staleness(report, Path(out).with_suffix('.png'))}")
        except ImportError as e:
            print(f"no figure ({e.name} is missing: pip install 'laminar[plots]')")
    return report


def _fmt(x: float | None, spec: str = ".3f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    target = report["heldout_target"]
    console = Console(width=160)
    if report.get("heldout_target_note"):
        console.print(f"bench staleness: {report['heldout_target_note']} (reference: lag "
                      f"{report['reference']['lag']}, {report['reference']['correction']})")
    table = Table(title=f"laminar bench staleness ({report['task']}): laminar mode, "
                        f"{report['steps']} steps, {report['repeats']} repeats (medians); held-out "
                        f"{report.get('metric', METRIC)}: "
                        f"start {_fmt(report['heldout_start'])}, target {_fmt(target)}")
    for col in ("correction", "version_lag", "time to target", "held-out final", "tok/s",
                "mismatch p99 (all)", "engine p99 (fresh)", "ratio p99", "masked", "entropy"):
        table.add_column(col)
    for kind in report["corrections"]:
        for lag in map(str, report["lags"]):
            ttt = report["time_to_target_s"][kind].get(lag)
            table.add_row(
                kind, lag, learning.NO_GAIN if target is None else
                ("not reached" if ttt is None else f"{ttt:.0f} s"),
                _fmt(report["heldout_final"][kind].get(lag)),
                _fmt(report["throughput"][kind].get(lag), ".0f"),
                _fmt(report["mismatch_p99"][kind].get(lag), ".2e"),
                _fmt(report["engine_mismatch_p99"][kind].get(lag), ".2e"),
                _fmt(report["is_ratio_p99"][kind].get(lag), ".3f"),
                _fmt(report["correction_masked"][kind].get(lag), ".3f"),
                _fmt(report["entropy"][kind].get(lag), ".3f"))
    console.print(table)
