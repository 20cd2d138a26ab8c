"""laminar: trajectory-level asynchrony. Nobody waits for a batch.

    rollouts:  top up with the current version until the local relay is rollout.version_lag
               versions ahead → drain (or be repacked) → pull the newest → top up again (run_free)
    trainer:   take B complete groups (a mini-batch at a time) → train → push to the master
               relay → repeat                                                     (run)
    manager:   every interval: health checks, failover, repack the long tail
Admission control (rollout.max_outstanding_batches) keeps rollouts that outrun the trainer from
running ahead without bound. The driver only watches and stops everything at the end.
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
        loops = [w.run_free.remote("laminar") for w in rt.workers.values()]
        loops.append(rt.manager.run.remote(repack=cfg.manager.repack))
        Follower(rt, cfg).follow(lambda: rt.trainer.run.remote(cfg.trainer.total_steps))
        return finish(rt, cfg, loops)
