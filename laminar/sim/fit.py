"""How the defaults in `calibration.py` were chosen, and how well they predict.

    python -m laminar.sim.fit [--quick] [--jobs N]

- `PARAMS`: the constants the search fits, a few candidate values each, and the modes each
  one reaches. `FITTED` names the ones with more than one candidate.
- `score(tp, points)`: (ratios outside tolerance, RMS log error) over the laminar/baseline
  ratios of the given Fig. 11 points only. A ratio is outside when |simulated / paper - 1|
  exceeds 25% (15% for the headline 7B @ 256 laminar/verl ratio), the report's test
  (`report.tolerance`). Lower is better, compared in that order.
- `search`: coordinate descent from the current defaults over `PARAMS`, scored on
  `split.FIT_POINTS` (32 ratios; the held-out points are never simulated), until a full round
  changes nothing. A mode is re-simulated only when a parameter it depends on changes
  (results are cached per mode and relevant values). Ties keep the current value.
- `fidelity(points)`: the `fidelity` object of `laminar simulate --grid --out`: fitted and
  held-out ratios within ±25%, counted separately, and the worst held-out error.
"""

from __future__ import annotations

import argparse
import math
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import fields
from typing import Any

from laminar.sim import paper, split
from laminar.sim.calibration import Calibration
from laminar.sim.report import tolerance
from laminar.sim.run import simulate
from laminar.types import GLOBAL_BATCH_MODES

ALL = paper.MODES
TRAINED_FSDP = tuple(m for m in ALL if m != "partial")  # AReaL (partial) trains with Megatron
BARRIER = GLOBAL_BATCH_MODES
PARAMS: dict[str, tuple[tuple[float, ...], tuple[str, ...]]] = {
    "controller_us_per_token": ((12.0, 13.0, 14.0, 15.0), BARRIER),
    "trainer_mfu": ((0.3, 0.34, 0.38), TRAINED_FSDP),
    "trainer_update_s_per_gb": ((0.0, 0.125, 0.25, 0.5), ALL),
    "trainer_update_s": ((0.0, 20.0, 40.0), ALL),
    "step_overhead_ms": ((0.0, 2.0, 4.0, 6.0), ALL),
    "seq_overhead_ms": ((0.0, 0.01, 0.02, 0.05), ALL),
    "tp_seq_overhead_ms": ((0.0, 0.05, 0.065, 0.075, 0.1), ALL),
    "laminar_rollout_logprobs": ((False,), ("laminar",)),  # choices, not searched
    "version_lag": ((1,), ("laminar",)),
    "colocated_mem_util": ((0.4, 0.45, 0.5), ("sync",)),
    "async_baselines_mem_util": ((0.5, 0.6, 0.8), ("one_step", "stream")),
    "stream_minibatches": ((False,), ("laminar", "partial")),
    "inflight_batches": ((0.5, 0.75, 1.0), ("laminar",)),
    "partial_inflight_batches": ((0.25, 0.5), ("partial",)),
    "partial_trainer_mfu": ((0.25, 0.27, 0.3), ("partial",)),
    "megatron_mb_tokens": ((8192.0, 16384.0, 32768.0), ("partial",)),
}
FITTED = tuple(name for name, (values, _) in PARAMS.items() if len(values) > 1)
Throughputs = dict[tuple[str, str, int], float]
Reference = dict[str, dict[int, dict[str, float]]]


def score(tp: Throughputs, points: tuple[split.Point, ...] = split.FIT_POINTS,
          ref: Reference = paper.FIG11) -> tuple[int, float]:
    """(ratios outside tolerance, RMS log error) over the ratios of `points` only."""
    bad, sq = 0, 0.0
    for m, g, b in split.ratios(points):
        by_mode = {mode: tp[(mode, m, g)] for mode in ("laminar", b)}
        rel = 1.0 + split.ratio_error(by_mode, ref[m][g], b)
        bad += abs(rel - 1.0) > tolerance(m, g, b)
        sq += math.log(rel) ** 2
    return bad, math.sqrt(sq / len(split.ratios(points)))


