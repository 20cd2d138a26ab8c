"""partial: partial rollout (AReaL, Kimi). Rollouts never stop for a batch, but every weight
update reaches into every trajectory in flight.

    rollouts:  keep the engine topped up with new groups                        (run_free)
    trainer:   take B complete groups (a mini-batch at a time) → train → push v+1
    update:    every rollout aborts everything in flight, loads v+1, resumes it all with
               re-prefill (one trajectory mixes versions; each token keeps its own); the
               trainer goes on only when all have swapped (a global interrupt)
    admission: at most rollout.max_outstanding_batches global batches outstanding (AReaL's eta+1)
"""

from __future__ import annotations

from typing import Any

from laminar.config import Config
from laminar.modes.common import start_weights
from laminar.modes.driver import Follower, finish
from laminar.runtime import Runtime


def run(cfg: Config) -> dict[str, Any]:
    model_dir, version = start_weights(cfg)
    bound = round(cfg.rollout.max_outstanding_batches * cfg.trainer.prompts_per_step)
    with Runtime(cfg, model_dir, version, max_outstanding=bound) as rt:
        loops = [w.run_free.remote("partial") for w in rt.workers.values()]
        loops.append(rt.manager.run.remote(repack=False))
        follower = Follower(rt, cfg)
        while version < cfg.trainer.total_steps:
            version = follower.follow(rt.trainer.train_next.remote)["version"]  # train, push v+1
            rt.wait({f"interrupt of {w}": h.interrupt_and_swap.remote(version)  # everyone swaps
                     for w, h in rt.workers.items()})
        return finish(rt, cfg, loops)
