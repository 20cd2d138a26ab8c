"""The rollout manager: the one owner of health (rollouts and relays), repack and elasticity.

Every `manager.interval_s` it reads each rollout's `RolloutSnapshot` (weights version, KV used
and capacity, trajectories in flight), and every `relay.heartbeat_s` each relay's heartbeat:
- **failover**: a rollout whose process is gone, that has not answered for
  3 x `cluster.heartbeat_s`, or whose prompt leases expired (it stopped renewing them) is
  declared dead; its unfinished trajectories (from the partial response pool) continue on live
  rollouts (`health.assign_unfinished`: same version, or from scratch, so a trajectory never
  mixes versions unless the schedule does), its untouched leases go back to the prompt pool;
- **relays**: a dead relay is cut out of the chain (`Relays.check`), and the rollouts that
  pulled from it pull from a live one (`health.repoint`);
- **repack** (schedules whose policy `repacks`): `ramp_down_loads` picks the draining rollouts,
  `plan_repack` (Algorithm 1) pairs each source with the densest same-version destination; each
  move is export (abort; the source holds) → adopt (the destination re-prefills) → partial pool
  reassign → release (the emptied source pulls the newest weights and leases its next batch);
- **elasticity**: `add` registers a joining rollout; `retire` moves a leaving one's work first.

Plain Python over three small doors (`Fleet`, `ManagerPools`, `Relays`); the decisions are
pure functions (health.py, repack.py). The Ray actor (actor.py) supplies Ray-backed doors.
It never calls a rollout from inside that rollout's call: rollouts do not call the manager.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from laminar.config import Config
from laminar.manager.health import assign_unfinished, overdue, repoint
from laminar.manager.repack import plan_repack, ramp_down_loads
from laminar.pools.partials import PartialEntry
from laminar.types import GenerationRequest, RolloutSnapshot, Unfinished

log = logging.getLogger("laminar.manager")


class Fleet(Protocol):
    def snapshots(self, ids: list[str], timeout_s: float) -> tuple[dict[str, RolloutSnapshot], list[str]]:
        """Answers within `timeout_s`, and the ids whose process is gone."""

    def export(self, rollout_id: str) -> list[Unfinished]: ...

    def adopt(self, rollout_id: str, moved: list[Unfinished]) -> bool: ...

    def release(self, rollout_id: str) -> None: ...

    def stop(self, rollout_id: str) -> None: ...

    def drop(self, rollout_id: str) -> None:
        """Forget a dead rollout and make sure its process is gone (a hung one must not write
        results later)."""

    def set_relay(self, rollout_id: str, relay_id: str) -> None: ...


class ManagerPools(Protocol):
    def owned_by(self, owner: str) -> list[PartialEntry]: ...

    def reassign(self, traj_ids: list[str], owner: str, states: list[GenerationRequest]) -> None: ...

    def live_groups(self) -> set[str]: ...  # groups with samples in the partial pool or buffer

    def release_owner(self, owner: str, keep: set[str]) -> list[str]: ...

    def expired_owners(self) -> set[str]: ...


class Relays(Protocol):
    def check(self) -> list[str]: ...  # heartbeat, cut the dead out; returns their ids

    @property
    def order(self) -> list[str]: ...  # the chain now, master first

    @property
    def latest(self) -> dict[str, int | None]: ...  # the newest version each relay held at the last check


class RolloutManager:
    def __init__(self, cfg: Config, fleet: Fleet, pools: ManagerPools, relays: Relays | None,
                 rollout_relay: dict[str, str], repack: bool, mixes_versions: bool) -> None:
        self.cfg, self.fleet, self.pools, self.relays = cfg, fleet, pools, relays
        self.rollout_relay = dict(rollout_relay)  # live rollout -> the relay it pulls from
        self.repack, self.mixes_versions = repack, mixes_versions
        now = time.monotonic()
        self.last_seen = {r: now for r in rollout_relay}
        self.lock = threading.Lock()
        self.counters = {"checks": 0, "repacks": 0, "moved_trajectories": 0, "repack_s": 0.0,
                         "refused_moves": 0, "dead_workers": 0, "failover_trajectories": 0,
                         "restarted_trajectories": 0, "returned_groups": 0, "retired_workers": 0,
                         "dead_relays": 0}
        self.dead: list[str] = []

    def run(self, stop: threading.Event) -> dict[str, Any]:
        """Check rollouts every manager.interval_s and relays every relay.heartbeat_s until
        `stop` is set."""
        next_relays = time.monotonic()
        while not stop.wait(self.cfg.manager.interval_s):
            self.check_once()
            if self.relays is not None and time.monotonic() >= next_relays:
                next_relays = time.monotonic() + self.cfg.relay.heartbeat_s
                self.check_relays()
        return self.stats()

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "dead": list(self.dead), "workers": sorted(self.rollout_relay),
                "chain": list(self.relays.order) if self.relays is not None else [],
                "relay_versions": dict(self.relays.latest) if self.relays is not None else {}}

    # ------------------------------------------------------------------------- health

    def check_once(self) -> dict[str, RolloutSnapshot]:
        with self.lock:
            heartbeat = self.cfg.cluster.heartbeat_s
            snaps, gone = self.fleet.snapshots(sorted(self.rollout_relay), heartbeat)
            now = time.monotonic()
            for r in snaps:
                self.last_seen[r] = now
            expired = self.pools.expired_owners()
            dead = sorted(set(gone) | set(overdue(self.last_seen, now, 3 * heartbeat))
                          | (expired & set(self.rollout_relay)))
            for r in dead:
                snaps.pop(r, None)
                self._failover(r, snaps)
            for owner in sorted(expired - set(self.rollout_relay) - set(dead)):
                self._return_leases(owner)  # a rollout that left or died earlier
            self.counters["checks"] += 1
            if self.repack and len(snaps) > 1:
                for source, dest in plan_repack(ramp_down_loads(snaps.values()),
                                                self.cfg.manager.c_max, self.cfg.manager.batch_bound):
                    self._move(source, dest)
            return snaps

    def check_relays(self) -> list[str]:
        with self.lock:
            dead = self.relays.check()
            if dead:
                self.counters["dead_relays"] += len(dead)
                for rollout, relay in repoint(self.rollout_relay, dead, self.relays.order).items():
                    self.rollout_relay[rollout] = relay
                    self.fleet.set_relay(rollout, relay)
                log.warning("relays %s died; the chain is now %s", dead, self.relays.order)
            return dead

    def _failover(self, dead: str, live: dict[str, RolloutSnapshot]) -> None:
        log.warning("rollout %s is dead; failing over", dead)
        del self.rollout_relay[dead]
        self.last_seen.pop(dead, None)
        self.dead.append(dead)
        self.counters["dead_workers"] += 1
        self.fleet.drop(dead)
        entries = self.pools.owned_by(dead)
        self._hand_over(dead, [Unfinished(e.request, e.group) for e in entries], live)
        self.counters["failover_trajectories"] += len(entries)

    def _hand_over(self, owner: str, moved: list[Unfinished], live: dict[str, RolloutSnapshot]) -> None:
        """Continue `owner`'s unfinished trajectories on live rollouts; its untouched leases go
        back to the prompt pool."""
        pending = moved
        for _ in range(3):  # a destination may change version between snapshot and adopt
            versions = {r: s.version for r, s in live.items() if r in self.rollout_relay}
            plan, restarted = assign_unfinished(pending, versions, self.mixes_versions)
            self.counters["restarted_trajectories"] += restarted
            pending = []
            for dest, items in plan.items():
                if self.fleet.adopt(dest, items):
                    self.pools.reassign([m.request.request_id for m in items], dest,
                                        [m.request for m in items])
                else:
                    pending += items
            if not pending:
                break
            live, _ = self.fleet.snapshots(sorted(self.rollout_relay), self.cfg.cluster.heartbeat_s)
        if pending:
            log.warning("%d trajectories of %s found no live rollout; they stay in the partial "
                        "pool", len(pending), owner)
        self._return_leases(owner)

    def _return_leases(self, owner: str) -> None:
        returned = self.pools.release_owner(owner, self.pools.live_groups())
        self.counters["returned_groups"] += len(returned)

    # ------------------------------------------------------------------------- repack

    def _move(self, source: str, dest: str) -> None:
        t0 = time.perf_counter()
        moved = self.fleet.export(source)
        try:
            if not moved:
                return
            if not self.fleet.adopt(dest, moved):
                # the destination changed version meanwhile: give the work back (same version)
                self.fleet.adopt(source, moved)
                self.counters["refused_moves"] += 1
                return
            self.pools.reassign([m.request.request_id for m in moved], dest, [m.request for m in moved])
            self.counters["repacks"] += 1
            self.counters["moved_trajectories"] += len(moved)
        finally:
            self.fleet.release(source)
            self.counters["repack_s"] += time.perf_counter() - t0

    # ------------------------------------------------------------------------- elasticity

    def add(self, rollout_id: str, relay_id: str) -> None:
        """A rollout joins the running job."""
        with self.lock:
            self.rollout_relay[rollout_id] = relay_id
            self.last_seen[rollout_id] = time.monotonic()

    def retire(self, rollout_id: str) -> int:
        """A rollout leaves the running job: its in-flight trajectories move to peers (same
        version), it finishes its environment calls, then stops. Returns how many moved."""
        with self.lock:
            moved = self.fleet.export(rollout_id)  # holds: no new admissions
            deadline = time.monotonic() + self.cfg.cluster.wait_timeout_s
            while time.monotonic() < deadline:
                snaps, _ = self.fleet.snapshots([rollout_id], self.cfg.cluster.heartbeat_s)
                if rollout_id not in snaps or not snaps[rollout_id].num_unsettled:
                    break
                time.sleep(0.05)
            self.fleet.stop(rollout_id)
            del self.rollout_relay[rollout_id]
            self.last_seen.pop(rollout_id, None)
            live, _ = self.fleet.snapshots(sorted(self.rollout_relay), self.cfg.cluster.heartbeat_s)
            self._hand_over(rollout_id, moved, live)
            self.counters["retired_workers"] += 1
            return len(moved)
