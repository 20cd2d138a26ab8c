"""partial: partial rollout (AReaL, Kimi). Rollouts never stop, but every weight update reaches
into every trajectory in flight.

    rollouts:  generate continuously; when a newer version reaches the local relay, abort
               everything in flight, load it, resume all of it with re-prefill (one trajectory
               mixes versions; each token keeps the version that produced it)
    trainer:   take B complete groups → train → push → repeat
    admission: at most rollout.max_outstanding_batches global batches outstanding (AReaL's eta+1)
"""

from __future__ import annotations

from typing import Any

from laminar.config import Config
from laminar.modes.driver import Follower, finish, start_weights
from laminar.runtime import Runtime


def run(cfg: Config) -> dict[str, Any]:
    model_dir, version = start_weights(cfg)
    bound = cfg.rollout.max_outstanding_batches * cfg.trainer.prompts_per_step
    with Runtime(cfg, model_dir, version, max_outstanding=bound) as rt:
        loops = [w.run_free.remote("partial") for w in rt.workers.values()]
        loops.append(rt.manager.run.remote(repack=False))
        Follower(rt, cfg).follow(rt.trainer.run.remote(cfg.trainer.total_steps))
        return finish(rt, cfg, loops)
