"""sync: the verl schedule. Every step all rollouts generate one global batch with version v,
the trainer trains on it, every rollout loads v+1. Nothing overlaps; the slowest trajectory of
the batch holds everyone, and every trajectory has staleness 0.

    rollouts:  generate exactly the groups the driver deals out, with the weights they hold;
               load new weights only at the driver's global sync      (GlobalBatch, below)
    driver:    generate(B) → wait → train → sync(v+1) → repeat          (run, below)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from laminar.config import Config
from laminar.modes.common import start_step
from laminar.modes.driver import Follower, finish, resume_global_batches
from laminar.rollout.policy import Decision, LoopState
from laminar.runtime import Runtime


@dataclass(frozen=True)
class GlobalBatch:
    """The rollout side of every global-batch schedule (sync, one_step, stream)."""

    mixes_versions = False  # a trajectory is generated start to finish by one version
    repacks = False  # a batch is never split across versions, so there is nothing to repack
    max_outstanding: int | None = None  # the driver deals out exactly one batch at a time
    defers_resumed = True  # a resumed job's in-flight work waits for its batch's weights

    def decide(self, s: LoopState) -> Decision:
        if s.sync_ready:  # the global sync's version is here: load it (between batches: idle)
            return Decision(pull=True)
        return Decision(lease=s.num_requested)  # only what the driver asked for


def policy(cfg: Config) -> GlobalBatch:
    return GlobalBatch()


def run(rt: Runtime) -> dict[str, Any]:
    follower = Follower(rt)
    step, total = start_step(rt.cfg), rt.cfg.trainer.total_steps
    B = rt.cfg.trainer.prompts_per_step
    step, carried = resume_global_batches(rt, follower, step)  # a resumed job's batch in progress
    while step < total:
        rt.wait(rt.generate(max(0, B - carried)), "generation")              # all rollouts, v
        carried = 0
        row = follower.follow(lambda: rt.train("train_once"))               # trainer: v -> v+1
        step = row["step"]
        rt.sync_weights(row["version"])                                      # everyone loads v+1
    return finish(rt, follower)
