"""partial: partial rollout (AReaL, Kimi). Rollouts never stop for a batch, but every weight
update reaches into every trajectory in flight.

    rollouts:  keep `rollout.batch_groups` groups in flight, whatever the version; when an
               update's global interrupt arrives: abort everything in flight, load the new
               version, resume it all with re-prefill (one trajectory mixes versions; each
               token keeps its own)                                      (Partial, below)
    trainer:   take B complete groups (a mini-batch at a time) → train → push v+1
    driver:    after each update, the interrupt: every rollout swaps to v+1 before the
               trainer goes on (a global interrupt)
    admission: at most rollout.max_outstanding_batches global batches outstanding (AReaL's eta+1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from laminar.config import Config
from laminar.modes.common import start_step
from laminar.modes.driver import Follower, finish
from laminar.rollout.policy import Decision, LoopState
from laminar.runtime import Runtime


@dataclass(frozen=True)
class Partial:
    max_outstanding: int | None  # groups leased or untrained the prompt pool allows

    mixes_versions = True  # interrupted work resumes on the new weights
    repacks = False  # every rollout swaps at every update: no rollout is ever in a ramp-down
    defers_resumed = False  # a resumed job's in-flight work goes on before the loops start

    def decide(self, s: LoopState) -> Decision:
        lease = 0 if s.held else s.free_groups
        return Decision(lease=lease, interrupt=s.sync_ready)  # the update's interrupt


def policy(cfg: Config) -> Partial:
    return Partial(round(cfg.rollout.max_outstanding_batches * cfg.trainer.prompts_per_step))


def run(rt: Runtime) -> dict[str, Any]:
    follower = Follower(rt)
    step = start_step(rt.cfg)
    while step < rt.cfg.trainer.total_steps:
        row = follower.follow(lambda: rt.train("train_next"))               # train, push v+1
        step = row["step"]
        rt.sync_weights(row["version"])                                     # everyone swaps
    return finish(rt, follower)
