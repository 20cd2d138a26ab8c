"""One place per fact: the schedules and the built-in tasks are named once, in laminar/types.py;
everything that lists them reads that list (these tests catch a copy that drifted)."""

from __future__ import annotations

from importlib import import_module
from typing import get_args

from laminar import config
from laminar.types import GLOBAL_BATCH_MODES, MODES, TASKS


def test_the_config_allows_the_registered_modes_and_tasks():
    assert config.MODES == MODES and get_args(config.Mode) == MODES
    assert config.GLOBAL_BATCH_MODES == GLOBAL_BATCH_MODES
    assert get_args(config.TaskConfig.model_fields["name"].annotation) == TASKS


def test_every_mode_has_a_schedule_and_a_simulated_schedule():
    from laminar.modes import schedule
    from laminar.sim import paper
    from laminar.sim.schedules import SCHEDULES

    for mode in MODES:
        assert callable(schedule(mode).run) and callable(schedule(mode).policy)
        assert callable(import_module(f"laminar.sim.schedules.{mode}").run)
    assert tuple(SCHEDULES) == MODES == paper.MODES
    assert set(paper.PAPER_NAMES) == set(MODES)
    assert set(GLOBAL_BATCH_MODES) < set(MODES)


def test_the_bench_workloads_are_built_in_tasks():
    from laminar.bench.modes import REFERENCE_CORRECTION, WORKLOADS

    assert set(WORKLOADS) <= set(TASKS)
    assert set(REFERENCE_CORRECTION) == set(MODES)
