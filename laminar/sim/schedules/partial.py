"""partial (AReaL / Kimi partial rollout): rollouts never wait for a batch, but every weight
update interrupts every in-flight trajectory everywhere, swaps the weights (global sync) and
resumes them with a re-prefill of their context under the new version (mixed versions).

    rollouts: keep `partial_inflight_batches * global batch / replicas` trajectories each
              (max_concurrent_rollouts, at most 1024 per replica); lease groups as they free
    trainer:  512 complete groups (FIFO) -> update -> [interrupt all, sync, re-prefill all]
    admission: lease only while < max_outstanding_batches global batches are leased or
               untrained (AReaL's eta + 1; unbounded by default, as in the paper)
"""

from __future__ import annotations

from laminar.sim.core import Clock, Ledger, Setup, SimResult, finish_result
from laminar.sim.replica import Replica
from laminar.sim.schedules.common import GroupBuffer, Intake, Waker
from laminar.sim.workload import Traj


def run(setup: Setup, warmup: int, measure: int) -> SimResult:
    clock, ledger = Clock(), Ledger()
    replicas, work = setup.make_replicas(), setup.make_workload()
    buffer = GroupBuffer(setup.samples, clock)
    outstanding = setup.cal.max_outstanding_batches * setup.prompts  # in groups
    state = {"version": 0, "leased": 0}
    paused: dict[int, list[Traj]] = {}  # replica id -> trajectories held during a swap
    cap = min(setup.max_running, max(setup.samples, round(
        setup.cal.partial_inflight_batches * setup.global_batch / len(replicas))))

    def top_up(r: Replica, t: float) -> None:
        """Lease groups while the replica has room (and the staleness bound allows)."""
        new: list[Traj] = []
        while r.num_reqs + len(new) + setup.samples <= cap:
            if state["leased"] - state["version"] * setup.prompts >= outstanding:
                break  # admission control: the trainer is too far behind
            for tr in work.groups(1, t)[0]:
                tr.version, tr.versions = r.version, 1
                new.append(tr)
            state["leased"] += 1
        if new:
            collect(r.add(t, new), t)
        waker.wake(r)

    def collect(finished: list[Traj], t: float) -> None:
        buffer.deliver(finished, t, maybe_train)  # after the environment's latency, if any

    def on_replica(r: Replica, t: float) -> None:
        collect(r.advance_to(t), t)
        top_up(r, t)

    def maybe_train(t: float) -> None:
        if ledger.num_updates < warmup + measure:
            intake.pump(t)

    def updated(batch: list[Traj], busy: float) -> None:
        t = clock.now
        ledger.consume(t, batch, state["version"], busy)
        state["version"] += 1
        for r in replicas:  # interrupt everyone: the global point partial rollout keeps
            finished, held = r.abort_all(t)
            collect(finished, t)
            paused[r.rid] = held
            clock.at(t + setup.sync_s, resume, r)
        maybe_train(t)

    def resume(r: Replica) -> None:
        t = clock.now
        r.version = state["version"]
        held = paused.pop(r.rid)
        for tr in held:
            tr.versions += tr.done > 0  # the rest of its tokens come from a new version
            if tr.done == 0:
                tr.version = r.version
        collect(r.add(t, held), t)  # re-prefill of every context happens on admission
        top_up(r, t)

    waker = Waker(clock, on_replica)
    intake = Intake(setup, buffer, clock, updated)
    for r in replicas:
        top_up(r, 0.0)
    clock.run(until=lambda: ledger.num_updates >= warmup + measure)
    held = [tr for trs in paused.values() for tr in trs]
    return finish_result(setup, ledger, replicas, buffer.finished(), warmup, clock.now, held)
