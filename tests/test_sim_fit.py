"""The simulator's calibration is judged on points it was not fitted to (DESIGN.md §7)."""

from __future__ import annotations

import copy
import json

from laminar.sim import fit, paper, split
from laminar.sim.cli import main as simulate_main

EVERY_POINT = {(m, g) for m in paper.MODELS for g in paper.SCALES[m]}


def fake_grid(scale: dict[tuple[str, int], float] | None = None) -> list[dict]:
    """The paper's own Fig. 11 numbers as a simulated grid; laminar times `scale[point]`."""
    scale = scale or {}
    return [{"model": m, "gpus": g,
             "throughput_by_mode": {mode: tp * (scale.get((m, g), 1.0) if mode == "laminar"
                                                else 1.0)
                                    for mode, tp in paper.FIG11[m][g].items()}}
            for m, g in sorted(EVERY_POINT)]


def throughputs(grid: list[dict]) -> fit.Throughputs:
    return {(mode, p["model"], p["gpus"]): tp
            for p in grid for mode, tp in p["throughput_by_mode"].items()}


def test_split_is_disjoint_and_covers_every_fig11_point():
    fit_set, held = set(split.FIT_POINTS), set(split.HELDOUT_POINTS)
    assert not fit_set & held
    assert fit_set | held == EVERY_POINT
    assert len(split.FIT_POINTS) == len(fit_set) and len(split.HELDOUT_POINTS) == len(held)
    assert len(split.ratios(split.FIT_POINTS)) + len(split.ratios(split.HELDOUT_POINTS)) == 60
    # the extrapolations a user makes: a larger model and a larger cluster
    assert all(("72b", g) in held for g in paper.SCALES["72b"])
    assert all((m, paper.SCALES[m][-1]) in held for m in paper.MODELS)
    assert paper.HEADLINE[:2] in held


def test_fit_score_ignores_heldout_reference_values():
    tp = throughputs(fake_grid({("7b", 64): 1.1, ("32b", 128): 0.8}))
    base = fit.score(tp)
    ref = copy.deepcopy(paper.FIG11)
    for m, g in split.HELDOUT_POINTS:
        ref[m][g]["laminar"] *= 3.0
    assert fit.score(tp, ref=ref) == base
    # the throughputs of held-out points are not even needed
    fit_only = {k: v for k, v in tp.items() if not split.is_heldout(k[1], k[2])}
    assert fit.score(fit_only) == base
    # while a fit point's reference value does move it
    ref[split.FIT_POINTS[0][0]][split.FIT_POINTS[0][1]]["laminar"] *= 3.0
    assert fit.score(tp, ref=ref) != base
    assert fit.score(tp, split.HELDOUT_POINTS) != fit.score(tp, split.HELDOUT_POINTS, ref=ref)


def test_search_never_simulates_a_heldout_point(monkeypatch):
    asked: list[tuple[str, int]] = []

    def fake(job):
        mode, m, g, *_ = job
        asked.append((m, g))
        return paper.FIG11[m][g][mode]

    monkeypatch.setattr(fit, "_throughput", fake)
    assert fit.Evaluator(1, 1)(fit.Calibration()) == (0, 0.0)
    assert set(asked) == set(split.FIT_POINTS)


def test_fidelity_counts_fit_and_heldout_apart():
    # one fitted point 10% off, one held-out point 50% off (all four of its ratios)
    f = fit.fidelity(fake_grid({("7b", 32): 1.1, ("72b", 512): 1.5}))
    for key in ("fit_points", "heldout_points", "fit_within_25pct", "heldout_within_25pct",
                "heldout_worst_error", "fitted_constants", "heldout_within_25pct_fraction"):
        assert key in f
    assert (f["fit_points"], f["heldout_points"]) == (32, 28)
    assert f["fit_within_25pct"] == 32
    assert f["heldout_within_25pct"] == 24
    assert f["heldout_within_25pct_fraction"] == round(24 / 28, 4)
    worst = f["heldout_worst_error"]
    assert (worst["model"], worst["gpus"]) == ("72b", 512)
    assert abs(worst["error"] - 0.5) < 1e-9
    assert worst["ratio"] == f"72b @ 512 laminar/{worst['baseline']}"
    assert f["fitted_constants"]["count"] == len(f["fitted_constants"]["names"]) >= 13
    assert "colocated_mem_util" in f["fitted_constants"]["names"]


def test_grid_json_has_the_fidelity_object(monkeypatch, tmp_path):
    import laminar.sim.cli as cli

    monkeypatch.setattr(cli, "simulate_grid", lambda **kw: fake_grid())
    out = tmp_path / "grid.json"
    assert simulate_main(["--grid", "--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["points"]) == 15
    f = data["fidelity"]
    assert f["fit_within_25pct"] == 32 and f["heldout_within_25pct"] == 28
    assert f["heldout_worst_error"]["error"] == 0.0
