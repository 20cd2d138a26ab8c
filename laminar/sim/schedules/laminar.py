"""laminar: trajectory-level asynchrony. Nobody waits for a batch.

    rollout r:  lease a batch -> generate (one version) -> batch done or released by repack
                -> pull the newest version from its local relay -> lease the next batch
    trainer:    512 complete groups (FIFO) -> update -> push to the master relay (short
                stall) -> relays broadcast down the chain in the background
    manager:    every 5 s and after each update, Algorithm 1 (laminar.manager.repack) moves
                the unfinished trajectories of ramp-down rollouts to others of the same version

A rollout leases `inflight_batches * global batch / replicas` trajectories at a time (whole
groups, at most 1024), so about one global batch is in flight.
"""

from __future__ import annotations

from laminar.manager.repack import RolloutLoad, plan_repack
from laminar.sim import costs
from laminar.sim.core import Clock, Ledger, Setup, SimResult, finish_result
from laminar.sim.replica import Replica
from laminar.sim.schedules.common import GroupBuffer, Waker
from laminar.sim.workload import Traj


def run(setup: Setup, warmup: int, measure: int, repack: bool = True) -> SimResult:
    clock, ledger = Clock(), Ledger()
    replicas, work = setup.make_replicas(), setup.make_workload()
    buffer = GroupBuffer(setup.samples)
    cal = setup.cal
    lease_groups = max(1, min(setup.max_running // setup.samples,
                              round(cal.inflight_batches * setup.prompts / len(replicas))))
    bound = costs.roofline_batch(setup.curve, 4096, cal.roofline_factor)
    state = {"version": 0, "at_relays": 0, "training": False, "trainer_free": 0.0}
    kv_prev = {r.rid: 0 for r in replicas}
    pulling: set[int] = set()

    def lease(r: Replica, t: float) -> None:
        kv_prev[r.rid] = 0  # a fresh batch ramps up; only a fall from here is ramp-down
        trajs = [tr for g in work.groups(lease_groups, t) for tr in g]
        for tr in trajs:
            tr.version, tr.versions = r.version, 1
        collect(r.add(t, trajs), t)
        waker.wake(r)

    def batch_done(r: Replica, t: float) -> None:
        """Pull the newest complete version if there is one, then lease new work."""
        if state["at_relays"] > r.version:
            pulling.add(r.rid)
            clock.at(t + setup.pull_s, pulled, r, state["at_relays"])
        else:
            lease(r, t)

    def pulled(r: Replica, version: int) -> None:
        pulling.discard(r.rid)
        r.version = version
        lease(r, clock.now)

    def collect(finished: list[Traj], t: float) -> None:
        for tr in finished:
            tr.t_finished = t
            buffer.put(tr)
        maybe_train(t)

    def on_replica(r: Replica, t: float) -> None:
        collect(r.advance_to(t), t)
        if r.is_idle:
            batch_done(r, t)
        else:
            waker.wake(r)

    def maybe_train(t: float) -> None:
        if state["training"] or ledger.num_updates >= warmup + measure:
            return
        batch = buffer.take(setup.prompts)
        if batch is None:
            return
        state["training"] = True
        start = max(t, state["trainer_free"])
        busy = setup.train_time(batch, setup.minibatches)
        clock.at(start + busy, updated, batch, busy)

    def updated(batch: list[Traj], busy: float) -> None:
        t = clock.now
        ledger.consume(t, batch, state["version"], busy)
        state["version"] += 1
        state["training"] = False
        state["trainer_free"] = t + setup.push_s  # stall while handing off to the master
        clock.at(t + setup.push_s + setup.broadcast_s, published, state["version"])
        if repack:
            check(t)
        maybe_train(t)

    def published(version: int) -> None:
        state["at_relays"] = max(state["at_relays"], version)

    def check(t: float) -> None:
        loads = []
        for r in replicas:
            if r.rid in pulling or r.is_idle:
                continue
            kv, prev = r.kv_at(t), kv_prev[r.rid]
            kv_prev[r.rid] = kv
            if kv < prev and 0 < r.num_reqs < bound:  # Algorithm 1 filters again; this is speed
                loads.append(RolloutLoad(str(r.rid), r.version, kv, prev, r.kv_capacity,
                                         r.num_reqs))
        if len(loads) < 2:
            return
        for src, dst in plan_repack(loads, cal.repack_c_max, bound):
            s, d = replicas[int(src)], replicas[int(dst)]
            finished, moved = s.abort_all(t)
            collect(finished, t)
            collect(d.add(t, moved), t)  # re-prefilled on the destination
            waker.wake(d)
            ledger.repacks += 1
            ledger.moved_trajs += len(moved)
            batch_done(s, t)

    def periodic() -> None:
        check(clock.now)
        if ledger.num_updates < warmup + measure:
            clock.at(clock.now + cal.repack_check_s, periodic)

    waker = Waker(clock, on_replica)
    for r in replicas:
        lease(r, 0.0)
    if repack:
        clock.at(cal.repack_check_s, periodic)
    clock.run(until=lambda: ledger.num_updates >= warmup + measure)
    return finish_result(setup, ledger, replicas, buffer.finished(), warmup, clock.now)
