"""`laminar bench staleness`: the target rule, the per-cell medians and the JSON keys on fake
runs, and its options failing early (laminar/bench/staleness.py)."""

import pytest

from laminar.bench import learning
from laminar.bench.staleness import parse_list, step_medians, summarize
from laminar.config import ConfigError


def fake(curve, final=None, throughput=100.0, mismatch=1e-3):
    return {"heldout": curve, "heldout_start": curve[0][2], "heldout_final": final,
            "throughput": throughput, "mismatch_p99": mismatch, "engine_mismatch_p99": 1e-7,
            "is_ratio_p99": 1.1, "correction_masked": 0.0, "entropy": 1.0}


def test_the_least_stale_cell_without_correction_sets_the_target():
    runs = {"none": {1: [fake([[0, 0, 0.2], [10, 5, 0.3]], 0.3), fake([[0, 0, 0.2], [12, 5, 0.32]], 0.32)],
                     4: [fake([[0, 0, 0.2], [8, 5, 0.3]], 0.3, 150), fake([[0, 0, 0.2], [9, 5, 0.25]], 0.25)]},
            "icepop": {1: [fake([[0, 0, 0.2], [11, 5, 0.31]], 0.31)] * 2,
                       4: [fake([[0, 0, 0.2], [7, 5, 0.22]], 0.22, mismatch=2e-2)] * 2}}
    s = summarize(runs)
    assert s["heldout_start"] == 0.2
    assert s["heldout_target"] == pytest.approx(0.2 + 0.9 * 0.11)  # lag 1, none: median 0.31
    assert s["reference"] == {"correction": "none", "lag": 1}
    assert s["time_to_target_s"] == {"none": {"1": 11.0, "4": None}, "icepop": {"1": 11.0, "4": None}}
    assert s["time_to_target_s_runs"]["none"]["4"] == [8.0, None]
    assert s["heldout_final"]["none"]["4"] == pytest.approx(0.275)
    assert s["throughput"]["none"]["4"] == 125.0
    assert s["mismatch_p99"]["icepop"] == {"1": 1e-3, "4": 2e-2}
    assert s["heldout_target_note"] is None


def test_no_gain_at_the_reference_means_no_target():
    flat = [fake([[0, 0, 0.7], [10, 5, 0.66]], 0.66)]
    s = summarize({"none": {1: flat}, "tis": {1: flat}})
    assert s["heldout_target"] is None and s["heldout_target_note"] == learning.NO_GAIN
    assert s["time_to_target_s"] == {"none": {"1": None}, "tis": {"1": None}}


def test_step_medians_skip_steps_without_a_value():
    rows = [{"logprob_abs_diff_all_p99": 0.1, "logprob_abs_diff_p99": None, "entropy": 2.0},
            {"logprob_abs_diff_all_p99": 0.3, "logprob_abs_diff_p99": None, "entropy": 1.0}]
    m = step_medians(rows)
    assert m["mismatch_p99"] == pytest.approx(0.2) and m["engine_mismatch_p99"] is None
    assert m["correction_masked"] is None and m["entropy"] == 1.5


def test_lags_and_corrections_are_checked():
    assert parse_list("1, 4", (1,), lambda v: v >= 1, "--lags", int) == [1, 4]
    assert parse_list(None, (1, 2), lambda v: v >= 1, "--lags", int) == [1, 2]
    with pytest.raises(ConfigError, match="--lags '0,x': '0' is not allowed"):
        parse_list("0,x", (1,), lambda v: v >= 1, "--lags", int)
    with pytest.raises(ConfigError, match="'tiss' is not allowed.*none, tis, mis"):
        parse_list("tiss", (), lambda v: v in ("none", "tis"), "--corrections")


def test_bench_staleness_options_fail_early(capsys):
    from laminar.cli import main

    assert main(["bench", "staleness", "--lags", "1,0"]) == 2
    assert "--lags '1,0'" in capsys.readouterr().err
    assert main(["bench", "staleness", "--corrections", "none,foo"]) == 2
    assert "'foo' is not allowed" in capsys.readouterr().err
    assert main(["bench", "staleness", "--corrections", "tis", "--set", "trainer.correction.cap=1"]) == 2
    assert "trainer.correction.cap=1.0 must be > 1" in capsys.readouterr().err
    assert main(["bench", "staleness", "--set", "trainer.correction.cap=3"]) == 2  # none takes none
    assert "trainer.correction.cap=3 is not a parameter of trainer.correction.kind=none" in \
        capsys.readouterr().err
    assert main(["bench", "modes", "--lags", "1,2"]) == 2
    assert "apply to `laminar bench staleness` only" in capsys.readouterr().err
    assert main(["bench", "staleness", "--modes", "laminar"]) == 2
    assert "apply to `laminar bench modes` only" in capsys.readouterr().err


def test_the_figure_draws_reached_and_missed_cells(tmp_path):
    pytest.importorskip("matplotlib")
    from laminar.bench.staleness_plot import plot_staleness

    runs = {"none": {1: [fake([[0, 0, 0.2], [10, 5, 0.3]], 0.3)], 4: [fake([[0, 0, 0.2], [9, 5, 0.22]], 0.22)]},
            "tis": {1: [fake([[0, 0, 0.2], [11, 5, 0.31]], 0.31)], 4: [fake([[0, 0, 0.2]], None)]}}
    report = {"task": "reverse", "steps": 5, "repeats": 1, "lags": [1, 4], "corrections": ["none", "tis"],
              **summarize(runs),
              "runs": {k: {str(lag): rs for lag, rs in by.items()} for k, by in runs.items()}}
    path = plot_staleness(report, tmp_path / "s.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
