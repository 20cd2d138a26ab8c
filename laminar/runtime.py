"""Ray bootstrap and placement: the processes of DESIGN.md §3 on an embedded or existing cluster.

    with Runtime(cfg, model_dir) as rt:      # starts everything, tears it all down on exit
        rt.trainer, rt.workers, rt.manager, rt.pools, rt.relays

- `ray.init()` with the dashboard off starts an embedded local cluster unless
  `cluster.address` names one to join.
- `place` (pure) decides which relay each rollout worker pulls from: one relay per node; on one
  machine `cluster.virtual_nodes: K` gives K relay processes, each serving its share of the
  workers, so the chain is real.
- Data module: the prompt pool, partial response pool and experience buffer are one actor each.
- Every wait goes through `wait`, which fails after `cluster.wait_timeout_s` naming the stuck
  component.
"""

from __future__ import annotations

import os
import secrets
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

import ray

from laminar.config import Config


@dataclass(frozen=True, slots=True)
class Placement:
    relay_ids: list[str]  # chain order, master first
    worker_relay: dict[str, str]  # rollout worker id -> the relay on its (virtual) node
    relay_node: dict[str, str | None]  # relay id -> Ray node id (None: anywhere, one machine)


def place(num_workers: int, virtual_nodes: int, ray_nodes: list[str] | None = None) -> Placement:
    """Workers round-robin over nodes, one relay per node. `ray_nodes`: the live Ray node ids
    of a real cluster (one relay on each); None = one machine split into `virtual_nodes`."""
    if ray_nodes:
        relay_ids = [f"node{k}" for k in range(len(ray_nodes))]
        relay_node: dict[str, str | None] = dict(zip(relay_ids, ray_nodes))
    else:
        relay_ids = [f"node{k}" for k in range(virtual_nodes)]
        relay_node = {r: None for r in relay_ids}
    workers = {f"rollout{i}": relay_ids[i % len(relay_ids)] for i in range(num_workers)}
    return Placement(relay_ids, workers, relay_node)


