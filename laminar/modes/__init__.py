"""Schedules: one short file per mode over the same components (DESIGN.md §6).

`laminar`, `partial`: free-running rollouts; `sync`, `one_step`, `stream`: global batches with
a global weight sync. All run on the same runtime (laminar.runtime), engine, trainer and pools.
"""

from __future__ import annotations

import importlib
from typing import Any

from laminar.config import Config

MODES = ("laminar", "sync", "one_step", "stream", "partial")


def run_training(cfg: Config) -> dict[str, Any]:
    if cfg.cluster.backend == "local":
        from laminar.modes.local_sync import run

        return run(cfg)
    return importlib.import_module(f"laminar.modes.{cfg.mode}").run(cfg)
