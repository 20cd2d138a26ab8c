"""A rollout worker: lease → generate → stream → finish → pull weights.

One engine, one weight version at a time. The worker is a plain class; the runtime makes it a
threaded Ray actor so that the manager's calls (`stats`, `export`, `adopt`) are served while a
schedule's call (`run_free` or `generate_groups`) drives the loop. `self.lock` guards the
engine and the in-flight table.

The loop (`_tick`): one engine step; finished requests are scored and, after the emulated
environment latency, put into the experience buffer (idempotent); every `stream_every` tokens
each trajectory's new tokens go to the partial response pool (one call per
`stream_interval_s` at most), so that a dead or repacked worker loses little.

Schedules drive it two ways:
- `generate_groups(n)`: lease n groups now and return when they are all in the buffer (sync,
  one_step, stream — the global-batch schedules);
- `run_free(policy)`: keep going until `stop()`. When the worker's own batch is done it pulls
  the newest version from its node's relay and leases the next batch (`laminar`); with
  `partial` it keeps its engine topped up with new groups and interrupts everything in flight
  whenever a newer version appears: swap weights, resume with re-prefill (so one trajectory
  mixes versions), as AReaL does.
"""

from __future__ import annotations

import heapq
import os
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from laminar.config import Config
from laminar.engine import build_engine
from laminar.models import load_pretrained
from laminar.models.tokenizer import decode_response
from laminar.pools.partials import TokenUpdate
from laminar.rollout.requests import group_requests, sampling_params
from laminar.tasks import Task
from laminar.tasks.rewards import resolve_reward
from laminar.types import GenerationRequest, PromptGroup, Trajectory


# Ray calls cost CPU in both processes (~0.1-0.5 ms each). The loop batches them: buffer puts
# and their acknowledgements at most every FLUSH_S, a refused lease is asked again after
# LEASE_RETRY_S (admission control), partial-pool updates at most every rollout.stream_interval_s.
FLUSH_S = 0.025
LEASE_RETRY_S = 0.1


@dataclass
class WorkerCounters:
    generated_tokens: int = 0
    finished: int = 0
    batches: int = 0  # lease calls that started new groups
    pulls: int = 0
    pull_s: float = 0.0  # time spent copying new weights in
    busy_s: float = 0.0  # engine steps
    idle_s: float = 0.0  # nothing to decode (waiting for prompts, weights or the environment)
    swaps: int = 0  # partial mode: in-flight interruptions
    reprefill_tokens: int = 0  # partial mode / repack: tokens re-prefilled after a move or swap
    reward_errors: int = 0
    adopted: int = 0  # trajectories received by repack/failover
    exported: int = 0
    versions: list[int] = field(default_factory=list)  # versions loaded, in order


