"""The rollout manager: heartbeats, dynamic repack, failover.

Every `manager.interval_s` it gathers each rollout's snapshot (weight version, KV tokens used
and capacity, unfinished trajectories) and:
- **elasticity**: `add_worker` lets a rollout join a running job; `retire` lets one leave
  (its in-flight trajectories move to peers of the same version first);
- **failover**: a rollout that does not answer within `cluster.heartbeat_s` x 3, or whose actor
  died, is declared dead and killed; its unfinished trajectories (from the partial response
  pool) continue on a live rollout of the same weight version (restarted from scratch if none
  holds that version, so a trajectory never mixes versions); its untouched leases go back to
  the prompt pool;
- **repack** (laminar mode): a rollout that saw a newer version stops admitting and drains:
  its KV utilisation ramps down. `plan_repack` (Algorithm 1, pure) picks sources among those
  and the densest destination of the same version; each move is export (abort, the
  source holds) → adopt (the destination re-prefills prompt + prefix) → partial pool reassign →
  release (the source, now empty, pulls the newest weights and leases its next batch).

A plain class; the runtime makes it a threaded Ray actor.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray

from laminar.config import Config
from laminar.manager.repack import RolloutLoad, plan_repack

log = logging.getLogger("laminar.manager")


class RolloutManager:
    def __init__(self, cfg: Config, workers: dict[str, Any], pools: dict[str, Any]) -> None:
        self.cfg = cfg
        self.workers = dict(workers)
        self.prompts, self.partials, self.buffer = pools["prompts"], pools["partials"], pools["buffer"]
        self.stop_event = threading.Event()
        self.trigger = threading.Event()
        self.lock = threading.Lock()
        self.counters = {"checks": 0, "repacks": 0, "moved_trajectories": 0, "repack_s": 0.0,
                         "refused_moves": 0, "dead_workers": 0, "failover_trajectories": 0,
                         "restarted_trajectories": 0, "returned_groups": 0,
                         "retired_workers": 0}
        self.dead: list[str] = []

    def run(self, repack: bool) -> dict[str, Any]:
        """Check every `manager.interval_s`, and at once when a rollout starts draining."""
        self.stop_event.clear()
        while not self.stop_event.is_set():
            self.trigger.wait(self.cfg.manager.interval_s)
            self.trigger.clear()
            if not self.stop_event.is_set():
                self.check_once(repack)
        return self.counters

    def on_draining(self, worker_id: str) -> None:
        """A rollout saw a newer version and stopped admitting: its ramp-down has begun (the
        paper's second trigger: right after a weight update)."""
        self.trigger.set()

    def stop(self) -> None:
        self.stop_event.set()
        self.trigger.set()

    def add_worker(self, worker_id: str, handle: Any) -> None:
        """Elasticity: a rollout joining a running job."""
        with self.lock:
            self.workers[worker_id] = handle

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "dead": list(self.dead), "workers": sorted(self.workers)}

    # ------------------------------------------------------------------------- one check

    def check_once(self, repack: bool) -> dict[str, dict[str, Any]]:
        with self.lock:
            snapshots = self._gather()
            self.counters["checks"] += 1
            if repack and len(snapshots) > 1:
                self._repack(snapshots)
            return snapshots

    def _gather(self) -> dict[str, dict[str, Any]]:
        ids = list(self.workers)
        refs = [self.workers[i].snapshot.remote() for i in ids]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=3 * self.cfg.cluster.heartbeat_s)
        snapshots, dead = {}, []
        for wid, ref in zip(ids, refs):
            try:
                if ref not in ready:
                    raise TimeoutError("no answer to the health check")
                snapshots[wid] = ray.get(ref)
            except Exception as e:  # the actor died or hangs: both mean failover
                log.warning("rollout %s is dead (%s); failing over", wid, e)
                dead.append(wid)
        for wid in dead:
            self._failover(wid, snapshots)
        return snapshots

    # ------------------------------------------------------------------------- repack

    def _repack(self, snapshots: dict[str, dict[str, Any]]) -> None:
        loads = []
        for wid, s in snapshots.items():
            if s["hold"] or not s["draining"] or s["num_waiting"]:
                continue  # only a rollout that stopped admitting is in its ramp-down (Fig. 9)
            # Line 3's C_used < C_prev asks "is it in ramp-down?": a draining rollout admits
            # nothing, so it is by construction (its few tails may still grow a little), and
            # its capacity stands in for C_prev
            loads.append(RolloutLoad(wid, s["version"], s["kv_used_tokens"],
                                     s["kv_capacity_tokens"], s["kv_capacity_tokens"], s["num_reqs"]))
        for source, dest in plan_repack(loads, self.cfg.manager.c_max, self.cfg.manager.batch_bound):
            self._move(source, dest)

    def _move(self, source: str, dest: str) -> None:
        t0 = time.perf_counter()
        src, dst = self.workers[source], self.workers[dest]
        moved = ray.get(src.export.remote())
        try:
            if not moved:
                return
            if not ray.get(dst.adopt.remote(moved)):
                # the destination changed version meanwhile: give the work back (same version)
                ray.get(src.adopt.remote(moved))
                self.counters["refused_moves"] += 1
                return
            ray.get(self.partials.reassign.remote([s.request_id for s, _ in moved], dest,
                                                  [s for s, _ in moved]))
            self.counters["repacks"] += 1
            self.counters["moved_trajectories"] += len(moved)
        finally:
            ray.get(src.release.remote())
            self.counters["repack_s"] += time.perf_counter() - t0

    # ------------------------------------------------------------------------- failover

    def _failover(self, dead_id: str, live: dict[str, dict[str, Any]]) -> None:
        handle = self.workers.pop(dead_id)
        self.dead.append(dead_id)
        self.counters["dead_workers"] += 1
        try:
            ray.kill(handle, no_restart=True)  # a hung worker must not write results later
        except Exception:
            pass
        entries = ray.get(self.partials.owned_by.remote(dead_id))
        self._hand_over(dead_id, [(e.request, e.group, e.token_versions) for e in entries], live)
        self.counters["failover_trajectories"] += len(entries)

    def retire(self, worker_id: str) -> int:
        """Elasticity: a rollout leaves a running job. Its in-flight trajectories move to peers
        of the same version; it finishes its environment calls, then stops. Returns how many
        trajectories moved."""
        with self.lock:
            handle = self.workers[worker_id]
            moved = ray.get(handle.export.remote())  # holds: no new admissions
            deadline = time.monotonic() + self.cfg.cluster.wait_timeout_s
            while ray.get(handle.snapshot.remote())["num_env_wait"] and time.monotonic() < deadline:
                time.sleep(0.05)
            ray.get(handle.stop.remote())
            del self.workers[worker_id]
            live = {w: ray.get(h.snapshot.remote()) for w, h in self.workers.items()}
            self._hand_over(worker_id, [(s, g, None) for s, g in moved], live)
            self.counters["retired_workers"] += 1
            return len(moved)

    def _hand_over(self, owner: str, entries: list[tuple[Any, Any, list[int] | None]],
                   live: dict[str, dict[str, Any]]) -> None:
        """Continue `owner`'s unfinished trajectories on live rollouts of the same version
        (restarted from scratch where none holds it: a trajectory never mixes versions); its
        untouched leases go back to the prompt pool."""
        pending = list(entries)
        for _ in range(3):  # a destination may change version between snapshot and adopt
            by_dest: dict[str, list] = {}
            for state, group, token_versions in pending:
                dest = next((w for w, s in live.items() if s["version"] == state.version), None)
                if dest is None and state.version != -1:
                    state.output_ids, state.logprobs, state.version = [], [], -1
                    token_versions = []
                    self.counters["restarted_trajectories"] += 1
                dest = dest or next(iter(live), None)
                if dest is not None:
                    by_dest.setdefault(dest, []).append((state, group, token_versions))
            pending = []
            for dest, group in by_dest.items():
                moved = [(state, g) for state, g, _ in group]
                versions = {state.request_id: tv for state, _, tv in group if tv}
                if ray.get(self.workers[dest].adopt.remote(moved, versions)):
                    ray.get(self.partials.reassign.remote([state.request_id for state, _ in moved],
                                                          dest, [state for state, _ in moved]))
                else:
                    pending += group
            if not pending:
                break
            live = {w: ray.get(h.snapshot.remote()) for w, h in self.workers.items()}
        keep = ray.get(self.partials.group_ids.remote()) | ray.get(self.buffer.group_ids.remote())
        returned = ray.get(self.prompts.release_owner.remote(owner, keep))
        self.counters["returned_groups"] += len(returned)
