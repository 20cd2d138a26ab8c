"""stream: stream generation (StreamRL, AsyncFlow). The trainer takes each mini-batch as soon
as its groups finish, overlapping training with generation of the same batch; the next batch
starts as soon as this one is generated, with the weights of the previous iteration; a global
weight sync at each iteration's end. Staleness <= 1.
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
    B, total, first = cfg.trainer.prompts_per_step, cfg.trainer.total_steps, version
    with Runtime(cfg, model_dir, version) as rt:
        follower = Follower(rt, cfg)
        gen = batches.generate(rt, B)                                 # batch i with v_{i-1}
        while version < total:
            training = rt.trainer.train_streaming.remote()            # consumes batch i as it lands
            batches.wait(rt, gen, "generation")
            if version + 1 < total:
                if version > first:
                    batches.sync_weights(rt, version)                 # global sync at iteration end
                gen = batches.generate(rt, B)                         # batch i+1, overlapping training
            version = follower.follow(rt.trainer.train_streaming.remote, started=training)["version"]
        return finish(rt, cfg, [])
