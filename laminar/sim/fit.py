"""How the defaults in `calibration.py` were chosen: a small, deterministic search.

    python -m laminar.sim.fit [--quick]

The score of a calibration is the worst |log(simulated ratio / paper ratio)| over the 60
laminar/baseline ratios of Fig. 11 (3 models x 5 scales x 4 baselines), with the headline
7B @ 256 laminar/verl ratio counted twice as hard (its target is ±15%, the others' ±25%).
Shared parameters (engine overheads, memory, trainer MFU) are searched on a grid; for each,
the mode-specific ones (controller cost for the verl-based baselines, laminar's and AReaL's
in-flight batches) only change their own modes, so each mode is simulated once per value
and the combinations are scored without re-running. Ties go to the first grid point.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from collections.abc import Iterable

from laminar.sim import paper
from laminar.sim.calibration import Calibration
from laminar.sim.run import simulate

SHARED = dict(step_overhead_ms=(0.0, 3.0, 6.0), seq_overhead_ms=(0.0, 0.04, 0.08),
              trainer_mfu=(0.3, 0.35, 0.4))
CONTROLLER = (12.0, 14.0, 16.0)
LAMINAR_INFLIGHT = (1.0, 1.5, 2.0)
PARTIAL_INFLIGHT = (0.125, 0.25, 0.5)
BARRIER_MODES = ("sync", "one_step", "stream")


def points() -> list[tuple[str, int]]:
    return [(m, g) for m in paper.MODELS for g in paper.SCALES[m]]


def run_modes(cal: Calibration, modes: Iterable[str], warmup: int, measure: int
              ) -> dict[tuple[str, str, int], float]:
    return {(mode, m, g): simulate(mode, m, g, cal, 0, warmup, measure).throughput
            for mode in modes for m, g in points()}


def score(tp: dict[tuple[str, str, int], float]) -> tuple[float, int]:
    """(worst weighted log error, ratios within tolerance)."""
    worst, ok = 0.0, 0
    for m, g in points():
        ref = paper.FIG11[m][g]
        for b in paper.BASELINES:
            err = abs(math.log((tp[("laminar", m, g)] / tp[(b, m, g)])
                               / (ref["laminar"] / ref[b])))
            headline = (m, g, b) == paper.HEADLINE[:3]
            ok += err <= math.log(1.15 if headline else 1.25)
            worst = max(worst, err * (25 / 15 if headline else 1.0))
    return worst, ok


def search(warmup: int, measure: int, quantum: int) -> tuple[float, int, Calibration]:
    best: tuple[float, int, Calibration] | None = None
    for values in itertools.product(*SHARED.values()):
        base = Calibration(decode_quantum=quantum, **dict(zip(SHARED, values)))
        t0 = time.time()
        by_c = {c: run_modes(base.with_overrides(controller_us_per_token=c), BARRIER_MODES,
                             warmup, measure) for c in CONTROLLER}
        by_l = {x: run_modes(base.with_overrides(inflight_batches=x), ("laminar",),
                             warmup, measure) for x in LAMINAR_INFLIGHT}
        by_p = {x: run_modes(base.with_overrides(partial_inflight_batches=x), ("partial",),
                             warmup, measure) for x in PARTIAL_INFLIGHT}
        for c, li, pi in itertools.product(CONTROLLER, LAMINAR_INFLIGHT, PARTIAL_INFLIGHT):
            s, ok = score({**by_c[c], **by_l[li], **by_p[pi]})
            cal = base.with_overrides(controller_us_per_token=c, inflight_batches=li,
                                      partial_inflight_batches=pi)
            if best is None or s < best[0]:
                best = (s, ok, cal)
        print(f"{dict(zip(SHARED, values))}: best so far {best[0]:.3f} ({best[1]}/60 ok) "
              f"[{time.time() - t0:.0f}s]", flush=True)
    assert best is not None
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="coarser simulation (2+2 updates)")
    args = ap.parse_args()
    warmup, measure, quantum = (2, 2, 32) if args.quick else (3, 4, 16)
    s, ok, cal = search(warmup, measure, quantum)
    print(f"best: worst log error {s:.3f} (x{math.exp(s):.2f}), {ok}/60 ratios in tolerance")
    for k in ("step_overhead_ms", "seq_overhead_ms", "trainer_mfu", "controller_us_per_token",
              "inflight_batches", "partial_inflight_batches"):
        print(f"  {k} = {getattr(cal, k)}")


if __name__ == "__main__":
    main()
