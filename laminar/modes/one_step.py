"""one_step: one-step off-policy. Batch i+1 is generated with v_i while the trainer trains on
batch i; then a global weight sync. Staleness is exactly 1 after the first batch.
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
    B, total = cfg.trainer.prompts_per_step, cfg.trainer.total_steps
    with Runtime(cfg, model_dir, version) as rt:
        follower = Follower(rt, cfg)
        batches.wait(rt, batches.generate(rt, B), "generation")       # batch 0 with v0
        while version < total:
            nxt = batches.generate(rt, B) if version + 1 < total else []   # batch i+1 with v_i
            version = follower.follow(rt.trainer.train_once.remote)["version"]  # ... while training i
            batches.wait(rt, nxt, "generation")
            batches.sync_weights(rt, version)                         # global sync: v_{i+1}
        return finish(rt, cfg, [])
