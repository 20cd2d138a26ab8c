"""The rollout as a Ray actor: a shell around `RolloutLoop`, and the Ray-backed doors it uses.

`RolloutActor` builds the engine, the loop and its doors, runs the loop in a thread of its own
from `start()` to `stop()`, and turns the drivers' and the manager's calls into requests to the
loop. The runtime (laminar/runtime/cluster.py) makes it a threaded actor, so those calls are
served while the loop runs. It holds no handle of the manager: the manager asks, it answers.

The doors (`RayPrompts`, `RayPartials`, `RayBuffer`) call the pool actors without blocking the
loop: a lease or a put is an object ref the loop looks at later; partial-pool updates are
fire-and-forget (Ray keeps one caller's calls to one actor in order).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import ray
import torch

from laminar.actor import materialize
from laminar.config import Config
from laminar.devices import borrower, pin_cpus, rollout_index, yield_cpu
from laminar.envs.openai_server import serve_rollout
from laminar.models import load_pretrained
from laminar.rollout.build import build_rollout
from laminar.rollout.evals import EvalJob
from laminar.rollout.io import Registration, RelayWeights, RolloutIO
from laminar.rollout.policy import Policy
from laminar.tasks import build_task
from laminar.types import PromptGroup, RolloutSnapshot, TokenDelta, Trajectory, Unfinished


class RayPrompts:
    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.ref: Any = None

    def request(self, owner: str, num_groups: int) -> None:
        self.ref = self.pool.lease.remote(owner, num_groups)

    def poll(self) -> list[PromptGroup] | None:
        if self.ref is None or not ray.wait([self.ref], timeout=0)[0]:
            return None
        ref, self.ref = self.ref, None
        return ray.get(ref)

    def renew(self, owner: str) -> None:
        self.pool.renew.remote(owner)

    def complete(self, group_ids: list[str]) -> None:
        self.pool.complete_many.remote(group_ids)


class RayPartials:
    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def register(self, owner: str, registrations: list[Registration]) -> None:
        self.pool.register_many.remote(owner, registrations)

    def update(self, owner: str, updates: list[TokenDelta]) -> None:
        self.pool.update.remote(owner, updates)

    def remove(self, traj_ids: list[str]) -> None:
        self.pool.remove.remote(traj_ids)


class RayBuffer:
    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self.pending: list[tuple[Any, list[str]]] = []  # (put ref, its trajectory ids), in order

    def put(self, trajs: list[Trajectory]) -> None:
        self.pending.append((self.buffer.put_many.remote(trajs), [t.traj_id for t in trajs]))

    def landed(self) -> list[tuple[list[str], list[str]]]:
        out = []
        while self.pending and ray.wait([self.pending[0][0]], timeout=0)[0]:
            ref, ids = self.pending.pop(0)
            out.append((ids, ray.get(ref)))
        return out

    def settle(self, timeout_s: float) -> None:
        if self.pending:
            refs = [ref for ref, _ in self.pending]
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)

    @property
    def num_unconfirmed(self) -> int:
        return sum(len(ids) for _, ids in self.pending)


class RolloutActor:
    def __init__(self, rollout_id: str, cfg: Config, model_dir: Any, relay: dict[str, Any],
                 pools: dict[str, Any], policy: Policy, version: int = 0) -> None:
        torch.set_num_threads(cfg.rollout.threads)
        own = pin_cpus(cfg, rollout_index(rollout_id))  # cluster.cpu_affinity=split|lend: its cores
        # yield the CPU to the trainer (lowering one's priority is always allowed)
        yield_cpu(cfg.rollout.cpu_nice, cfg.rollout.cpu_sched)
        self.cfg = cfg
        local_dir = materialize(model_dir)  # on a cluster node: its own copy
        model, tokenizer = load_pretrained(local_dir, cfg.model.attn_implementation)
        io = RolloutIO(RayPrompts(pools["prompts"]), RayPartials(pools["partials"]),
                       RayBuffer(pools["buffer"]), RelayWeights(relay, cfg.relay))
        task = build_task(cfg.task, cfg.sandbox, prompts=False)
        if cfg.rollout.openai_server:  # task.agent's endpoint, started now: a bad address fails here
            serve_rollout(cfg, rollout_id)
        self.loop = build_rollout(cfg, rollout_id, local_dir, tokenizer, task, io, policy, version,
                                  model)
        self.loop.tick = borrower(cfg, own)  # lend: the trainer's cores too, while it waits
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def pid(self) -> int:
        return os.getpid()

    def node_ip(self) -> str:
        """This rollout's node address on the Ray cluster."""
        return ray.util.get_node_ip_address()

    def start(self) -> None:
        if self.thread is None:
            yield_cpu(0, self.cfg.rollout.cpu_sched)  # threads started since __init__
            self.stop_event.clear()
            self.thread = threading.Thread(target=self.loop.run, args=(self.stop_event,),
                                           daemon=True, name=f"loop-{self.loop.id}")
            self.thread.start()

    def stop(self) -> RolloutSnapshot:
        """End the loop (what reached the buffer is confirmed first); its last snapshot."""
        if self.thread is not None:
            self.stop_event.set()
            self.thread.join(timeout=self.cfg.cluster.wait_timeout_s)
            self.thread = None
        self.loop.finisher.close()  # its reward workers (a later start() starts new ones)
        return self.loop.snapshot()

    # ------------------------------------------------------------------------- drivers

    def generate_groups(self, num_groups: int) -> int:
        """A global batch's share: returns once `num_groups` groups are in the buffer."""
        self.loop.request_groups(num_groups)
        self._wait(lambda: self.loop.batch_done, f"{num_groups} groups of a global batch")
        return num_groups

    def sync_to(self, version: int) -> int:
        """A global weight sync: returns once the engine holds `version` or newer."""
        self.loop.request_version(version)
        self._wait(lambda: self.loop.holds_version(version),
                   f"version {version} from its local relay (is the relay chain alive?)")
        return self.loop.engine.version

    def _wait(self, done: Any, what: str) -> None:
        deadline = time.monotonic() + self.cfg.cluster.wait_timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout {self.loop.id} waited cluster.wait_timeout_s="
                                   f"{self.cfg.cluster.wait_timeout_s:.0f}s for {what}")
            time.sleep(0.002)

    def request_eval(self, job: EvalJob) -> None:
        self.loop.request_eval(job)

    def take_records(self, close: bool = False) -> dict[str, Any]:
        return self.loop.take_records(close)

    # ------------------------------------------------------------------------- the manager

    def snapshot(self) -> RolloutSnapshot:
        return self.loop.snapshot()

    def export(self) -> list[Unfinished]:
        return self.loop.export()

    def adopt(self, moved: list[Unfinished]) -> bool:
        return self.loop.adopt(moved)

    def release(self) -> None:
        self.loop.release()

    def set_relay(self, relay: dict[str, Any]) -> None:
        """Pull from another relay from now on (this one's died)."""
        self.loop.set_weights(RelayWeights(relay, self.cfg.relay))