def fidelity(grid: list[dict[str, Any]], tol: float = 0.25) -> dict[str, Any]:
    """Fitted vs held-out: how many simulated laminar/baseline ratios of `grid` (points as
    `run.simulate_point` returns them) are within ±`tol` of the paper's, per side of the
    split; the worst held-out error; the constants the search fits."""
    errors: dict[str, list[tuple[split.Ratio, float]]] = {"fit": [], "heldout": []}
    for p in grid:
        m, g, tp = p["model"], p["gpus"], p["throughput_by_mode"]
        side = "heldout" if split.is_heldout(m, g) else "fit"
        for b in paper.BASELINES:
            if "laminar" in tp and b in tp:
                errors[side].append(((m, g, b), split.ratio_error(tp, paper.FIG11[m][g], b)))

    def worst(errs: list[tuple[split.Ratio, float]]) -> dict[str, Any] | None:
        if not errs:
            return None
        (m, g, b), e = max(errs, key=lambda r: abs(r[1]))
        return {"error": round(e, 4), "ratio": f"{m} @ {g} laminar/{b}",
                "model": m, "gpus": g, "baseline": b}

    out: dict[str, Any] = {}
    for side, errs in errors.items():
        within = sum(abs(e) <= tol for _, e in errs)
        out[f"{side}_points"] = len(errs)
        out[f"{side}_within_25pct"] = within
        out[f"{side}_within_25pct_fraction"] = round(within / len(errs), 4) if errs else None
        out[f"{side}_rms_log_error"] = (round(math.sqrt(sum(math.log1p(e) ** 2 for _, e in errs)
                                                        / len(errs)), 4) if errs else None)
        out[f"{side}_worst_error"] = worst(errs)
        out[f"{side}_ratios"] = {f"{m} @ {g} laminar/{b}": round(e, 4) for (m, g, b), e in errs}
    out["fitted_constants"] = {"count": len(FITTED), "names": list(FITTED)}
    out["split"] = {"fit": [list(p) for p in split.FIT_POINTS],
                    "heldout": [list(p) for p in split.HELDOUT_POINTS]}
    return out


def _throughput(job: tuple[str, str, int, Calibration, int, int]) -> float:
    mode, m, g, cal, warmup, measure = job
    return simulate(mode, m, g, cal, 0, warmup, measure).throughput


class Evaluator:
    """Scores a calibration on `points` (by default the fit set), simulating nothing else."""

    def __init__(self, warmup: int, measure: int, jobs: int = 1,
                 points: tuple[split.Point, ...] = split.FIT_POINTS) -> None:
        self.warmup, self.measure, self.points = warmup, measure, points
        self.cache: dict[tuple, Throughputs] = {}
        self.pool = ProcessPoolExecutor(jobs) if jobs > 1 else None

    @staticmethod
    def key(mode: str, cal: Calibration) -> tuple:
        """What a mode's results depend on: the PARAMS it uses and every field outside PARAMS
        (so a probe of, say, `gpu_mem_util` is never answered from the cache)."""
        return (mode,) + tuple((f.name, getattr(cal, f.name)) for f in fields(cal)
                               if f.name not in PARAMS or mode in PARAMS[f.name][1])

    def __call__(self, cal: Calibration) -> tuple[int, float]:
        tp: Throughputs = {}
        todo: dict[tuple, list[tuple[str, str, int]]] = {}
        for mode in ALL:
            key = self.key(mode, cal)
            if key not in self.cache:
                todo[key] = [(mode, m, g) for m, g in self.points]
        runs = [(mode, m, g, cal, self.warmup, self.measure)
                for pts in todo.values() for mode, m, g in pts]
        out = list(self.pool.map(_throughput, runs) if self.pool else map(_throughput, runs))
        i = 0
        for key, pts in todo.items():
            self.cache[key] = {p: out[i + k] for k, p in enumerate(pts)}
            i += len(pts)
        for mode in ALL:
            tp.update(self.cache[self.key(mode, cal)])
        return score(tp, self.points)


def search(cal: Calibration, warmup: int, measure: int,
           jobs: int = 1) -> tuple[tuple[int, float], Calibration]:
    """Coordinate descent over PARAMS on the fit set; returns (best score, calibration)."""
    evaluate = Evaluator(warmup, measure, jobs)
    best = evaluate(cal)
    print(f"start: {best[0]} outside, RMS {best[1]:.3f}", flush=True)
    changed = True
    while changed:
        changed = False
        for name, (values, _) in PARAMS.items():
            t0 = time.time()
            for v in values:
                if v == getattr(cal, name):
                    continue
                s = evaluate(cal.with_overrides(**{name: v}))
                if s < best:
                    best, cal, changed = s, cal.with_overrides(**{name: v}), True
            print(f"{name} = {getattr(cal, name)}: {best[0]} outside, RMS {best[1]:.3f} "
                  f"[{time.time() - t0:.0f}s]", flush=True)
    return best, cal


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="coarser simulation (2+2 updates)")
    ap.add_argument("--jobs", type=int, default=1, help="simulate in this many processes")
    args = ap.parse_args()
    warmup, measure, quantum = (2, 2, 32) if args.quick else (3, 4, 16)
    (bad, rms), cal = search(Calibration(decode_quantum=quantum), warmup, measure, args.jobs)
    n = len(split.ratios(split.FIT_POINTS))
    print(f"best: {bad}/{n} fit-set ratios outside tolerance, RMS log error {rms:.3f} "
          f"({len(FITTED)} constants fitted; held-out points not simulated)")
    for k in PARAMS:
        print(f"  {k} = {getattr(cal, k)}")


if __name__ == "__main__":
    main()
