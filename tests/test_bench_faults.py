"""`laminar bench faults`' pure parts: the seeded kill schedule and its headline."""

from __future__ import annotations

import pytest

from laminar.bench.faults import schedule
from laminar.bench.results import headline


def test_the_kill_schedule_is_seeded_spread_and_complete():
    plan = schedule(0, 2, 150)
    assert plan == schedule(0, 2, 150) and plan != schedule(1, 2, 150)
    kinds = sorted(kind for _, _, kind in plan)
    assert kinds == ["job", "relay", "relay", "rollout", "rollout", "trainer"]
    steps = [n for n, _, _ in plan]
    assert steps == sorted(steps) and steps[0] >= 2 and steps[-1] <= 150 - 3
    assert all(b - a >= 2 for a, b in zip(steps, steps[1:]))  # each recovered from first
    assert all(0.0 <= d <= 1.0 for _, d, _ in plan)
    with pytest.raises(ValueError, match="too few"):
        schedule(0, 2, 12)


def test_the_results_index_quotes_the_fault_headline():
    data = {"throughput_ratio_faulty_vs_clean": 0.843, "throughput_ratio_without_job_restart": 0.95,
            "trajectories_lost": 0, "trajectories_duplicated": 0,
            "recovery_s_by_kind": {"rollout": {"median": 4.3}}, "chain_repair_s": {"max": 0.039}}
    text = headline(data)
    assert "lost 0, duplicated 0" in text and "rollout 4.30 s" in text and "0.84" in text


def test_the_watcher_reads_only_complete_new_rows(tmp_path):
    from laminar.bench.faults import Job

    job = Job(tmp_path, tmp_path / "log")
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "step"}\n{"kind": "ev')  # the second row half-written
    job.watch()
    assert job.steps() == 1
    with path.open("a") as f:
        f.write('ent"}\n{"kind": "step"}\n')
    job.watch()
    assert [r["kind"] for _, r in job.arrivals] == ["step", "event", "step"] and job.steps() == 2
