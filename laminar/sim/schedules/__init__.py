"""The five schedules of DESIGN.md §6 on the simulator's clock, one short file each.

`SCHEDULES[mode](setup, warmup, measure) -> SimResult`.
"""

from __future__ import annotations

from laminar.sim.schedules import laminar, one_step, partial, stream, sync

SCHEDULES = {
    "laminar": laminar.run,
    "sync": sync.run,
    "one_step": one_step.run,
    "stream": stream.run,
    "partial": partial.run,
}
