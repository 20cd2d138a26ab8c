"""Which of the paper's Fig. 11 ratios calibrate the simulator and which judge it.

A ratio is laminar's throughput over one baseline's at one point of Fig. 11:
`(model, total GPUs, baseline)`, 15 points x 4 baselines = 60. The split is by point, so the
four ratios of a point (which share laminar's throughput) are on the same side.

- `FIT_POINTS`: what `fit.py` searches the calibration against (8 points, 32 ratios).
- `HELDOUT_POINTS`: never seen by the search; `fidelity` reports them separately (7 points,
  28 ratios).
- `tolerance`: how close a simulated ratio must be to the paper's to count as matching.

The split was fixed before the search that produced the current calibration (issue 15) and
holds out the two directions a user extrapolates in: a larger model (every 72B point) and a
larger cluster (the largest scale of every model: 7B @ 256, 32B @ 512, 72B @ 1024). The
headline 7B @ 256 ratio is therefore a prediction, not a fit.

Fig. 12 (7B with tool calls) is in neither set: its laminar bars are the Fig. 11 math bars
digit for digit and its speedups contradict its caption (shared/reference/paper-details.md
§4.2), so its per-point values are not a reference.
"""

from __future__ import annotations

from laminar.sim import paper

Point = tuple[str, int]  # (model, total GPUs)
Ratio = tuple[str, int, str]  # (model, total GPUs, baseline)
TOL, HEADLINE_TOL = 0.25, 0.15  # `tolerance`: every ratio, and the headline 7B @ 256 one

FIT_POINTS: tuple[Point, ...] = (
    ("7b", 16), ("7b", 32), ("7b", 64), ("7b", 128),
    ("32b", 32), ("32b", 64), ("32b", 128), ("32b", 256),
)
HELDOUT_POINTS: tuple[Point, ...] = (
    ("7b", 256), ("32b", 512),
    ("72b", 64), ("72b", 128), ("72b", 256), ("72b", 512), ("72b", 1024),
)


def ratios(points: tuple[Point, ...]) -> list[Ratio]:
    return [(m, g, b) for m, g in points for b in paper.BASELINES]


def is_heldout(model: str, gpus: int) -> bool:
    return (model, gpus) in HELDOUT_POINTS


def tolerance(model: str, gpus: int, b: str) -> float:
    """How far a simulated ratio may be from the paper's (relative) and still count as matching."""
    return HEADLINE_TOL if (model, gpus, b) == paper.HEADLINE[:3] else TOL


def ratio_error(tp: dict[str, float], ref: dict[str, float], baseline: str) -> float:
    """Simulated laminar/baseline ratio over the paper's, minus 1 (signed)."""
    return (tp["laminar"] / tp[baseline]) / (ref["laminar"] / ref[baseline]) - 1.0
