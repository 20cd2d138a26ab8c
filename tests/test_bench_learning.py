"""The learning half of `laminar bench modes` (pure functions): held-out curves on the wall
clock, the target fixed by rule, time to it, and the summaries over repeats."""

from __future__ import annotations

import pytest

from laminar.bench import learning
from laminar.bench.modes import rotated, summarize


def rows(published: dict[int, float], scores: dict[int, float]) -> list[dict]:
    out = [{"kind": "step", "version": v, "time": t} for v, t in published.items()]
    out += [{"kind": "eval", "version": v, "time": 99.0, "greedy_exact_match": s}
            for v, s in scores.items()]
    return out


def test_a_point_is_timed_when_its_version_was_published_not_when_it_was_scored():
    curve = learning.heldout_curve(rows({1: 2.0, 2: 4.5, 3: 7.0}, {0: 0.2, 3: 0.4, 2: 0.3}))
    assert curve == [[0.0, 0, 0.2], [4.5, 2, 0.3], [7.0, 3, 0.4]]


def test_target_is_the_start_plus_ninety_percent_of_syncs_median_gain():
    assert learning.heldout_target(0.2, [0.3, 0.4, 0.35]) == pytest.approx(0.2 + 0.9 * 0.15)


def test_time_to_target_is_the_first_crossing_or_none():
    curve = [[0.0, 0, 0.2], [3.0, 5, 0.31], [6.0, 10, 0.29], [9.0, 15, 0.4]]
    assert learning.time_to_target(curve, 0.3) == 3.0
    assert learning.time_to_target(curve, 0.4) == 9.0
    assert learning.time_to_target(curve, 0.5) is None


def test_a_run_that_never_reached_the_target_counts_as_slower_than_any_that_did():
    assert learning.median_or_none([10.0, None, 20.0]) == 20.0
    assert learning.median_or_none([10.0, None, None]) is None
    assert learning.median_or_none([]) is None


def test_ratios_pair_runs_of_the_same_repeat():
    assert learning.paired_ratios([10.0, 12.0, 9.0], [5.0, 4.0, 3.0]) == [2.0, 3.0, 3.0]
    assert learning.summary([2.0, 3.0, 1.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}


def test_every_mode_leads_off_once_over_as_many_repeats():
    modes = ["laminar", "sync", "partial"]
    assert [rotated(modes, r)[0] for r in range(3)] == ["laminar", "sync", "partial"]
    assert sorted(rotated(modes, 4)) == sorted(modes)


def fake_run(throughput: float, curve: list[list[float]], steps: int = 10) -> dict:
    return {"throughput": throughput, "heldout": curve, "reward_curve": [(1.0, 0.5)],
            "heldout_start": curve[0][2], "heldout_final": curve[-1][2] if curve[-1][1] == steps else None,
            "train_wall_s": curve[-1][0], "wall_s": curve[-1][0] + 20.0, "steps": steps,
            "staleness": {0: 1}, "breakdown": {}, "cpu": {},
            "old_logprobs": "rollout", "correction": "none"}


def test_summary_of_repeats_gives_the_target_and_who_reached_it_when():
    sync = [fake_run(100, [[0, 0, 0.2], [50, 5, 0.25], [100, 10, 0.3]]),
            fake_run(110, [[0, 0, 0.2], [40, 5, 0.3], [90, 10, 0.32]]),
            fake_run(90, [[0, 0, 0.2], [60, 5, 0.26], [120, 10, 0.3]])]
    lam = [fake_run(300, [[0, 0, 0.2], [10, 5, 0.3], [20, 10, 0.31]]),
           fake_run(330, [[0, 0, 0.2], [12, 5, 0.28], [24, 10, 0.3]]),
           fake_run(270, [[0, 0, 0.2], [15, 5, 0.2], [30, 10, 0.22]])]  # never gets there
    s = summarize({"laminar": lam, "sync": sync})
    assert s["heldout_start"] == 0.2
    assert s["heldout_target"] == pytest.approx(0.2 + 0.9 * 0.1)  # sync's median final: 0.3
    assert s["time_to_heldout_target_s_runs"] == {"laminar": [10.0, 24.0, None],
                                                  "sync": [100.0, 40.0, 120.0]}
    assert s["time_to_heldout_target_s_by_mode"] == {"laminar": 24.0, "sync": 100.0}
    assert s["heldout_speedup_laminar_vs"] == {"sync": pytest.approx(100 / 24)}
    assert s["ratio_laminar_vs"]["sync"] == pytest.approx(3.0)
    assert s["ratio_laminar_vs_range"]["sync"] == pytest.approx([3.0, 3.0])
    assert s["heldout_by_mode"]["laminar"] == lam[1]["heldout"]  # the median run's curve
    # the whole run (its start-up too) per update: median of (20 + the last eval's time) / 10
    assert s["run_wall_s_per_update_by_mode"] == {"laminar": pytest.approx(4.4),
                                                  "sync": pytest.approx(12.0)}


def test_no_held_out_gain_means_no_target_not_zero_seconds():
    """A user's dataset task: start 0.70, sync's final 0.66. The target used to be 0.664,
    below the start, and every mode "reached" it in 0 s."""
    from laminar.bench.learning import NO_GAIN, heldout_target

    assert heldout_target(0.70, [0.66]) is None and heldout_target(0.5, [0.5]) is None
    assert heldout_target(0.5, [0.6]) == pytest.approx(0.59)
    sync = [fake_run(100, [[0, 0, 0.70], [50, 5, 0.68], [100, 10, 0.66]])]
    lam = [fake_run(300, [[0, 0, 0.70], [10, 5, 0.71], [20, 10, 0.69]])]
    s = summarize({"laminar": lam, "sync": sync})
    assert s["heldout_target"] is None and s["heldout_target_note"] == NO_GAIN
    assert s["time_to_heldout_target_s_by_mode"] == {"laminar": None, "sync": None}
    assert s["sync_heldout_gain"] == pytest.approx(-0.04)
    assert s["heldout_speedup_laminar_vs"] == {}


def test_sync_sets_the_target_in_its_steps_and_the_others_get_room_to_reach_it():
    from laminar.bench.modes import RACE, mode_steps

    assert mode_steps("sync", 80) == 80
    assert mode_steps("laminar", 80) == mode_steps("partial", 80) == round(80 * RACE) > 80
