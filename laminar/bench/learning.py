"""What a run learned, on the held-out prompts, against the wall clock: the pure half of
`laminar bench modes`' learning comparison.

    curve = heldout_curve(read_rows(run_dir))        # [[wall_s, version, exact_match], ...]
    target = heldout_target(start, sync_finals)      # warm start + 90% of sync's final gain
                                                     # (None: no held-out gain, no target)
    time_to_target(curve, target)                    # first wall_s at or above it, or None

A point's wall time is when its version was *published* (the trainer's update), counted from
the rollouts' start, not when the evaluation finished: evaluations run on a rollout beside
the schedule and may lag, and the model existed from its publication on. Version 0 (the warm
start) is at 0 s.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

GAIN_FRACTION = 0.9  # the target: the warm-start score plus this share of sync's final gain
NO_GAIN = "no held-out gain: no target"  # what the benchmarks print when heldout_target is None


def heldout_curve(rows: Iterable[dict[str, Any]], metric: str = "greedy_exact_match") -> list[list[float]]:
    """[[wall_s, version, score], ...] from a run's metrics rows (step and eval kinds), one
    point per evaluated version, in version order."""
    rows = list(rows)
    published = {0: 0.0}
    for r in rows:
        if r.get("kind", "step") == "step":
            published[int(r["version"])] = float(r["time"])
    points: dict[int, list[float]] = {}
    for r in rows:
        if r.get("kind") == "eval":
            v = int(r["version"])
            if v in published:
                points[v] = [round(published[v], 3), v, float(r[metric])]
    return [points[v] for v in sorted(points)]


def heldout_target(start: float, sync_finals: Sequence[float],
                   fraction: float = GAIN_FRACTION) -> float | None:
    """The warm-start score plus `fraction` of sync's final gain (the median over repeats);
    None when sync ended no higher than it started: with no held-out gain there is no target
    (one below the start would be "reached" at 0 s by every run)."""
    gain = statistics.median(sync_finals) - start
    return start + fraction * gain if gain > 0 else None


def time_to_target(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """The first wall time whose score reaches `target`; None if the run never did."""
    return next((float(t) for t, _, score in curve if score >= target - 1e-12), None)


def median_or_none(values: Sequence[float | None]) -> float | None:
    """The median, where a run that never got there (None) counts as later than any that did;
    None when at least half never got there."""
    if not values:
        return None
    m = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(m) else float(m)


def paired_ratios(laminar: Sequence[float], other: Sequence[float]) -> list[float]:
    """laminar / other per repeat (run i of each mode shares a repeat: the same hour of the
    same machine), as many as both have."""
    return [a / b for a, b in zip(laminar, other) if b]


def summary(values: Sequence[float]) -> dict[str, float] | None:
    """{median, min, max} of a list, None when empty."""
    if not values:
        return None
    return {"median": float(statistics.median(values)), "min": float(min(values)),
            "max": float(max(values))}