class Runtime:
    def __init__(self, cfg: Config, model_dir: str, start_version: int = 0,
                 max_outstanding: int | None = None) -> None:
        self.cfg = cfg
        self.model_dir = model_dir
        self.start_version = start_version
        self.max_outstanding = max_outstanding
        self.started_ray = False
        self.relays = None
        self.workers: dict[str, Any] = {}

    def __enter__(self) -> "Runtime":
        try:
            self.start()
        except BaseException:
            self.shutdown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------------- start

    def start(self) -> None:
        from laminar.manager.manager import RolloutManager
        from laminar.models.builder import load_tokenizer
        from laminar.models.tokenizer import encode_prompt
        from laminar.pools.experience import ExperienceBuffer
        from laminar.pools.partials import PartialPool
        from laminar.pools.prompts import PromptPool, PromptSampler
        from laminar.relay.relay import RelayGroup
        from laminar.rollout.worker import RolloutWorker
        from laminar.tasks import build_task
        from laminar.trainer.worker import TrainerWorker

        cfg = self.cfg
        self._init_ray()
        self.job = uuid.uuid4().hex[:8]
        secret = os.environ.get(cfg.relay.secret_env) or secrets.token_hex(16)
        light = {"num_cpus": 0}
        threaded = {"num_cpus": 0, "max_concurrency": 8}

        tokenizer = load_tokenizer(self.model_dir)
        task = build_task(cfg.task)
        sampler = PromptSampler(task.train, partial(encode_prompt, tokenizer), cfg.rollout.group_size,
                                seed=cfg.task.seed)
        # named, so that a restarted trainer finds them by name (an actor restarted by Ray must
        # not hold other actors' handles in its constructor arguments)
        self.pool_names = {k: f"laminar-{self.job}-{k}" for k in ("prompts", "partials", "buffer")}
        self.pools = {
            "prompts": ray.remote(PromptPool).options(**light, name=self.pool_names["prompts"]).remote(
                sampler, 2 * cfg.cluster.wait_timeout_s, self.max_outstanding),
            "partials": ray.remote(PartialPool).options(**light, name=self.pool_names["partials"]).remote(),
            "buffer": ray.remote(ExperienceBuffer).options(**light, name=self.pool_names["buffer"]).remote(
                cfg.rollout.group_size, cfg.trainer.max_staleness),
        }
        nodes = self._cluster_nodes()
        self.placement = place(cfg.rollout.num_workers, cfg.cluster.virtual_nodes, nodes)
        options = {r: self._pin(n) for r, n in self.placement.relay_node.items()}
        self.relays = RelayGroup(self.placement.relay_ids, self.job, secret.encode(), cfg.relay, options)
        infos = {r: info.to_dict() for r, info in self.relays.infos.items()}
        worker_cls = ray.remote(RolloutWorker)
        for wid, relay_id in self.placement.worker_relay.items():
            pin = self._pin(self.placement.relay_node[relay_id])
            self.workers[wid] = worker_cls.options(**threaded, **pin).remote(
                wid, cfg, self.model_dir, infos[relay_id], self.pools, self.start_version)
        self.trainer = ray.remote(TrainerWorker).options(
            **threaded, max_restarts=cfg.trainer.max_restarts).remote(
            cfg, self.model_dir, self.relays.plan.to_dict(), secret.encode(), self.pool_names)
        self.manager = ray.remote(RolloutManager).options(**threaded).remote(cfg, self.workers, self.pools)
        for handle in self.workers.values():
            handle.set_manager.remote(self.manager)
        self.wait({f"rollout worker {w}": h.snapshot.remote() for w, h in self.workers.items()}
                  | {"trainer": self.trainer.metrics_since.remote(0),
                     "rollout manager": self.manager.stats.remote()})

    def _init_ray(self) -> None:
        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if self.cfg.cluster.address:
            ray.init(address=self.cfg.cluster.address, include_dashboard=False,
                     log_to_driver=True, configure_logging=False)
        else:
            ray.init(num_cpus=self.cfg.cluster.num_cpus or os.cpu_count(), include_dashboard=False,
                     log_to_driver=True, configure_logging=False)
        self.started_ray = True

    def _cluster_nodes(self) -> list[str] | None:
        if not self.cfg.cluster.address:
            return None
        return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]

    @staticmethod
    def _pin(node: str | None) -> dict[str, Any]:
        if node is None:
            return {}
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}

    def add_worker(self) -> tuple[str, Any]:
        """Elasticity: start one more rollout worker on the next (virtual) node and register it
        with the manager. The caller starts its loop (e.g. `run_free`). It begins with the
        starting weights and pulls the newest version from its relay before generating."""
        from laminar.rollout.worker import RolloutWorker

        wid = f"rollout{len(self.placement.worker_relay)}"
        relay_id = self.placement.relay_ids[len(self.placement.worker_relay) % len(self.placement.relay_ids)]
        self.placement.worker_relay[wid] = relay_id
        handle = ray.remote(RolloutWorker).options(
            num_cpus=0, max_concurrency=8, **self._pin(self.placement.relay_node[relay_id])).remote(
            wid, self.cfg, self.model_dir, self.relays.infos[relay_id].to_dict(), self.pools,
            self.start_version)
        self.wait({f"rollout worker {wid}": handle.snapshot.remote()})
        ray.get(self.manager.add_worker.remote(wid, handle))
        ray.get(handle.set_manager.remote(self.manager))
        self.workers[wid] = handle
        return wid, handle

    def check_relays(self) -> list[str]:
        """Heartbeat the relays; cut dead ones out of the chain (a dead master's successor takes
        over), tell the trainer the new plan, and point rollouts whose relay died at a live one
        (on one machine every relay's shared memory is local). Returns the dead relay ids."""
        dead = self.relays.check()
        if dead:
            self.trainer.set_plan.remote(self.relays.plan.to_dict())
            live = list(self.relays.plan.order)
            for k, (wid, relay_id) in enumerate(sorted(self.placement.worker_relay.items())):
                if relay_id in dead and live and wid in self.workers:
                    new = live[k % len(live)]
                    self.placement.worker_relay[wid] = new
                    self.workers[wid].set_relay.remote(self.relays.infos[new].to_dict())
        return dead

    # ------------------------------------------------------------------------- waits

    def wait(self, refs: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """ray.get every ref; on timeout, fail naming the components that did not answer."""
        timeout_s = timeout_s or self.cfg.cluster.wait_timeout_s
        names = list(refs)
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        stuck = [n for n in names if refs[n] not in ready]
        if stuck:
            raise TimeoutError(f"no answer within {timeout_s:.0f}s (cluster.wait_timeout_s) from: "
                               f"{', '.join(stuck)}")
        return {n: ray.get(refs[n]) for n in names}

    def worker_snapshots(self) -> dict[str, dict[str, Any]]:
        refs = {w: h.snapshot.remote() for w, h in self.workers.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=10)
        out = {}
        for w, ref in refs.items():
            if ref in ready:
                try:
                    out[w] = ray.get(ref)
                except Exception:  # a dead worker: the manager reports it
                    pass
        return out

    # ------------------------------------------------------------------------- stop

    def shutdown(self) -> None:
        if not ray.is_initialized():
            return
        if self.relays is not None:
            self.relays.shutdown()
            self.relays = None
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
            return
        # a shared cluster (tests, a user's cluster) stays up: remove only this job's actors
        for handle in [*self.workers.values(), getattr(self, "trainer", None),
                       getattr(self, "manager", None), *getattr(self, "pools", {}).values()]:
            if handle is not None:
                ray.kill(handle, no_restart=True)
        self.workers = {}
