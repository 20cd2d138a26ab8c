"""stream: stream generation (StreamRL, AsyncFlow). The trainer takes each mini-batch as soon
as its groups finish, overlapping training with generation of the same batch; the next batch
starts as soon as this one is generated, with the weights of the previous iteration; a global
weight sync at each iteration's end. Staleness <= 1.

    rollouts:  as in sync (GlobalBatch): the dealt-out groups, new weights only at a sync
    driver:    generate(batch i) ∥ train_streaming(batch i, mini-batch by mini-batch);
               once batch i is generated: sync(v_{i-1}) → generate(batch i+1)
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
    step, version, first = start_step(rt.cfg), rt.start_version, True
    step, carried = resume_global_batches(rt, follower, step)
    gen = rt.generate(max(0, B - carried))                            # batch i with v_{i-1}
    while step < total:
        training = rt.train("train_streaming")                        # consumes batch i as it lands
        rt.wait(gen, "generation")
        if step + 1 < total:
            if not first:
                rt.sync_weights(version)                              # global sync at iteration end
            gen = rt.generate(B)                                      # batch i+1, overlapping training
        row = follower.follow(lambda: rt.train("train_streaming"), started=training)
        step, version, first = row["step"], row["version"], False
    return finish(rt, follower)
