"""sync: the verl schedule. Every step: all rollouts generate one global batch with version v,
the trainer trains on it, every rollout loads v+1. Nothing overlaps; the slowest trajectory of
the batch holds everyone, and every trajectory has staleness 0.
"""

from __future__ import annotations

from typing import Any

from laminar.config import Config
from laminar.modes import batches
from laminar.modes.common import start_weights
from laminar.modes.driver import Follower, finish
from laminar.runtime import Runtime


def run(cfg: Config) -> dict[str, Any]:
    model_dir, version = start_weights(cfg)
    B = cfg.trainer.prompts_per_step
    with Runtime(cfg, model_dir, version) as rt:
        follower = Follower(rt, cfg)
        while version < cfg.trainer.total_steps:
            batches.wait(rt, batches.generate(rt, B), "generation")   # all rollouts, version v
            version = follower.follow(rt.trainer.train_once.remote)["version"]  # trainer: v -> v+1
            batches.sync_weights(rt, version)                         # everyone loads v+1
        return finish(rt, cfg, [])
