"""Schedules: one short file per mode over the same components (DESIGN.md §6).

Each `laminar/modes/<mode>.py` holds the schedule whole: `policy(cfg)`, the rollout side's
decisions (when to admit, when to pull, what to do with in-flight work on a new version; see
laminar/rollout/policy.py), and `run(rt)`, the driver: where it waits. `laminar` and `partial`
run free; `sync`, `one_step` and `stream` deal out global batches with a global weight sync.
All run on the same runtime (laminar/runtime/), engine, trainer and pools.
"""

from __future__ import annotations

import importlib
from typing import Any

from laminar.config import Config
from laminar.types import MODES

__all__ = ["MODES", "run_training", "schedule"]


def schedule(mode: str) -> Any:
    """The module of a mode: its `policy(cfg)` and its driver `run(rt)`."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; pick one of {', '.join(MODES)}")
    return importlib.import_module(f"laminar.modes.{mode}")


def run_training(cfg: Config) -> dict[str, Any]:
    from laminar.modes.common import start_weights
    from laminar.runtime import open_runtime
    from laminar.sinks import check_backends

    check_backends(cfg.metrics)  # a missing wandb / mlflow fails now, not after the warm start
    if cfg.task.name == "dataset" and cfg.cluster.backend == "ray":
        report_dataset(cfg)  # the local runtime prints it as it loads the task
    model_dir, version = start_weights(cfg)
    mode = schedule(cfg.mode)
    with open_runtime(cfg, model_dir, version, mode.policy(cfg)) as rt:
        return mode.run(rt)


def report_dataset(cfg: Config) -> None:
    """One line on the console: the rows of `task.dataset` used and those skipped, by reason."""
    from laminar.tasks.dataset import load_dataset

    _, report = load_dataset(cfg.task.dataset)
    print(report.summary(), flush=True)
