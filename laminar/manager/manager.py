"""The rollout manager: the one owner of health (rollouts and relays), repack and elasticity.

Every `manager.interval_s` it reads each rollout's `RolloutSnapshot` (weights version, KV used
and capacity, trajectories in flight), and every `relay.heartbeat_s` each relay's heartbeat:
- **failover**: a rollout whose process is gone, that has not answered for
  `cluster.hang_timeout_s`, or whose prompt leases expired (it stopped renewing them) is
  declared dead; its unfinished trajectories (from the partial response pool) continue on live
  rollouts (`health.assign_unfinished`: same version, or from scratch, so a trajectory never
  mixes versions unless the schedule does), its untouched leases go back to the prompt pool;
  work that found no live rollout stays in the partial pool and is handed over at a later check;
- **re-creation** (`manager.recreate`, at most `manager.max_recreates` times per slot): a new
  rollout starts in the dead one's place (`Fleet.spawn`, on its relay's node, `health.
  recreate_on`) under a new incarnation id (`health.incarnation`: `rollout0.1`), and joins
  the fleet once it answers; the start runs in the background, so checks go on meanwhile;
- **relays**: a dead relay (the master too) is cut out of the chain and the live relays and
  the trainer get the new plan (`Relays.find_dead`, `Relays.cut`); the rollouts that pulled
  from it pull from a live one (`health.repoint`);
- **repack** (schedules whose policy `repacks`; docs/repack.md): at every check each rollout's
  KV use is compared with the previous check's (`kv_history`): `idle_loads` picks the rollouts
  in decline (§5.2: their KV fell with nothing left to admit), `plan_repack` (Algorithm 1)
  pairs each source with the densest same-version destination under C_max and the batch
  bound B (`manager.batch_bound`; by default, `batch_bound`: the knee of this machine's decode
  curve for the native engine, `rollout.engine.max_batch_size` for another backend); each move
  is export (abort; the source holds) → adopt (the destination re-prefills) → partial pool
  reassign → release (the emptied source pulls the newest weights and leases its next batch). A check that sees a newly published version (`is_post_update`)
  is followed by another after a quarter interval, when the rollouts it made stale have
  started to decline: the paper's post-update trigger;
- **elasticity**: `add` registers a joining rollout; `retire` moves a leaving one's work first.

Every failure is recorded in `stats()["faults"]`: kind (rollout, relay), who, when the manager
detected it and when it was repaired (work handed over; the chain re-planned), and for a
rollout the trajectories that moved with the version they continue in and its replacement.

Plain Python over three small doors (doors.py: `Fleet`, `ManagerPools`, `Relays`); the decisions are
pure functions (health.py, repack.py). The Ray actor (actor.py) supplies Ray-backed doors.
It never calls a rollout from inside that rollout's call: rollouts do not call the manager.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from laminar.config import Config
from laminar.engine.knee import cached_knee
from laminar.manager.doors import Fleet, ManagerPools, Relays
from laminar.manager.health import assign_unfinished, incarnation, overdue, recreate_on, repoint
from laminar.manager.repack import KvSample, idle_loads, is_post_update, kv_phase, plan_repack
from laminar.types import RolloutSnapshot, Unfinished

log = logging.getLogger("laminar.manager")


def batch_bound(cfg: Config) -> int:
    """Algorithm 1's B: `manager.batch_bound`, or else what the backend's scheduler decodes
    well together, never above its decode batch (`rollout.engine.max_batch_size`: trajectories
    beyond it would wait in the destination's queue, not decode). For the native engine that is
    the knee of this machine's decode curve for the run's model (laminar/engine/knee.py; cached,
    measured once in a child process); another backend has no such curve measured here, so its
    scheduler's limit is the bound."""
    limit = cfg.rollout.engine.max_batch_size
    bound = cfg.manager.batch_bound
    if bound is None and cfg.rollout.engine.backend != "native":
        log.info("manager.batch_bound: %d, rollout.engine.max_batch_size of the %s backend",
                 limit, cfg.rollout.engine.backend)
        return limit
    if bound is None:
        bound = cached_knee(cfg.model.preset, cfg.model.path, cfg.rollout.threads)["knee"]
        log.info("manager.batch_bound: %d, the knee of this machine's decode curve", bound)
    return min(bound, limit)


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
                         "dead_relays": 0, "recreated_workers": 0, "recreate_failures": 0,
                         "check_errors": 0}
        self.dead: list[str] = []
        self.slot = {r: r for r in rollout_relay}  # live rollout -> its slot (first incarnation's id)
        self.recreates: dict[str, int] = {}  # slot -> re-creations started so far
        # new id -> (slot, dead id, relay, fault); dead id and fault None: a rollout joining
        self.spawning: dict[str, tuple[str, str | None, str, dict[str, Any] | None]] = {}
        self.nodes_joined: list[dict[str, Any]] = []  # {node, relay, rollouts, at}
        self.recreated: list[list[str]] = []  # [dead id, the id of the rollout that replaced it]
        self.orphaned: set[str] = set()  # dead rollouts with work that found no live rollout yet
        self.faults: list[dict[str, Any]] = []  # {kind, who, detected_at, repaired_at, ...}, Unix time
        self.kv_history: dict[str, KvSample] = {}  # rollout -> its KV at the previous check (C_prev)
        self.kv_phases: dict[str, str] = {}  # rollout -> its phase at the last check
        self.newest_seen: int | None = None  # newest published version seen at a check
        self.post_update = False  # the last check saw a new version: check again soon
        self.batch_bound = batch_bound(cfg) if self.repack else None

    def run(self, stop: threading.Event) -> dict[str, Any]:
        """Check rollouts every manager.interval_s (`next_check_s`) and relays every
        relay.heartbeat_s until `stop` is set."""
        next_relays = time.monotonic()
        while not stop.wait(self.next_check_s()):
            try:
                self.check_once()
                if self.relays is not None and time.monotonic() >= next_relays:
                    next_relays = time.monotonic() + self.cfg.relay.heartbeat_s
                    self.check_relays()
                    self.check_nodes()
            except Exception:  # a pool call that timed out, a rollout that vanished mid-call:
                # the health loop must outlive it (it is the job's only failure detector)
                self.counters["check_errors"] += 1
                log.exception("rollout manager: a health check failed; the next one goes on")
        return self.stats()

    def next_check_s(self) -> float:
        """manager.interval_s; a quarter of it after a check that saw a newly published version
        (the post-update trigger: the rollouts it made stale stop admitting, and their decline
        is measured against that check's KV)."""
        return self.cfg.manager.interval_s / (4 if self.post_update else 1)

    def stats(self) -> dict[str, Any]:
        """Counters and state, JSON-safe. Not under the lock (a retirement holds it for long);
        each copy is one step the health loop cannot interleave with."""
        return {**self.counters, "dead": list(self.dead), "workers": sorted(self.rollout_relay),
                "worker_relay": dict(self.rollout_relay),
                "recreated": [list(p) for p in self.recreated], "spawning": sorted(self.spawning),
                "faults": [dict(f) for f in self.faults],
                "nodes_joined": [dict(n) for n in self.nodes_joined],
                "relay_addresses": dict(getattr(self.relays, "addresses", {}) or {}),
                "relay_joins": list(getattr(self.relays, "joins", []) or []),
                "kv_phases": dict(self.kv_phases), "batch_bound": self.batch_bound,
                "chain": list(self.relays.order) if self.relays is not None else [],
                "relay_versions": dict(self.relays.latest) if self.relays is not None else {}}

    # ------------------------------------------------------------------------- health

    def check_once(self) -> dict[str, RolloutSnapshot]:
        with self.lock:
            self._collect_spawned()
            heartbeat = self.cfg.cluster.heartbeat_s
            snaps, gone = self.fleet.snapshots(sorted(self.rollout_relay), heartbeat)
            now = time.monotonic()
            for r in snaps:
                self.last_seen[r] = now
            expired = self.pools.expired_owners()
            dead = sorted(set(gone) | set(overdue(self.last_seen, now, self.cfg.cluster.hang_timeout_s))
                          | (expired & set(self.rollout_relay)))
            for r in dead:
                snaps.pop(r, None)
                self._failover(r, snaps)
            for owner in sorted(expired - set(self.rollout_relay) - set(dead)):
                self._return_leases(owner)  # a rollout that left or died earlier
            for owner in sorted(self.orphaned) if snaps else []:
                entries = self.pools.owned_by(owner)
                if len(self._hand_over(owner, [Unfinished(e.request, e.group) for e in entries], snaps)) == len(entries):
                    self.orphaned.discard(owner)
            self.counters["checks"] += 1
            if self.repack:
                self._repack(snaps)
            return snaps

    def check_relays(self) -> list[str]:
        dead = self.relays.find_dead()  # outside the lock: a hung relay takes relay.timeout_s
        if not dead:
            return []
        with self.lock:
            detected, master = time.time(), self.relays.order[0]
            self.relays.cut(dead)
            replaced = self.replace_relays(dead)
            before = dict(self.rollout_relay)
            for rollout, relay in repoint(self.rollout_relay, dead, self.relays.order).items():
                relay = replaced.get(before[rollout], relay)  # a new relay on its own node
                self.rollout_relay[rollout] = relay
                self.fleet.set_relay(rollout, relay)
            repaired, chain = time.time(), list(self.relays.order)
            self.counters["dead_relays"] += len(dead)
            self.faults += [{"kind": "relay", "who": r, "master": r == master, "detected_at": detected,
                             "repaired_at": repaired, "chain": chain} for r in dead]
            log.warning("relays %s died; the chain is now %s (re-planned in %.3fs)", dead, chain,
                        repaired - detected)
            return dead

    def check_nodes(self) -> None:
        """Machines that joined the cluster (the Ray actor watches them; nothing here)."""

    def replace_relays(self, dead: list[str]) -> dict[str, str]:
        """Dead relay -> a new relay on the same node, where one was started (on a cluster,
        when the node outlived its relay: its rollouts can read only their own node's shared
        memory). One machine: nothing; every relay's memory is local."""
        return {}

    def _failover(self, dead: str, live: dict[str, RolloutSnapshot]) -> None:
        log.warning("rollout %s is dead; failing over", dead)
        detected = time.time()
        relay, slot = self.rollout_relay.pop(dead), self.slot.pop(dead, dead)
        self.last_seen.pop(dead, None)
        self.dead.append(dead)
        self.counters["dead_workers"] += 1
        self.fleet.drop(dead)
        entries = self.pools.owned_by(dead)
        moved = self._hand_over(dead, [Unfinished(e.request, e.group) for e in entries], live)
        if len(moved) < len(entries):
            self.orphaned.add(dead)
        self.counters["failover_trajectories"] += len(entries)
        fault = {"kind": "rollout", "who": dead, "detected_at": detected, "repaired_at": time.time(),
                 "moved": {m.request.request_id: m.request.version for m in moved},
                 "replacement": None, "recreated_at": None}
        self.faults.append(fault)
        self._recreate(slot, dead, relay, fault)

    def _hand_over(self, owner: str, moved: list[Unfinished],
                   live: dict[str, RolloutSnapshot]) -> list[Unfinished]:
        """Continue `owner`'s unfinished trajectories on live rollouts; its untouched leases go
        back to the prompt pool. Returns the trajectories that moved, as they continue (a
        restarted one without its tokens and version); the rest stay `owner`'s."""
        first = {m.request.request_id: m.request.version for m in moved}
        pending, adopted = moved, []
        for _ in range(3):  # a destination may change version between snapshot and adopt
            versions = {r: s.version for r, s in live.items() if r in self.rollout_relay}
            if not versions:
                break
            plan, _ = assign_unfinished(pending, versions, self.mixes_versions)
            pending = []
            for dest, items in plan.items():
                if self.fleet.adopt(dest, items):
                    self.pools.reassign([m.request.request_id for m in items], dest,
                                        [m.request for m in items])
                    adopted += items
                else:
                    pending += items
            if not pending:
                break
            live, _ = self.fleet.snapshots(sorted(self.rollout_relay), self.cfg.cluster.heartbeat_s)
        self.counters["restarted_trajectories"] += sum(
            1 for m in adopted if first[m.request.request_id] is not None and m.request.version is None)
        if pending:
            log.warning("%d trajectories of %s found no live rollout; they stay in the partial "
                        "pool until one does", len(pending), owner)
        self._return_leases(owner)
        return adopted

    def _recreate(self, slot: str, dead: str, relay: str, fault: dict[str, Any],
                  failed_on: frozenset[str] = frozenset()) -> None:
        """Start a rollout in the place of `dead` (manager.recreate), unless its slot used up
        manager.max_recreates; it joins at a later check, once it answers (`_collect_spawned`)."""
        n = self.recreates.get(slot, 0)
        if not self.cfg.manager.recreate or n >= self.cfg.manager.max_recreates:
            return
        relays = list(self.relays.order) if self.relays is not None else [relay]
        on = recreate_on(relay, relays, failed_on)
        if on is None:
            log.warning("no live relay to start a rollout in place of %s beside", dead)
            return
        self.recreates[slot] = n + 1
        new = incarnation(slot, n + 1)
        self.spawning[new] = (slot, dead, on, fault)
        log.warning("starting rollout %s in place of %s (pulling from relay %s)", new, dead, on)
        self.fleet.spawn(new, on)

    def _collect_spawned(self) -> None:
        started, failed = self.fleet.spawned()
        for new in started:
            slot, dead, relay, fault = self.spawning.pop(new)
            self.rollout_relay[new], self.slot[new], self.last_seen[new] = relay, slot, time.monotonic()
            if dead is None:  # a new rollout on a node that joined, not a replacement
                log.warning("rollout %s joined (pulling from relay %s)", new, relay)
                continue
            fault["replacement"], fault["recreated_at"] = new, time.time()
            self.recreated.append([dead, new])
            self.counters["recreated_workers"] += 1
            log.warning("rollout %s replaces %s", new, dead)
        for new, why in failed.items():
            slot, dead, relay, fault = self.spawning.pop(new)
            if dead is None:
                log.warning("rollout %s (joining beside relay %s) did not start: %s", new, relay, why)
                continue
            self.counters["recreate_failures"] += 1
            log.warning("rollout %s (in place of %s) did not start: %s", new, dead, why)
            self._recreate(slot, dead, relay, fault, frozenset({relay}))

    def _return_leases(self, owner: str) -> None:
        returned = self.pools.release_owner(owner, self.pools.live_groups())
        self.counters["returned_groups"] += len(returned)

    # ------------------------------------------------------------------------- repack

    def _repack(self, snaps: dict[str, RolloutSnapshot]) -> None:
        """Algorithm 1 over the rollouts in decline since the previous check; then remember
        this check's KV of every rollout as the next one's C_prev."""
        c_max = self.cfg.manager.c_max
        self.post_update = is_post_update(self.newest_seen, snaps.values())
        self.newest_seen = max([self.newest_seen or 0] + [s.newest for s in snaps.values()
                                                           if s.newest is not None])
        self.kv_phases = {r: kv_phase(self.kv_history.get(r), s, c_max) for r, s in snaps.items()}
        loads = idle_loads(snaps.values(), self.kv_history, c_max)
        self.kv_history = {r: KvSample(s.version, s.kv_used_tokens) for r, s in snaps.items()}
        if len(loads) < 2:
            return
        for source, dest in plan_repack(loads, c_max, self.batch_bound):
            self._move(source, dest)
            self.kv_history.pop(source, None)  # emptied: it fills up afresh

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

    def spawn_joining(self, rollout_id: str, relay_id: str) -> None:
        """Start a new rollout beside `relay_id` in the background; it joins the job once it
        answers (`_collect_spawned`), after pulling the newest version from that relay."""
        self.spawning[rollout_id] = (rollout_id, None, relay_id, None)
        self.fleet.spawn(rollout_id, relay_id)

    def add(self, rollout_id: str, relay_id: str) -> None:
        """A rollout joins the running job."""
        with self.lock:
            self.rollout_relay[rollout_id] = relay_id
            self.slot[rollout_id] = rollout_id
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
            self.slot.pop(rollout_id, None)
            self.last_seen.pop(rollout_id, None)
            live, _ = self.fleet.snapshots(sorted(self.rollout_relay), self.cfg.cluster.heartbeat_s)
            self._hand_over(rollout_id, moved, live)
            self.counters["retired_workers"] += 1
            return len(moved)
