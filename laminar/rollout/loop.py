"""The rollout loop: one engine, its trajectories in flight, and a schedule's policy. No Ray.

    loop = RolloutLoop("rollout0", engine, io, policy, finisher, params, cfg.rollout, heartbeat_s=2)
    while not stopped:
        loop.step() or time.sleep(0.002)

Each `step()`:
1. **decide**: the policy (laminar/modes/<mode>.py) reads a `LoopState` and says how many groups
   to lease, whether leased groups start, whether to pull the newest weights, and whether to
   interrupt in-flight work for them;
2. **admit**: collect the answer of the prompt source (① a lease), start leased groups in the
   engine and register them with the partial response pool;
3. **decode**: one engine step; finished requests go to the `Finisher` (reward, environment;
   a multi-turn episode's turn goes to its environment and, unless the episode ended, comes
   back with the observation appended as the request's next turn);
4. **hand on**: stream new tokens to the partial pool (②, every `rollout.stream_every` tokens,
   at most every `rollout.stream_interval_s`), put trajectories whose environment call is over
   into the experience buffer (③), and, for every put the buffer confirmed, drop those
   trajectories from the partial pool and close the groups they completed.

A schedule's driver makes requests (`request_groups`, `request_version`) that the policy then
acts on; the manager reads `snapshot()` and moves work with `export` / `adopt` / `release`.
The driver also asks for held-out evaluations (`request_eval`, run by the loop's `Evaluator`,
evals.py, one engine step per loop step) and takes what the loop recorded for the run's
metrics (`take_records`: finished evaluations, timeline spans, environment latencies).
Those calls may come from other threads: one lock covers a whole step and each of them.

The engine is a `RolloutEngine` (laminar/engine/protocol.py), used through that protocol only.
Its requests are the loop's record of progress: the loop reads them at any time (streaming) and
writes one only while it is outside the engine — `adopt` (a moved request arrives aborted, or
rebuilt from the partial pool) and a multi-turn episode's next turn (laminar/envs/episode.py:
the observation is appended after the engine finished the turn, before it is added again).
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

from laminar.config import RolloutConfig
from laminar.engine.lora import LoraBase, MergingWeights
from laminar.engine.protocol import RolloutEngine
from laminar.rollout.evals import EvalJob, Evaluator
from laminar.rollout.finish import Finisher
from laminar.rollout.io import RolloutIO, WeightSource
from laminar.rollout.policy import LoopState, Policy
from laminar.rollout.requests import group_requests
from laminar.rollout.timeline import Timeline
from laminar.types import (GenerationRequest, PromptGroup, RolloutCounters, RolloutSnapshot,
                           SamplingParams, TokenDelta, Unfinished)

# Calls to other components cost CPU on both sides (~0.2-0.5 ms each as Ray calls, and the
# pool's work: about 0.85 ms per call in all, measured in a laminar run), so the loop batches
# them: buffer puts and confirmations at most every FLUSH_S while the engine decodes (the
# trainer takes whole groups, so a trajectory put sooner mostly waits for its siblings
# there), every FLUSH_TAIL_S once it decodes nothing (the last trajectories of a batch, which
# a global-batch schedule waits for); a refused lease (admission control) is asked again
# after LEASE_RETRY_S.
FLUSH_S = 0.1
FLUSH_TAIL_S = 0.025
LEASE_RETRY_S = 0.1
IDLE_S = 0.002  # nap when something is pending (a lease, the environment, a confirmation)
IDLE_QUIET_S = 0.01  # nap when nothing is (a request wakes the loop at once)


class RolloutLoop:
    def __init__(self, rollout_id: str, engine: RolloutEngine, io: RolloutIO, policy: Policy,
                 finisher: Finisher, params: SamplingParams, cfg: RolloutConfig,
                 heartbeat_s: float, evaluator: Evaluator | None = None,
                 lora: LoraBase | None = None) -> None:
        """`lora` (trainer.lora): W0 of the adapted layers; every version pulled through
        `io.weights` then loads as W0 + B @ A (laminar/engine/lora.py)."""
        self.id = rollout_id
        self.lora = lora
        if lora is not None:
            io.weights = MergingWeights(io.weights, lora)
        self.evaluator = evaluator
        self.timeline = Timeline()
        self.engine, self.io, self.policy, self.finisher = engine, io, policy, finisher
        self.params, self.cfg, self.heartbeat_s = params, cfg, heartbeat_s
        self.in_flight: dict[str, tuple[GenerationRequest, PromptGroup]] = {}
        self.streamed: dict[str, int] = {}  # trajectory id -> tokens already streamed
        self.started: dict[str, float] = {}  # trajectory id -> wall time of its first admission
        self.leased: list[PromptGroup] = []  # handed out, not started yet
        self.lease_pending = False  # a lease request is out (the loop never blocks on it)
        self.next_lease = 0.0
        self.requested = 0  # groups of requested global batches not leased yet
        self.sync_to: int | None = None  # a version a global weight sync asked for
        self.held = False  # set by export: no admissions until the manager releases
        self.draining = False
        self.newest: int | None = None  # newest version the weight source offered (last step)
        self.counters = RolloutCounters(versions=[engine.version])
        self.lock = threading.Lock()
        self.wake = threading.Event()  # set by every request, so an idle loop reacts at once
        self.last_renew = self.last_stream = self.last_flush = 0.0
        self.tick: Any = None  # called every round of `run` (a laminar.cores.Borrower), or None

    # ------------------------------------------------------------------------- requests

    def request_groups(self, num_groups: int) -> None:
        """A global batch's share: lease and generate `num_groups` more groups."""
        with self.lock:
            self.requested += num_groups
        self.wake.set()

    def request_version(self, version: int) -> None:
        """A global weight sync: get to `version` (what happens to in-flight work is the
        policy's answer)."""
        with self.lock:
            self.sync_to = max(version, self.sync_to or version)
        self.wake.set()

    def request_eval(self, job: EvalJob) -> None:
        """A held-out evaluation on weights `job.at_least` or newer (needs an evaluator)."""
        if self.evaluator is None:
            raise RuntimeError(f"rollout {self.id} has no evaluator; build the loop with one")
        with self.lock:
            self.evaluator.queue(job)
        self.wake.set()

    def take_records(self, close: bool = False) -> dict[str, Any]:
        """What happened since the last call, for the run's metrics: finished evaluations,
        timeline spans (`close`: the open one too) and emulated environment latencies."""
        with self.lock:
            return {"evals": self.evaluator.take() if self.evaluator else [],
                    "spans": self.timeline.take(close), "env_latency_s": self.finisher.take_delays(),
                    "turns": self.finisher.take_turns()}

    def holds_version(self, version: int) -> bool:
        return self.engine.version >= version

    @property
    def batch_done(self) -> bool:
        """Every requested group leased, generated and confirmed by the buffer."""
        return not (self.requested or self.leased or self.lease_pending or self.has_work)

    @property
    def has_work(self) -> bool:
        """Anything not yet safely in the buffer: decoding, in the environment, or unconfirmed."""
        return bool(self.in_flight or len(self.finisher) or self.io.buffer.num_unconfirmed)

    # ------------------------------------------------------------------------- the step

    def step(self) -> bool:
        """One round of decide, admit, decode, hand on; False when there was nothing to do."""
        if self.evaluator is not None:  # its engine takes seconds to build: not under the lock,
            self.evaluator.prepare()  # which the manager's health checks (snapshot) wait for
        with self.lock:
            self._collect_lease()
            self._decide()
            decoded = self._decode()
            evaluated = self.evaluator.step(self.io.weights) if self.evaluator and self.evaluator.pending else False
            handed = self._hand_on()
            if self.engine.has_unfinished():
                self.timeline.mark("generate", self.engine.version)
            else:
                busy = evaluated or (self.evaluator is not None and self.evaluator.job is not None)
                self.timeline.mark("eval" if busy else "idle", self.engine.version)
        return decoded or handed or evaluated

    def run(self, stop: threading.Event) -> None:
        """Step until `stop` is set, napping when idle; then settle."""
        while not stop.is_set():
            if self.tick is not None:
                self.tick.poll()
            if self.step():
                continue
            t0 = time.perf_counter()
            self.wake.wait(IDLE_S if self.has_work or self.lease_pending else IDLE_QUIET_S)
            self.wake.clear()
            napped = time.perf_counter() - t0
            self.counters.idle_s += napped
            if self.draining:
                self.counters.drain_idle_s += napped
        self.settle(timeout_s=60.0)

    @property
    def num_active(self) -> int:
        """Trajectories started and not finished: decoding, or mid-episode in the environment."""
        episodes = self.finisher.episodes
        return len(self.in_flight) + (episodes.num_outside_engine if episodes is not None else 0)

    def _decide(self) -> None:
        version = self.engine.version
        self.newest = self.io.weights.newest()
        if self.sync_to is not None and self.sync_to <= version:
            self.sync_to = None
        size = self.cfg.group_size
        active = self.num_active
        # rollout.batch_groups bounds the work this engine generates: an episode waiting on its
        # tool does not count, as a one-turn trajectory waiting on its reward does not (the
        # prompt pool's admission control bounds them all); it still holds the weights (pull)
        episodes = self.finisher.episodes
        generating = active - (episodes.num_waiting if episodes is not None else 0)
        free = (self.cfg.batch_groups * size - generating) // size - len(self.leased)
        decision = self.policy.decide(LoopState(
            version=version, newest=self.newest, sync_to=self.sync_to,
            num_in_flight=active, num_leased=len(self.leased),
            num_requested=self.requested, free_groups=max(0, free), held=self.held))
        self.draining = decision.draining
        if decision.interrupt:
            self._interrupt()
        elif decision.pull and not active:  # the evaluator's engine is its own; an episode
            self._load_newest()  # in its environment keeps the weights of its first turn
        if decision.start and self.leased:
            self._start(self.leased)
            self.leased = []
        for req, group in self.finisher.next_turns():  # episodes' next turns (or first, after reset)
            self._add(req, group)
        if decision.lease > 0 and not self.lease_pending and time.monotonic() >= self.next_lease:
            self.io.prompts.request(self.id, decision.lease)
            self.lease_pending = True

    def _collect_lease(self) -> None:
        if not self.lease_pending:
            return
        groups = self.io.prompts.poll()
        if groups is None:
            return
        self.lease_pending = False
        self.leased.extend(groups)
        self.requested = max(0, self.requested - len(groups))
        if not groups:
            self.next_lease = time.monotonic() + LEASE_RETRY_S  # admission control said no

    def _start(self, groups: list[PromptGroup]) -> None:
        registrations = []
        for group in groups:
            requests = group_requests(group, self.params)
            registrations.append((group, requests))
            for req in requests:
                self.started[req.request_id] = time.time()
                if self.finisher.begin(req, group):  # else its episode's reset runs first
                    self._add(req, group)
        self.io.partials.register(self.id, registrations)
        self.counters.batches += 1

    def _add(self, req: GenerationRequest, group: PromptGroup) -> None:
        self.engine.add(req)
        self.in_flight[req.request_id] = (req, group)
        self.streamed[req.request_id] = len(req.output_ids)

    def _decode(self) -> bool:
        if not self.engine.has_unfinished():
            return False
        t0 = time.perf_counter()
        deltas = self.engine.step()
        for d in deltas:
            if d.finish_reason is not None and d.request_id in self.in_flight:
                self.streamed.pop(d.request_id, None)
                self._time(d.request_id)
                self.finisher.add(*self.in_flight.pop(d.request_id))
        if deltas:
            self.counters.busy_s += time.perf_counter() - t0
            self.counters.generated_tokens += sum(len(d.token_ids) for d in deltas)
        self.counters.reprefill_tokens = self.engine.num_reprefill_tokens  # moves and swaps
        self.counters.reprefill_s = self.engine.reprefill_s
        return bool(deltas)

    def _time(self, rid: str) -> None:
        """Its latency, once its generation is over (a multi-turn episode: its first turn)."""
        started = self.started.pop(rid, None)
        if started is not None:
            latency = time.time() - started
            self.counters.traj_timed += 1
            self.counters.traj_latency_sum_s += latency
            self.counters.traj_latency_max_s = max(self.counters.traj_latency_max_s, latency)

    def _hand_on(self, force: bool = False) -> bool:
        now = time.monotonic()
        if now - self.last_stream >= self.cfg.stream_interval_s:
            self.last_stream = now
            self._stream()
        if now - self.last_renew > self.heartbeat_s:
            self.last_renew = now
            self.io.prompts.renew(self.id)
        if not force and now - self.last_flush < (FLUSH_S if self.in_flight else FLUSH_TAIL_S):
            return False
        self.last_flush = now
        ready = self.finisher.ready()
        if ready:
            self.io.buffer.put(ready)
        landed = self.io.buffer.landed()
        for traj_ids, completed in landed:
            self.io.partials.remove(traj_ids)
            if completed:
                self.io.prompts.complete(completed)
            self.counters.finished += len(traj_ids)
        return bool(ready or landed)

    def _stream(self) -> None:
        if self.finisher.episodes is not None:
            return  # an episode's tokens are useless without its environment's state, which
            # dies with this process: a multi-turn trajectory restarts from its prompt instead
        every, updates = self.cfg.stream_every, []
        for rid, (req, _) in self.in_flight.items():
            sent = self.streamed[rid]
            if len(req.output_ids) - sent >= every:
                updates.append(TokenDelta(rid, req.output_ids[sent:], req.logprobs[sent:],
                                          token_versions=req.token_versions[sent:]))
                self.streamed[rid] = len(req.output_ids)
        if updates:
            self.io.partials.update(self.id, updates)

    def settle(self, timeout_s: float) -> None:
        """Put what is ready, wait for the buffer to confirm every put, process confirmations
        (the final accounting reads them)."""
        with self.lock:
            self._hand_on(force=True)
            self.io.buffer.settle(timeout_s)
            self._hand_on(force=True)

    # ------------------------------------------------------------------------- weights

    def _load_newest(self) -> int | None:
        t0, wall = time.perf_counter(), time.time()
        version = self.io.weights.load_newest(self.engine, newer_than=self.engine.version)
        if version is not None:
            self.timeline.add("pull", wall, time.time(), version)
            self.counters.pulls += 1
            self.counters.pull_s += time.perf_counter() - t0
            self.counters.versions.append(version)
        return version

    def _interrupt(self) -> None:
        """Abort everything in flight, load the newest weights, resume it all with re-prefill
        (each token keeps the version that made it)."""
        states = self.engine.abort(list(self.in_flight))
        self._load_newest()
        for state in states:
            self.engine.add(state)
        self.counters.swaps += 1

    def set_weights(self, weights: WeightSource) -> None:
        """Read weights from another source from now on (its relay died)."""
        with self.lock:
            self.io.weights = weights if self.lora is None else MergingWeights(weights, self.lora)

    # ------------------------------------------------------------------------- the manager's side

    def snapshot(self) -> RolloutSnapshot:
        with self.lock:
            stats = self.engine.stats()
            c = self.counters
            c.spec_drafted_tokens, c.spec_accepted_tokens = (stats.num_drafted_tokens,
                                                             stats.num_accepted_tokens)
            c.spec_steps = stats.num_spec_steps
            c.prefix_lookups, c.prefix_hits = stats.num_prefix_lookups, stats.num_prefix_hits
            self.counters.reward_errors = self.finisher.reward_errors
            self.counters.failed_by_reason = dict(self.finisher.failed_by_reason)
            if self.finisher.episodes is not None:
                self.counters.tool_calls = dict(self.finisher.episodes.tool_calls)
            return RolloutSnapshot(
                rollout_id=self.id, version=self.engine.version, num_in_flight=len(self.in_flight),
                num_unsettled=len(self.finisher) + self.io.buffer.num_unconfirmed,
                num_running=stats.num_running, num_waiting=stats.num_waiting,
                kv_used_tokens=stats.kv_used_tokens, kv_capacity_tokens=stats.kv_capacity_tokens,
                held=self.held, draining=self.draining, counters=copy.deepcopy(self.counters),
                newest=self.newest)

    def export(self) -> list[Unfinished]:
        """Abort everything in flight and hand it over (a repack source, a retiring rollout);
        admissions are held until `release()`."""
        with self.lock:
            ids, episodes = list(self.in_flight), {}
            if self.finisher.episodes is not None:  # an episode leaves with its environment;
                for rid in ids:  # one whose environment cannot be pickled stays
                    episodes[rid] = self.finisher.episodes.detach(rid)
                ids = [rid for rid in ids if episodes[rid] is not None]
            states = self.engine.abort(ids)
            moved = [Unfinished(s, self.in_flight.pop(s.request_id)[1], episodes.get(s.request_id),
                                self.started.pop(s.request_id, None)) for s in states]
            for m in moved:
                self.streamed.pop(m.request.request_id, None)
            self.held, self.draining = True, False
            self.counters.exported += len(moved)
            return moved

    def adopt(self, moved: list[Unfinished]) -> bool:
        """Continue trajectories from elsewhere (repack destination, failover). Unless the
        policy mixes versions, refuses if any was started by weights other than this engine's.
        The requests are in no engine (aborted at their source, or rebuilt from the partial
        pool), so they may be written here before `_add` hands them to this one."""
        with self.lock:
            version = self.engine.version
            if not self.policy.mixes_versions and any(
                    m.request.version not in (None, version) for m in moved):
                return False
            episodes = self.finisher.episodes
            for m in moved:
                req = m.request
                req.finish_reason = None
                if m.started_at is not None:
                    self.started[req.request_id] = m.started_at
                if episodes is not None and m.episode is not None:
                    episodes.attach(m.episode)  # mid-episode, with its environment
                elif episodes is not None:  # from the partial pool: its environment is gone,
                    req.output_ids, req.logprobs, req.token_versions = [], [], []  # restart it
                    req.version = None
                    self.finisher.begin(req, m.group)
                    continue
                self._add(req, m.group)  # re-prefilled at its admission (engine counters)
            self.counters.adopted += len(moved)
        self.wake.set()
        return True

    def release(self) -> None:
        with self.lock:
            self.held = False
        self.wake.set()
