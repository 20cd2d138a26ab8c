"""laminar: trajectory-level asynchrony. Nobody waits for a batch.

    rollouts:  keep `rollout.batch_groups` groups in flight with the weights they hold, until
               the local relay has a version `rollout.version_lag` updates newer; then admit
               nothing, finish what is in flight (the manager may repack that tail onto a peer
               of the same version), pull the newest version and fill up again. A trajectory
               is generated start to finish by one version.              (Laminar, below)
    trainer:   take B complete groups, a mini-batch at a time as they complete → train →
               push to the master relay and go on                         (train "run")
    manager:   every manager.interval_s: health of rollouts and relays, failover, repack
    admission: rollouts lease only while fewer than rollout.max_outstanding_batches global
               batches are leased or waiting untrained, so rollouts that outrun the trainer
               pause instead of running ahead without bound
The driver only watches and stops everything at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from laminar.config import Config
from laminar.modes.driver import Follower, finish
from laminar.rollout.policy import Decision, LoopState
from laminar.runtime import Runtime


@dataclass(frozen=True)
class Laminar:
    version_lag: int  # rollout.version_lag
    max_outstanding: int | None  # groups leased or untrained the prompt pool allows

    mixes_versions = False  # one trajectory, one version
    repacks = True  # a draining rollout's tail may move to a same-version peer
    defers_resumed = False  # a resumed job's in-flight work goes on before the loops start

    def decide(self, s: LoopState) -> Decision:
        # a global weight sync (`rt.sync_weights`, a test's `sync_to`) asks for a version
        # fewer than version_lag updates ahead: drain for it too, or it waits for good
        behind = s.sync_ready or (s.newest is not None and s.newest >= s.version + self.version_lag)
        if not behind:  # top up with the weights we hold
            return Decision(lease=0 if s.held else s.free_groups)
        # drain: start nothing (leased groups wait for the new weights), pull once empty
        return Decision(start=False, pull=s.num_in_flight == 0 and not s.held, draining=True)


def policy(cfg: Config) -> Laminar:
    return Laminar(cfg.rollout.version_lag,
                   round(cfg.rollout.max_outstanding_batches * cfg.trainer.prompts_per_step))


def run(rt: Runtime) -> dict[str, Any]:
    follower = Follower(rt)
    follower.follow(lambda: rt.train("run"))
    return finish(rt, follower)
