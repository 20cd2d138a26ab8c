"""The relays of one job as Ray actors: started, chained, heartbeated, repaired.

    group = RelayGroup(["node0", "node1"], job, secret, cfg.relay, options)   # starts them
    dead = group.find_dead()   # heartbeat every relay in the plan: the dead and the hung
    group.cut(dead)            # re-plan without them; returns once the live relays hold the plan
    dead = group.check()       # both
    group.shutdown()           # stop them and remove their shared memory

The runtime starts the group and shuts it down; the rollout manager (laminar/manager/) calls
`find_dead()` and `cut()` as part of its health loop, so one component owns the health of
rollouts and relays. Relays also repair their own link when their successor dies
(laminar/relay/relay.py), so `cut()` only has to make the plans agree; a dead master's
successor becomes master (`plan.repair`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import ray

from laminar.config import RelayConfig
from laminar.relay.plan import ChainPlan, RelayInfo, repair
from laminar.relay.relay import Relay, segment_prefix
from laminar.relay.store import cleanup

log = logging.getLogger("laminar.relay")


def start_relay_actor(relay_id: str, job: str, secret: bytes, cfg: RelayConfig | None = None,
                      **options: Any) -> Any:
    """One relay actor (pass e.g. scheduling_strategy to pin it to a node). The actor is
    threaded so heartbeats are answered while a publish is running."""
    opts = {"num_cpus": 0, "max_concurrency": 8, **options}
    return ray.remote(Relay).options(**opts).remote(relay_id, job, secret, cfg)


class RelayGroup:
    def __init__(self, ids: list[str], job: str, secret: bytes, cfg: RelayConfig | None = None,
                 options: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.job, self.cfg = job, cfg or RelayConfig()
        self.actors = {i: start_relay_actor(i, job, secret, self.cfg, **dict((options or {}).get(i, {})))
                       for i in ids}
        infos = ray.get([self.actors[i].heartbeat.remote() for i in ids], timeout=60)
        self.infos = {h["id"]: RelayInfo.from_dict(h["info"]) for h in infos}
        self.pids = {h["id"]: h["pid"] for h in infos}
        self.latest: dict[str, int | None] = {h["id"]: h["latest"] for h in infos}  # at the last check
        self.plan = ChainPlan(tuple(ids), self.infos, 1)
        self._broadcast_plan()

    @property
    def master(self) -> str | None:
        return self.plan.master

    def check(self) -> list[str]:
        """Heartbeat every relay in the plan; returns the ids found dead (and cuts them out)."""
        dead = self.find_dead()
        if dead:
            self.cut(dead)
        return dead

    def find_dead(self) -> list[str]:
        """Heartbeat every relay in the plan: those whose process is gone or that did not
        answer within relay.timeout_s."""
        ids = list(self.plan.order)
        refs = [self.actors[i].heartbeat.remote() for i in ids]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.timeout_s)
        dead = []
        for i, ref in zip(ids, refs):
            try:
                if ref not in ready:
                    raise TimeoutError(f"no heartbeat within {self.cfg.timeout_s}s")
                self.latest[i] = ray.get(ref)["latest"]
            except Exception:  # actor died or hangs: both mean cut it out
                dead.append(i)
        return dead

    def cut(self, dead: list[str]) -> None:
        """Re-plan the chain without `dead` (one link changes per relay; a dead master's
        successor becomes master) and tell the live relays; returns once they acknowledged
        or relay.timeout_s passed."""
        for i in dead:
            self.plan = repair(self.plan, i)
        log.warning("relays %s are gone; chain is now %s", dead, list(self.plan.order))
        self._broadcast_plan()

    def shutdown(self) -> None:
        for i, actor in self.actors.items():
            try:
                ray.get(actor.stop.remote(), timeout=self.cfg.timeout_s)
            except Exception:
                pass  # already dead: its files are removed below
            ray.kill(actor)
            cleanup(self.cfg.shm_dir, segment_prefix(self.job, i))

    def _broadcast_plan(self) -> None:
        refs = [self.actors[i].set_plan.remote(self.plan.to_dict()) for i in self.plan.order]
        ray.wait(refs, num_returns=len(refs), timeout=self.cfg.timeout_s)