class RolloutWorker:
    def __init__(self, worker_id: str, cfg: Config, model_dir: str, relay: dict[str, Any] | None,
                 pools: dict[str, Any], version: int = 0) -> None:
        from laminar.relay.client import Puller
        from laminar.relay.plan import RelayInfo

        torch.set_num_threads(cfg.rollout.threads)
        if cfg.rollout.cpu_nice:
            os.nice(cfg.rollout.cpu_nice)  # yield the CPU to the trainer (always allowed)
        self.id = worker_id
        self.cfg = cfg
        model, self.tokenizer = load_pretrained(model_dir, cfg.model.attn_implementation)
        seed = zlib.crc32(f"{cfg.trainer.seed}/{worker_id}".encode())  # stable, distinct per worker
        self.engine = build_engine(cfg.rollout.engine, model.eval(), self.tokenizer.eos_token_id,
                                   self.tokenizer.pad_token_id, version, seed)
        self.task = Task(cfg.task.name, [], [], resolve_reward(cfg.task.reward))
        self.puller = Puller(RelayInfo.from_dict(relay), cfg.relay) if relay else None
        if self.puller:
            self.puller.version = version
        self.prompts, self.partials, self.buffer = pools["prompts"], pools["partials"], pools["buffer"]
        self.params = sampling_params(cfg)
        self.lock = threading.Lock()
        self.active: dict[str, tuple[GenerationRequest, PromptGroup]] = {}
        self.token_versions: dict[str, list[int]] = {}
        self.streamed: dict[str, int] = {}
        self.env_wait: list[tuple[float, str, Trajectory]] = []  # heap by ready time
        self.rng = np.random.default_rng(seed)  # the emulated environment's latencies
        self.stop_event = threading.Event()
        self.hold = False  # set by export: do not start a new batch until the manager releases
        self.draining = False  # laminar: a newer version is waiting; finish in-flight work first
        self.manager = None  # set by the runtime: the manager's handle, for repack triggers
        self.counters = WorkerCounters(versions=[version])
        self.last_renew = 0.0
        self.last_stream = 0.0
        self.last_flush = 0.0
        self.next_lease = 0.0
        self.pending_lease = None  # an outstanding lease call (the loop never blocks on it)
        self.leased: list[PromptGroup] = []  # handed out, not started yet (waiting for a pull)
        self.unacked: list[tuple[Any, list[str]]] = []  # buffer puts not yet acknowledged

    # ------------------------------------------------------------------------- schedules

    def generate_groups(self, num_groups: int) -> dict[str, Any]:
        """Lease `num_groups` groups, generate them with the current weights, put them in the
        buffer; returns when all are in (the global-batch schedules)."""
        t0 = time.perf_counter()
        groups = ray.get(self.prompts.lease.remote(self.id, num_groups), timeout=self._timeout)
        self._start(groups)
        while self.has_work and not self.stop_event.is_set():
            self._tick_or_idle()
        return {"worker": self.id, "groups": len(groups), "seconds": time.perf_counter() - t0,
                "version": self.engine.version}

    def run_free(self, policy: str = "laminar") -> dict[str, Any]:
        """Generate until `stop()`, keeping the engine topped up with new groups.
        `laminar`: while no newer version is at the local relay, new groups start with the
        current one; once one is, stop admitting and drain (and tell the manager, which may
        repack the tail onto a peer of the same version), then pull it and fill up again: one
        trajectory, one version. `partial`: the schedule interrupts everyone at each update
        (`interrupt_and_swap`)."""
        self.stop_event.clear()
        while not self.stop_event.is_set():
            if policy == "laminar" and self._newer_version_available():
                if not self.draining:
                    self.draining = True
                    if self.manager is not None:
                        self.manager.on_draining.remote(self.id)  # repack trigger
                if not self.active and not self.hold:
                    with self.lock:
                        if not self.active:  # a repack or failover may have adopted work since
                            self._load_newest()
                            self.draining = False
            if not self.draining and not self.hold:
                self._top_up()
            self._tick_or_idle()
        self._settle()
        return self.snapshot()

    def stop(self) -> None:
        self.stop_event.set()

    # ------------------------------------------------------------------------- weights

    def pull_weights(self, at_least: int | None = None, timeout_s: float | None = None) -> int:
        """Load the newest version at the local relay; with `at_least`, wait until one that new
        has arrived (a global weight sync). Returns the version the engine now holds."""
        with self.lock:
            if at_least is None:
                self._load_newest()
            else:
                self._wait_and_load(at_least, timeout_s or self._timeout)
            return self.engine.version

    def interrupt_and_swap(self, version: int) -> int:
        """Partial rollout's update: abort everything in flight, load `version` from the local
        relay, resume all of it with re-prefill (each token keeps the version that made it).
        Returns the number of tokens re-prefilled."""
        with self.lock:
            states = self.engine.abort(list(self.active))
            self._wait_and_load(version, self._timeout)
            for state in states:
                self.engine.add(state)
        reprefill = sum(state.num_tokens for state in states)
        self.counters.swaps += 1
        self.counters.reprefill_tokens += reprefill
        return reprefill

    def _wait_and_load(self, version: int, timeout_s: float) -> None:
        """Under the lock: wait until `version` (or newer) is at the local relay, load it."""
        deadline = time.monotonic() + timeout_s
        while self.engine.version < version:
            newest = self.puller.newest_version() if self.puller else None
            if newest is not None and newest >= version:
                self._load_newest()
            elif time.monotonic() > deadline:
                raise TimeoutError(f"rollout {self.id}: version {version} did not reach its local "
                                   f"relay within {timeout_s:.0f}s (newest there: {newest}); is "
                                   "the relay chain alive?")
            else:
                time.sleep(0.002)

    def _load_newest(self) -> None:
        """Under the lock: copy the newest version in if it is newer than the engine's."""
        t0 = time.perf_counter()
        version = self.puller.pull_latest(self.engine, newer_than=self.engine.version)
        if version is not None:
            self.counters.pulls += 1
            self.counters.pull_s += time.perf_counter() - t0
            self.counters.versions.append(version)

    # ------------------------------------------------------------------------- manager side

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            stats = self.engine.stats()
            return {"worker": self.id, "version": self.engine.version,
                    "num_reqs": len(self.active),
                    "num_env_wait": len(self.env_wait) + sum(len(ids) for _, ids in self.unacked),
                    "kv_used_tokens": stats.kv_used_tokens,
                    "kv_capacity_tokens": stats.kv_capacity_tokens,
                    "num_running": stats.num_running, "num_waiting": stats.num_waiting,
                    "hold": self.hold, "draining": self.draining, "counters": self.counters.__dict__.copy()}

    def export(self) -> list[tuple[GenerationRequest, PromptGroup]]:
        """Abort everything in flight and hand it over (repack source); the worker then holds
        off its next batch until `release()`."""
        with self.lock:
            states = self.engine.abort(list(self.active))
            moved = [(s, self.active.pop(s.request_id)[1]) for s in states]
            self.draining = False
            for s, _ in moved:
                self.streamed.pop(s.request_id, None)
            self.hold = True
            self.counters.exported += len(moved)
        return moved

    def adopt(self, moved: list[tuple[GenerationRequest, PromptGroup]],
              token_versions: dict[str, list[int]] | None = None) -> bool:
        """Continue trajectories from elsewhere (repack destination, failover). Refuses if any
        was generated with a version other than the one this engine holds."""
        with self.lock:
            if any(s.version not in (-1, self.engine.version) for s, _ in moved):
                return False
            for state, group in moved:
                state.finish_reason = None
                self.engine.add(state)
                self.active[state.request_id] = (state, group)
                self.streamed[state.request_id] = len(state.output_ids)
                self.token_versions[state.request_id] = list(
                    (token_versions or {}).get(state.request_id, [state.version] * len(state.output_ids)))
                self.counters.reprefill_tokens += state.num_tokens
            self.counters.adopted += len(moved)
        return True

    def release(self) -> None:
        self.hold = False

    def set_manager(self, handle: Any) -> None:
        self.manager = handle

    def set_relay(self, relay: dict[str, Any]) -> None:
        """Pull from another relay from now on (this one's died)."""
        from laminar.relay.client import Puller
        from laminar.relay.plan import RelayInfo

        with self.lock:
            puller = Puller(RelayInfo.from_dict(relay), self.cfg.relay)
            puller.version = self.engine.version
            self.puller = puller

    # ------------------------------------------------------------------------- the loop

    @property
    def _timeout(self) -> float:
        return self.cfg.cluster.wait_timeout_s

    def _newer_version_available(self) -> bool:
        if self.puller is None:
            return False
        newest = self.puller.newest_version()  # one small file read
        return newest is not None and newest >= self.engine.version + self.cfg.rollout.version_lag

    def _top_up(self) -> None:
        """Keep `batch_groups` groups in flight: ask the prompt pool for more whenever a group's
        worth of slots is free (without blocking the loop; admission control may say no), and
        start what it handed out unless a newer version is waiting (then after the pull)."""
        if self.pending_lease is not None and ray.wait([self.pending_lease], timeout=0)[0]:
            groups = ray.get(self.pending_lease)
            self.pending_lease = None
            self.leased.extend(groups)
            if not groups:
                self.next_lease = time.monotonic() + LEASE_RETRY_S  # admission control said no
        if self.leased and not self.draining:
            self._start(self.leased)
            self.leased = []
            self.counters.batches += 1
        size = self.cfg.rollout.group_size
        free_groups = (self.cfg.rollout.batch_groups * size - len(self.active)) // size - len(self.leased)
        if free_groups > 0 and self.pending_lease is None and time.monotonic() >= self.next_lease:
            self.pending_lease = self.prompts.lease.remote(self.id, free_groups)

    def _start(self, groups: list[PromptGroup]) -> None:
        registrations = []
        with self.lock:
            for group in groups:
                requests = group_requests(group, self.params)
                registrations.append((group, requests))
                for req in requests:
                    self.engine.add(req)
                    self.active[req.request_id] = (req, group)
                    self.streamed[req.request_id] = 0
                    self.token_versions[req.request_id] = []
        # ordered before this worker's later updates to the same actor
        self.partials.register_many.remote(self.id, registrations)

    def _tick_or_idle(self) -> None:
        if not self._tick():
            self._idle(0.002)

    def _idle(self, seconds: float) -> None:
        time.sleep(seconds)
        self.counters.idle_s += seconds
        self._renew()

    def _renew(self) -> None:
        now = time.monotonic()
        if now - self.last_renew > self.cfg.cluster.heartbeat_s:
            self.prompts.renew.remote(self.id)
            self.last_renew = now

    def _tick(self) -> bool:
        t0 = time.perf_counter()
        finished: list[tuple[GenerationRequest, PromptGroup]] = []
        updates: list[TokenUpdate] = []
        with self.lock:
            deltas = self.engine.step() if self.engine.has_unfinished() else []
            version = self.engine.version
            for d in deltas:
                if d.request_id not in self.active:
                    continue
                self.token_versions[d.request_id].extend([version] * len(d.token_ids))
                if d.finish_reason is not None:
                    finished.append(self.active.pop(d.request_id))
                    self.streamed.pop(d.request_id, None)
            now = time.monotonic()
            if now - self.last_stream >= self.cfg.rollout.stream_interval_s:
                self.last_stream = now
                every = self.cfg.rollout.stream_every
                for rid, (req, _) in self.active.items():
                    sent = self.streamed[rid]
                    if len(req.output_ids) - sent >= every:
                        updates.append(TokenUpdate(rid, req.output_ids[sent:], req.logprobs[sent:],
                                                   version))
                        self.streamed[rid] = len(req.output_ids)
        if deltas:
            self.counters.busy_s += time.perf_counter() - t0
            self.counters.generated_tokens += sum(len(d.token_ids) for d in deltas)
        if updates:
            self.partials.update.remote(self.id, updates)
        for req, group in finished:
            self._finish(req, group)
        flushed = self._flush_env()
        self._renew()
        return bool(deltas) or flushed

    def _finish(self, req: GenerationRequest, group: PromptGroup) -> None:
        scored = self.task.score(group.item, decode_response(self.tokenizer, req.output_ids))
        self.counters.reward_errors += scored.error is not None
        versions = self.token_versions.pop(req.request_id, [])
        mixed = len(set(versions)) > 1
        traj = Trajectory(traj_id=req.request_id, group_id=group.group_id, prompt_ids=req.prompt_ids,
                          response_ids=req.output_ids, logprobs=req.logprobs,
                          version=min(versions) if versions else req.version,
                          reward=scored.reward, exact_match=scored.exact_match,
                          finish_reason=req.finish_reason,
                          token_versions=versions if mixed else None)
        env = self.cfg.rollout.env_latency
        delay = 0.0
        if env.enabled:
            delay = min(env.max_s, env.median_s * float(np.exp(env.sigma * self.rng.standard_normal())))
        heapq.heappush(self.env_wait, (time.monotonic() + delay, traj.traj_id, traj))

    def _flush_env(self, force: bool = False) -> bool:
        """Put trajectories whose environment call is over into the buffer (asynchronously),
        at most every FLUSH_S unless `force`, and acknowledge what the buffer confirmed."""
        now = time.monotonic()
        if now - self.last_flush < FLUSH_S and not force:
            return False
        self.last_flush = now
        ready = []
        while self.env_wait and self.env_wait[0][0] <= now:
            ready.append(heapq.heappop(self.env_wait)[2])
        if ready:
            self.unacked.append((self.buffer.put_many.remote(ready), [t.traj_id for t in ready]))
        return bool(ready) or bool(self._acknowledge())

    def _acknowledge(self) -> list[Any]:
        """For every buffer put that has returned: drop its trajectories from the partial pool
        and close the groups it completed. Returns the refs of those calls."""
        done_ids: list[str] = []
        done_groups: list[str] = []
        while self.unacked and ray.wait([self.unacked[0][0]], timeout=0)[0]:
            ref, ids = self.unacked.pop(0)
            done_groups += ray.get(ref)
            done_ids += ids
        calls = []
        if done_groups:
            calls.append(self.prompts.complete_many.remote(done_groups))
        if done_ids:
            calls.append(self.partials.remove.remote(done_ids))
            self.counters.finished += len(done_ids)
        return calls

    def _settle(self) -> None:
        """Before the loop reports: everything that reached the buffer is acknowledged, and
        those calls have landed (the final accounting reads them)."""
        self._flush_env(force=True)
        if self.unacked:
            ray.wait([ref for ref, _ in self.unacked], num_returns=len(self.unacked),
                     timeout=self._timeout)
        ray.get(self._acknowledge(), timeout=self._timeout)

    @property
    def has_work(self) -> bool:
        """Anything not yet safely in the buffer: decoding, in the environment, or unacked."""
        return bool(self.active or self.env_wait or self.unacked)
