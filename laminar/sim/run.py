"""Run the simulator: one point, or the paper's whole Fig. 11 grid.

    simulate("laminar", "7b", 256)            -> SimResult
    simulate_point("7b", 256)                 -> {"throughput_by_mode": {...}, ...}
    simulate_grid()                           -> [point, ...] (3 models x 5 scales x 5 modes)

A point simulates `warmup` trainer updates that are not measured, then `measure` that are
(the paper: 10 + 5 on the real cluster; the simulator reaches steady state sooner).
"""

from __future__ import annotations

from typing import Any

from laminar.sim import paper
from laminar.sim.calibration import Calibration
from laminar.sim.core import SimResult, paper_setup
from laminar.sim.schedules import SCHEDULES

WARMUP, MEASURE = 3, 4
QUICK_WARMUP, QUICK_MEASURE = 2, 2


def simulate(mode: str, model: str, gpus: int, cal: Calibration | None = None, seed: int = 0,
             warmup: int = WARMUP, measure: int = MEASURE) -> SimResult:
    setup = paper_setup(mode, model, gpus, cal, seed)
    return SCHEDULES[mode](setup, warmup, measure)


def simulate_point(model: str, gpus: int, modes: tuple[str, ...] = paper.MODES,
                   cal: Calibration | None = None, seed: int = 0, warmup: int = WARMUP,
                   measure: int = MEASURE) -> dict[str, Any]:
    results = {m: simulate(m, model, gpus, cal, seed, warmup, measure) for m in modes}
    return {
        "model": model, "gpus": gpus,
        "throughput_by_mode": {m: r.throughput for m, r in results.items()},
        "details": {m: r.as_dict() for m, r in results.items()},
    }


def simulate_grid(models: tuple[str, ...] = paper.MODELS, cal: Calibration | None = None,
                  seed: int = 0, warmup: int = WARMUP, measure: int = MEASURE,
                  modes: tuple[str, ...] = paper.MODES) -> list[dict[str, Any]]:
    return [simulate_point(model, gpus, modes, cal, seed, warmup, measure)
            for model in models for gpus in paper.SCALES[model]]
