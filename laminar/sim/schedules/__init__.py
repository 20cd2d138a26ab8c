"""The five schedules of DESIGN.md §6 on the simulator's clock, one short file each.

`SCHEDULES[mode](setup, warmup, measure) -> SimResult`, for every mode of `laminar.types.MODES`.
"""

from __future__ import annotations

from importlib import import_module

from laminar.types import MODES

SCHEDULES = {mode: import_module(f"{__name__}.{mode}").run for mode in MODES}
