"""laminar: trajectory-level asynchrony. Nobody waits for a batch.

    rollout r:  top up to its lease cap with groups of its current version; once a version
                `version_lag` updates newer is at its relay, stop admitting and drain (repack
                may take the tail), then pull the newest version and top up again — one
                trajectory, one version
    trainer:    512 complete groups (first in, first out; with stream_minibatches, each
                mini-batch as it completes) -> update -> push to the master
                relay (a short stall) -> relays broadcast down the chain in the background
    manager:    every 5 s and after each update, Algorithm 1 (laminar.manager.repack) moves
                the unfinished trajectories of ramp-down rollouts to others of the same version

This is the policy of the runtime's laminar rollouts (`Laminar` in `laminar/modes/laminar.py`).
A rollout's lease cap is `inflight_batches * global batch / replicas` trajectories (whole
groups, at most 1024; the runtime's `rollout.batch_groups`), and all rollouts together lease
only while fewer than `max_outstanding_batches` global batches are leased or untrained.
"""

from __future__ import annotations

from laminar.manager.repack import RolloutLoad, plan_repack
from laminar.sim import costs
from laminar.sim.core import Clock, Ledger, Setup, SimResult, finish_result
from laminar.sim.replica import Replica
from laminar.sim.schedules.common import GroupBuffer, Intake, Waker
from laminar.sim.workload import Traj


def run(setup: Setup, warmup: int, measure: int, repack: bool = True) -> SimResult:
    clock, ledger = Clock(), Ledger()
    replicas, work = setup.make_replicas(), setup.make_workload()
    buffer = GroupBuffer(setup.samples, clock)
    cal = setup.cal
    cap = setup.samples * max(1, min(setup.max_running // setup.samples, round(
        cal.inflight_batches * setup.prompts / len(replicas))))
    bound = costs.roofline_batch(setup.curve, 4096, cal.roofline_factor)
    outstanding = cal.max_outstanding_batches * setup.prompts  # in groups
    state = {"version": 0, "at_relays": 0, "trainer_free": 0.0, "leased": 0}
    kv_prev = {r.rid: 0 for r in replicas}
    pulling: set[int] = set()

    def draining(r: Replica) -> bool:
        return state["at_relays"] >= r.version + cal.version_lag

    def top_up(r: Replica, t: float) -> None:
        """Lease whole groups of r's version while there is room and no newer version."""
        if r.rid in pulling:
            return
        if draining(r):
            if r.is_idle:  # drained: pull the newest version, then fill up again
                pulling.add(r.rid)
                clock.at(t + setup.pull_s, pulled, r, state["at_relays"])
            else:
                waker.wake(r)
            return
        free = (cap - r.num_reqs) // setup.samples
        # Admission control: at most `outstanding` groups leased or untrained.
        free = int(min(free, outstanding - (state["leased"] - state["version"] * setup.prompts)))
        if free > 0:
            state["leased"] += free
            if r.is_idle:
                kv_prev[r.rid] = 0  # a fresh fill ramps up; only a fall from here is ramp-down
            trajs = [tr for g in work.groups(free, t) for tr in g]
            for tr in trajs:
                tr.version, tr.versions = r.version, 1
            collect(r.add(t, trajs), t)
        waker.wake(r)

    def pulled(r: Replica, version: int) -> None:
        pulling.discard(r.rid)
        r.version = version
        top_up(r, clock.now)

    def collect(finished: list[Traj], t: float) -> None:
        buffer.deliver(finished, t, maybe_train)  # after the environment's latency, if any

    def on_replica(r: Replica, t: float) -> None:
        collect(r.advance_to(t), t)
        top_up(r, t)

    def maybe_train(t: float) -> None:
        if ledger.num_updates < warmup + measure:
            intake.pump(t, state["trainer_free"])

    def updated(batch: list[Traj], busy: float) -> None:
        t = clock.now
        ledger.consume(t, batch, state["version"], busy)
        state["version"] += 1
        state["trainer_free"] = t + setup.push_s  # stall while handing off to the master
        clock.at(t + setup.push_s + setup.broadcast_s, published, state["version"])
        if outstanding != float("inf"):
            for r in replicas:  # the trainer caught up by a batch: admission may reopen
                top_up(r, t)
        maybe_train(t)

    def published(version: int) -> None:
        state["at_relays"] = max(state["at_relays"], version)
        for r in replicas:  # every rollout notices at its next tick: stop admitting, drain
            top_up(r, clock.now)
        if repack:
            check(clock.now)  # §5.1: repack right after an update frees rollouts sooner

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
            top_up(s, t)  # released: pulls if a newer version is out, else fills up again

    def periodic() -> None:
        check(clock.now)
        if ledger.num_updates >= warmup + measure:
            return
        # Alive while anything can still make progress: a rollout decoding, one pulling, the
        # trainer, or finished trajectories still in the reward environment (they complete
        # groups when they come back, which then lets the trainer and admission go on).
        if not (intake.training or pulling or buffer.in_env
                or any(not r.is_idle for r in replicas)):
            raise RuntimeError(f"laminar simulation stalled at t={clock.now:.1f}s: no rollout "
                               "busy, none pulling, none in the environment and the trainer "
                               "idle")
        clock.at(clock.now + cal.repack_check_s, periodic)

    waker = Waker(clock, on_replica)
    intake = Intake(setup, buffer, clock, updated)
    for r in replicas:
        top_up(r, 0.0)
    if repack:
        clock.at(cal.repack_check_s, periodic)
    clock.run(until=lambda: ledger.num_updates >= warmup + measure)
    return finish_result(setup, ledger, replicas, buffer.finished(), warmup, clock.now)
