"""Pieces the five simulated schedules share.

- `generate`: a barrier schedule's batch — groups split into contiguous chunks, one per
  replica (as verl splits a batch across data-parallel rollouts); every replica runs its
  chunk to the end; returns the trajectories with their finish times.
- `train_pipeline`: controller stage then trainer, mini-batch by mini-batch (verl-based).
- `minibatches_by_completion`: a batch as mini-batches of whole groups, in completion order.
- `GroupBuffer`: the experience buffer of the asynchronous schedules — trajectories arrive
  one by one, complete GRPO groups leave FIFO in order of completion.
- `Waker`: keeps one pending clock event per replica (stale ones are ignored by plan id).
- `Intake`: the free-running trainers' intake — a whole global batch, or with
  `stream_minibatches` each mini-batch as soon as its groups are complete.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from laminar.sim.core import Clock, Setup
from laminar.sim.replica import Replica
from laminar.sim.workload import Traj


def generate(replicas: list[Replica], groups: list[list[Traj]], t0: float,
             version: int) -> list[Traj]:
    n, k = len(groups), len(replicas)
    out: list[Traj] = []
    for i, r in enumerate(replicas):
        chunk = [tr for g in groups[i * n // k:(i + 1) * n // k] for tr in g]
        for tr in chunk:
            tr.version, tr.versions = version, 1
        r.version = version
        assert r.is_idle, f"replica {r.rid} still busy at a barrier"
        r.add(t0, chunk)
        while (t := r.next_time()) is not None:
            for tr in r.advance_to(t):
                tr.t_finished = t + tr.env_s  # the reward environment answers after env_s
                out.append(tr)
    return out


def train_pipeline(setup: Setup, parts: list[tuple[float, list[Traj]]], controller_free: float,
                   trainer_free: float, gpus: int | None = None,
                   train_after: float = 0.0) -> tuple[float, float, float]:
    """The verl-based baselines' update: each mini-batch passes the single controller
    (serial, `controller_s_per_token`) and then the trainer; the two stages pipeline.
    parts = [(ready time, trajectories)]: when the controller may start on them. The trainer
    starts no mini-batch before `train_after` (one_step: the whole batch is generated).
    Returns (controller free, trainer free, busy)."""
    busy = setup.update_overhead_s
    trainer_free = max(trainer_free, train_after)
    for ready, part in parts:
        controller_free = max(controller_free, ready) + setup.controller_s_per_token * sum(
            tr.prompt_len + tr.target for tr in part)
        dt = setup.train_time(part, 1, gpus, whole_update=False)
        trainer_free = max(trainer_free, controller_free) + dt
        busy += dt
    return controller_free, trainer_free + setup.update_overhead_s, busy


def minibatches_by_completion(batch: list[Traj], n: int) -> list[tuple[float, list[Traj]]]:
    """Split a batch into n mini-batches of whole groups in the order groups complete;
    each with the time its last group completed (when streaming can train on it)."""
    groups: dict[int, list[Traj]] = {}
    for tr in batch:
        groups.setdefault(tr.group, []).append(tr)
    ordered = sorted(groups.values(), key=lambda g: (max(tr.t_finished for tr in g), g[0].group))
    out = []
    for i in range(n):
        part = ordered[i * len(ordered) // n:(i + 1) * len(ordered) // n]
        if part:
            out.append((max(tr.t_finished for g in part for tr in g), [tr for g in part for tr in g]))
    return out


class GroupBuffer:
    """Finished trajectories by group; `deliver` after the environment's latency."""

    def __init__(self, samples: int, clock: Clock | None = None) -> None:
        self.samples = samples
        self.clock = clock
        self._partial: dict[int, list[Traj]] = {}
        self.complete: deque[list[Traj]] = deque()
        self.in_env: dict[int, Traj] = {}  # finished decoding, waiting on the environment

    def deliver(self, trajs: list[Traj], t: float, then: Callable[[float], None]) -> None:
        """Put trajs at t, or after their environment latency; `then(t)` after each put."""
        for tr in trajs:
            if tr.env_s > 0 and self.clock is not None:
                self.in_env[tr.traj_id] = tr
                self.clock.at(t + tr.env_s, self._env_done, tr, then)
            else:
                tr.t_finished = t
                self.put(tr)
        then(t)

    def _env_done(self, tr: Traj, then: Callable[[float], None]) -> None:
        del self.in_env[tr.traj_id]
        tr.t_finished = self.clock.now  # type: ignore[union-attr]
        self.put(tr)
        then(self.clock.now)  # type: ignore[union-attr]

    def put(self, tr: Traj) -> None:
        members = self._partial.setdefault(tr.group, [])
        members.append(tr)
        if len(members) == self.samples:
            self.complete.append(self._partial.pop(tr.group))

    def take(self, n_groups: int) -> list[Traj] | None:
        if len(self.complete) < n_groups:
            return None
        return [tr for _ in range(n_groups) for tr in self.complete.popleft()]

    def finished(self) -> list[Traj]:
        """Every finished trajectory not yet taken (complete groups and partial ones)."""
        return ([tr for g in self.complete for tr in g]
                + [tr for g in self._partial.values() for tr in g] + list(self.in_env.values()))


class Intake:
    """The free-running trainers' (laminar, partial) intake: a whole global batch per update,
    or with `stream_minibatches` each mini-batch as soon as its groups are complete. `pump`
    starts the next piece when the trainer is free; `on_update(batch, busy)` runs when the
    last piece of an update is trained."""

    def __init__(self, setup: Setup, buffer: GroupBuffer, clock: Clock,
                 on_update: Callable[[list[Traj], float], None]) -> None:
        self.setup, self.buffer, self.clock, self.on_update = setup, buffer, clock, on_update
        self.training = False
        self.taken: list[Traj] = []  # what this update has trained on so far
        self.busy = 0.0

    def pump(self, t: float, not_before: float = 0.0) -> None:
        """Start training the next piece at max(t, not_before) if the trainer is free and the
        buffer can supply it."""
        if self.training:
            return
        setup = self.setup
        if setup.cal.stream_minibatches:
            have = len(self.taken) // setup.samples
            n = min(-(-setup.prompts // setup.minibatches), setup.prompts - have)
            part = self.buffer.take(n)
            if part is None:
                return
            last = have + n >= setup.prompts
            busy = setup.train_time(part, 1, whole_update=last)
        else:
            part = self.buffer.take(setup.prompts)
            if part is None:
                return
            last, busy = True, setup.train_time(part, setup.minibatches)
        self.training = True
        self.clock.at(max(t, not_before) + busy, self._trained, part, last, busy)

    def _trained(self, part: list[Traj], last: bool, busy: float) -> None:
        self.training = False
        self.taken += part
        self.busy += busy
        if not last:  # a streamed mini-batch: the update goes on
            self.pump(self.clock.now)
            return
        batch, busy = self.taken, self.busy
        self.taken, self.busy = [], 0.0
        self.on_update(batch, busy)


class Waker:
    """Schedules `on_event(replica, t)` at each replica's next segment end."""

    def __init__(self, clock: Clock, on_event: Callable[[Replica, float], None]) -> None:
        self.clock = clock
        self.on_event = on_event

    def wake(self, r: Replica) -> None:
        t = r.next_time()
        if t is not None:
            self.clock.at(t, self._fire, r, r.plan_id)

    def _fire(self, r: Replica, plan_id: int) -> None:
        if r.plan_id == plan_id:
            self.on_event(r, self.clock.now)
