"""one_step: one-step off-policy. Batch i+1 is generated with v_i while the trainer trains on
batch i; then a global weight sync. Staleness is exactly 1 after the first batch.

    rollouts:  as in sync (GlobalBatch): the dealt-out groups, new weights only at a sync
    driver:    generate(batch 0) → wait; then: generate(batch i+1) ∥ train(batch i) → wait
               → sync(v_{i+1}) → repeat
"""

from __future__ import annotations

from typing import Any

from laminar.config import Config
from laminar.modes.common import start_step
from laminar.modes.driver import Follower, finish, resume_global_batches
from laminar.modes.sync import GlobalBatch
from laminar.runtime import Runtime


def policy(cfg: Config) -> GlobalBatch:
    return GlobalBatch()


def run(rt: Runtime) -> dict[str, Any]:
    follower = Follower(rt)
    B, total = rt.cfg.trainer.prompts_per_step, rt.cfg.trainer.total_steps
    step = start_step(rt.cfg)
    step, carried = resume_global_batches(rt, follower, step)
    rt.wait(rt.generate(max(0, B - carried)), "generation")                # batch 0 with v0
    while step < total:
        nxt = rt.generate(B) if step + 1 < total else None                 # batch i+1 with v_i
        row = follower.follow(lambda: rt.train("train_once"))              # ... while training i
        step = row["step"]
        if nxt is not None:
            rt.wait(nxt, "generation")
            rt.sync_weights(row["version"])                                # global sync: v_{i+1}
    return finish(rt, follower)
