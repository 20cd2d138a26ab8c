"""The processes of DESIGN.md §3 as Ray actors, on an embedded or an existing cluster.

    with ClusterRuntime(cfg, model_dir, start_version, policy) as rt:   # starts everything
        rt.wait(rt.generate(32), "generation")                           # the driver API

- `ray.init()` with the dashboard off starts an embedded local cluster unless
  `cluster.address` names one to join.
- `place` (placement.py, pure) decides which relay each rollout pulls from: one relay per
  node; on one machine `cluster.virtual_nodes: K` gives K relay processes, each serving its
  share of the rollouts, so the chain is real.
- Actors: the three pools (one each), the relay group (laminar/runtime/relays.py), one
  `RolloutActor` per rollout, the `TrainerActor` (restarted by Ray after a crash), the
  `ManagerActor`. The rollout loops and the manager's health loop start here; the schedule's
  driver (laminar/modes/<mode>.py) only says where it waits.
- Every wait fails after `cluster.wait_timeout_s` naming the stuck component; a trainer that
  died surfaces as `TrainerRestarted`, so the driver can make its call again.
- GPUs: Ray shows an actor only the GPUs it reserves (`CUDA_VISIBLE_DEVICES=''` for one that
  reserves none). The trainer reserves `cluster.trainer_resources`, each rollout
  `cluster.rollout_resources` (`ray_resources` turns them into Ray's options);
  `check_gpu_reservations` refuses `trainer.device=cuda` / `rollout.device=cuda` without a GPU
  there before anything starts.
"""

from __future__ import annotations

import os
import secrets
import time
import uuid
from functools import cached_property
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import ray

from laminar.config import Config, ConfigError
from laminar.rollout.policy import Policy
from laminar.runtime import TrainerRestarted, ray_env_defaults
from laminar.runtime.placement import place
from laminar.actor import alive_nodes, pin
from laminar.types import RolloutSnapshot

LIGHT = {"num_cpus": 0}
THREADED = {"num_cpus": 0, "max_concurrency": 8}


def ray_resources(resources: Mapping[str, float]) -> dict[str, Any]:
    """Ray actor options reserving `resources` (a `cluster.*_resources` mapping such as
    {GPU: 0.5, accel: 1}): Ray takes CPUs and GPUs as `num_cpus` / `num_gpus`, and refuses them
    inside `resources`; every other name is a custom resource."""
    opts: dict[str, Any] = {}
    if "CPU" in resources:
        opts["num_cpus"] = float(resources["CPU"])
    if "GPU" in resources:
        opts["num_gpus"] = float(resources["GPU"])
    custom = {k: float(v) for k, v in resources.items() if k not in ("CPU", "GPU")}
    if custom:
        opts["resources"] = custom
    return opts


def check_gpu_reservations(cfg: Config) -> None:
    """At start: `trainer.device=cuda` or `rollout.device=cuda` under Ray needs a GPU in
    `cluster.trainer_resources` / `cluster.rollout_resources` (Ray hides GPUs from an actor that
    asks for none, so it would find no CUDA device only once it started). One ConfigError line
    naming the key, the value and the fix."""
    if cfg.cluster.backend != "ray":
        return
    for role, who, share in (("trainer", "the trainer", "share the GPU with the rollouts"),
                             ("rollout", "each rollout", "share a GPU between rollouts or with the trainer")):
        reserved = getattr(cfg.cluster, f"{role}_resources")
        if getattr(cfg, role).device == "cuda" and float(reserved.get("GPU", 0)) <= 0:
            raise ConfigError(f"{role}.device=cuda with cluster.backend=ray needs a GPU reserved for "
                              f"{who} (Ray hides GPUs from an actor that asks for none): set "
                              f"cluster.{role}_resources={{GPU: 1}}, or a fraction such as 0.5 to {share}")


class ClusterRuntime:
    def __init__(self, cfg: Config, model_dir: str, start_version: int, policy: Policy) -> None:
        self.cfg, self.model_dir, self.start_version, self.policy = cfg, model_dir, start_version, policy
        self.started_ray = False
        self.relays = None
        self.workers: dict[str, Any] = {}
        self.trainer = self.manager = None
        self.trainer_group = None  # the trainer ranks' placement group (trainer.world_size > 1)
        self.pools: dict[str, Any] = {}
        self.eval_turn = -1  # request_eval: whose turn it is
        self.head: str | None = None  # the driver's Ray node on a real cluster
        self.node_ips: dict[str, str] = {}  # Ray node id -> address, on a real cluster
        self.node_of: dict[str, str] = {}  # rollout id -> its node's address (rollout_nodes)
        self.staging: str | None = None  # user code staged for shipping (shipping.py)

    def __enter__(self) -> "ClusterRuntime":
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
        from laminar.manager.actor import ManagerActor
        from laminar.models.builder import load_tokenizer
        from laminar.pools.experience import ExperienceBuffer
        from laminar.pools.partials import PartialPool
        from laminar.pools.prompts import PromptEncoder, PromptPool, PromptSampler
        from laminar.relay.actor import RelayGroup
        from laminar.tasks import build_task
        from laminar.trainer.actor import TrainerActor, start_trainer_group

        cfg = self.cfg
        check_gpu_reservations(cfg)  # before anything starts
        secret = (os.environ.get(cfg.relay.secret_env) or secrets.token_hex(16)).encode()
        self._init_ray(secret)
        self.job = uuid.uuid4().hex[:8]
        tokenizer = load_tokenizer(self.model_dir)
        self.task = task = build_task(cfg.task, cfg.sandbox)
        sampler = PromptSampler(task.train, PromptEncoder.of(tokenizer), cfg.rollout.group_size,
                                seed=cfg.task.seed)
        # named, so that a restarted trainer finds them by name
        self.names = {k: f"laminar-{self.job}-{k}" for k in ("prompts", "partials", "buffer", "trainer")}
        db, self.resumed = self._prepare_pools()
        nodes = self._cluster_nodes()  # sets self.head, which the pools are pinned to
        here = {**LIGHT, **pin(self.head)}  # the pools write RUN_DIR/pools.db: the driver's node
        self.pools = {
            "prompts": ray.remote(PromptPool).options(**here, name=self.names["prompts"]).remote(
                sampler, 2 * cfg.cluster.wait_timeout_s, self.policy.max_outstanding, db, cfg.resume),
            "partials": ray.remote(PartialPool).options(**here, name=self.names["partials"]).remote(
                db, cfg.resume),
            "buffer": ray.remote(ExperienceBuffer).options(**here, name=self.names["buffer"]).remote(
                cfg.rollout.group_size, store=db, restore=cfg.resume),
        }
        self.placement = place(cfg.rollout.num_workers, cfg.cluster.virtual_nodes,
                               list(nodes) if nodes else None, self.head, cfg.cluster.rollouts_on_head)
        options = {r: pin(n) for r, n in self.placement.relay_node.items()}
        self.relays = RelayGroup(self.placement.relay_ids, self.job, secret, cfg.relay, options,
                                 {r: (nodes or {}).get(n) for r, n in self.placement.relay_node.items()},
                                 timeout_s=cfg.cluster.wait_timeout_s)
        if nodes:
            print("placement: " + "; ".join(
                f"relay {r} on {nodes[n]}" + ("" if k else " (master, with the trainer)") + ": "
                + (", ".join(w for w, rr in self.placement.worker_relay.items() if rr == r) or "no rollouts")
                for k, (r, n) in enumerate(self.placement.relay_node.items())), flush=True)
        for wid in self.placement.worker_relay:
            self.workers[wid] = self._start_rollout(wid)
        if cfg.trainer.world_size > 1:  # ranks in a placement group; rank 0 starts the others
            self.trainer, self.trainer_group = start_trainer_group(
                cfg, self.model_dir, self.model_source, self.relays.plan.to_dict(), secret,
                self.names, self.node_ips.get(self.head or ""))
        else:
            trainer_opts = ({**THREADED, **ray_resources(cfg.cluster.trainer_resources)}
                            if cfg.cluster.trainer_resources else {**THREADED, **pin(self.head)})
            self.trainer = ray.remote(TrainerActor).options(
                **trainer_opts, name=self.names["trainer"],
                max_restarts=cfg.trainer.max_restarts).remote(
                cfg, self.model_dir, self.relays.plan.to_dict(), secret, self.names)
        repack = cfg.manager.repack and self.policy.repacks
        self.manager = ray.remote(ManagerActor).options(**THREADED, **pin(self.head)).remote(
            cfg, self.workers, dict(self.placement.worker_relay), self.pools, self.relays,
            self.names["trainer"], repack, self.policy.mixes_versions, self.rollout_spec)
        self._wait_started()
        if cfg.resume and not getattr(self.policy, "defers_resumed", False):
            self.hand_out_resumed()
        self.started_at = time.time()  # the driver's rows count from here
        self.wait_all({f"start of {w}": h.start.remote() for w, h in self.workers.items()})
        self.manager_loop = self.manager.run_loop.remote()

    def _prepare_pools(self) -> tuple[str | None, Any]:
        """RUN_DIR/pools.db (None: pools in memory) and, when the job resumes, what the
        reconciliation of the killed job's pools did (printed)."""
        from laminar.pools.resume import claim_run_dir, prepare_pools
        from laminar.trainer.service import newest_checkpoint

        ckpt = newest_checkpoint(self.cfg.resolved_run_dir) if self.cfg.resume else None
        db, summary = prepare_pools(self.cfg, self.start_version if ckpt else None, self.start_version,
                                    self.policy.mixes_versions)
        if summary is not None:
            print(f"resume: {summary.line()}", flush=True)
        claim_run_dir(self.cfg.resolved_run_dir, self.job, self.cfg.relay.shm_dir)
        return db, summary

    def hand_out_resumed(self, started: bool | None = None) -> None:
        """The killed job's in-flight trajectories (owned by `RESUMED` after the
        reconciliation) go to the live rollouts, dealt out evenly: each continues from its
        streamed tokens (or from its prompt, when reset). Free-running schedules: before the
        loops start; global-batch ones when their driver says (`resume_global_batches`)."""
        from laminar.pools.resume import RESUMED, deal_resumed

        entries = ray.get(self.pools["partials"].owned_by.remote(RESUMED))
        for wid, mine in deal_resumed(entries, sorted(self._live()), started).items():
            if not ray.get(self.workers[wid].adopt.remote(mine)):
                raise RuntimeError(f"rollout {wid} refused the resumed trajectories (version "
                                   "mismatch); this is a bug: please report it")
            ray.get(self.pools["partials"].reassign.remote(
                [m.request.request_id for m in mine], wid, [m.request for m in mine]))

    def _wait_started(self) -> None:
        """Every rollout, the trainer and the manager answer once; one that failed to start is
        an error naming it and its node (e.g. a reward module that node cannot import)."""
        from laminar.config import ConfigError
        from laminar.actor import start_failure

        refs = ({f"rollout worker {w}": h.snapshot.remote() for w, h in self.workers.items()}
                | {"trainer": self.trainer.metrics_since.remote(0),
                   "rollout manager": self.manager.stats.remote()})
        try:
            self.wait_all(refs)
        except ray.exceptions.RayActorError:
            for name, ref in refs.items():
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError as e:
                    wid = name.removeprefix("rollout worker ")
                    relay = self.placement.worker_relay.get(wid)
                    node = self.node_ips.get(self.placement.relay_node.get(relay) or "", "")
                    kind, message = start_failure(e)
                    # the user's setup (a module a node cannot import): one line; else a bug
                    error = ConfigError if kind == "ConfigError" else RuntimeError
                    raise error(f"{name}{f' on node {node}' if node else ''} failed to "
                                f"start: {message}") from None
                except Exception:
                    continue
            raise

    @cached_property
    def model_source(self) -> Any:
        """The starting model as rollouts get it: its path on one machine; on a cluster, the
        directory through the object store for nodes that do not have it (shipping.py)."""
        if not self.cfg.cluster.address:
            return self.model_dir
        from pathlib import Path

        from laminar.actor import ShippedDir, fingerprint, pack

        d = Path(self.model_dir)
        return ShippedDir(str(d), fingerprint(d), ray.put(pack(d)))

    @cached_property
    def rollout_spec(self) -> Any:
        """How a rollout actor starts; the manager starts a dead one's replacement from it."""
        from laminar.manager.actor import RolloutSpec

        reserve = ray_resources(self.cfg.cluster.rollout_resources)  # e.g. a share of a GPU
        return RolloutSpec(self.cfg, self.model_source, self.start_version,
                           {r: info.to_dict() for r, info in self.relays.infos.items()},
                           {r: {**THREADED, **pin(n), **reserve}
                            for r, n in self.placement.relay_node.items()},
                           self.pools, ray.put(self.policy))

    def _start_rollout(self, wid: str) -> Any:
        return self.rollout_spec.start(wid, self.placement.worker_relay[wid])

    def _init_ray(self, secret: bytes) -> None:
        """Join `cluster.address` or start an embedded cluster. An address where nothing
        answers is a ConfigError within seconds (ray.init would retry it for minutes). Every
        process of the job gets the job secret as $relay.secret_env (the rollouts' OpenAI
        endpoint takes it as its key; relays and the trainer get it as an argument)."""
        import socket

        from laminar.config import ConfigError

        if ray.is_initialized():
            return
        ray_env_defaults()
        address = self.cfg.cluster.address
        if address and address not in ("auto", "local"):
            client = address.startswith("ray://")
            host, sep, port = address.removeprefix("ray://").rpartition(":")
            if not sep:  # no port: Ray Client's default, or a GCS address without one
                host, port = address.removeprefix("ray://"), "10001" if client else ""
            if not host or not port.isdigit():
                raise ConfigError(f"cluster.address='{address}' is not host:port or "
                                  "ray://host[:port] (e.g. 10.0.0.5:6379, ray://head:10001, auto)")
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=10.0).close()
            except OSError as e:
                raise ConfigError(
                    f"cluster.address='{address}': nothing answers at {host}:{port} ({e}). Start "
                    "the cluster there (`ray start --head` on that machine), fix the address, or "
                    "unset cluster.address to run on an embedded local cluster") from None
        if address:
            import tempfile

            from laminar.runtime.shipping import user_runtime_env

            self.staging = tempfile.mkdtemp(prefix="laminar-ship-")
            runtime_env, notes = user_runtime_env(self.cfg.task, Path(self.staging),
                                                  [Path(self.cfg.resolved_run_dir)])
            for note in notes:
                print(f"shipping {note}", flush=True)
        else:
            runtime_env = {}
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}),
                                   self.cfg.relay.secret_env: secret.decode()}
        if address:
            ray.init(address=address, include_dashboard=False, runtime_env=runtime_env,
                     log_to_driver=True, configure_logging=False)
        else:
            ray.init(num_cpus=self.cfg.cluster.num_cpus or os.cpu_count(), include_dashboard=False,
                     runtime_env=runtime_env, log_to_driver=True, configure_logging=False)
        self.started_ray = True

    def _cluster_nodes(self) -> dict[str, str] | None:
        """Node id -> address of the live nodes of a real cluster (None: one machine); the
        driver's node is `self.head`."""
        if not self.cfg.cluster.address:
            return None
        self.head = ray.get_runtime_context().get_node_id()
        self.node_ips = alive_nodes()
        return self.node_ips

    def add_worker(self) -> str:
        """Elasticity: one more rollout on the next (virtual) node. It starts with the starting
        weights, pulls the newest version from its relay before generating (its policy says
        so), and is registered with the manager."""
        wid = f"rollout{len(self.placement.worker_relay)}"
        relay_id = self.placement.relay_ids[len(self.placement.worker_relay) % len(self.placement.relay_ids)]
        self.placement.worker_relay[wid] = relay_id
        handle = self._start_rollout(wid)
        self.wait_all({f"rollout worker {wid}": handle.snapshot.remote()})
        ray.get(self.manager.add_rollout.remote(wid, handle, relay_id))
        ray.get(handle.start.remote())
        self.workers[wid] = handle
        return wid

    def scale_up(self, n: int, new_node: bool = False) -> list[str]:
        """`laminar scale`: the manager starts `n` rollouts (on a new virtual node with its own
        relay, caught up first, when `new_node`); they join once they answer."""
        try:
            return ray.get(self.manager.scale_up.remote(n, new_node), timeout=self.cfg.cluster.wait_timeout_s)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(e.cause, Exception) else RuntimeError(str(e))
            raise type(cause)(str(cause)) from None

    def rollout_nodes(self) -> dict[str, str]:
        """Rollout id -> its node's address (asked once per rollout: they do not move)."""
        missing = {w: h for w, h in self._live().items() if w not in self.node_of}
        self.node_of.update(self._answers({w: h.node_ip.remote() for w, h in missing.items()},
                                          timeout_s=2))
        return dict(self.node_of)

    def pool_depths(self) -> dict[str, int]:
        """What the pools hold now: groups leased to rollouts, waiting to be leased again,
        trajectories in flight (partial pool), groups ready for the trainer."""
        refs = {"prompts": self.pools["prompts"].accounting.remote(),
                "partials": self.pools["partials"].size.remote(),
                "buffer": self.pools["buffer"].counts.remote()}
        got = self._answers(refs, timeout_s=2)
        out: dict[str, int] = {}
        if "prompts" in got:
            out |= {"groups_leased": got["prompts"]["leased"], "groups_returned": got["prompts"]["returned"],
                    "groups_trained": got["prompts"]["consumed"]}
        if "partials" in got:
            out["trajectories_in_flight"] = got["partials"]
        if "buffer" in got:
            out["groups_ready"] = got["buffer"]["ready_groups"]
        return out

    def retire_worker(self, wid: str) -> int:
        """Elasticity: a rollout leaves; its in-flight work moves to peers first."""
        moved = self.wait(self.manager.retire.remote(wid), f"retirement of {wid}")
        self.workers.pop(wid, None)
        return moved

    # ------------------------------------------------------------------------- the driver API

    def _live(self) -> dict[str, Any]:
        manager = self.manager_stats()
        joined = sorted(set(manager["workers"]) - set(self.workers))
        if joined:  # the manager started them in place of dead ones
            self.workers |= ray.get(self.manager.rollouts.remote(joined), timeout=self.cfg.cluster.wait_timeout_s)
        dead = set(manager["dead"])
        return {w: h for w, h in self.workers.items() if w not in dead}

    def generate(self, num_groups: int) -> list[Any]:
        """Deal one global batch out to the live rollouts, evenly; returns the pending calls."""
        workers = list(self._live().values())
        share = [num_groups // len(workers) + (i < num_groups % len(workers)) for i in range(len(workers))]
        return [w.generate_groups.remote(n) for w, n in zip(workers, share) if n]

    def ready_groups(self) -> int:
        return ray.get(self.pools["buffer"].counts.remote(), timeout=self.cfg.cluster.wait_timeout_s)["ready_groups"]

    def untrained_groups(self) -> int:
        """Groups leased or complete that the trainer has not taken: after a resume, the batch
        the killed job was generating (a global-batch schedule generates only the rest)."""
        return ray.get(self.pools["prompts"].untrained.remote(), timeout=self.cfg.cluster.wait_timeout_s)

    def sync_weights(self, version: int) -> None:
        """Every rollout gets to `version` before anyone goes on (its policy says what becomes
        of work in flight)."""
        self.wait_all({f"weight sync of {w}": h.sync_to.remote(version) for w, h in self._live().items()})

    def train(self, method: str) -> Any:
        """Start a trainer call: train_once | train_streaming | train_next | run."""
        if method == "run":
            return self.trainer.run.remote(self.cfg.trainer.total_steps)
        return getattr(self.trainer, method).remote()

    def wait(self, pending: Any, what: str) -> Any:
        if isinstance(pending, list):
            return list(self.wait_all({f"{what} part {i}": p for i, p in enumerate(pending)}).values())
        return self.wait_all({what: pending})[what]

    def wait_all(self, refs: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """ray.get every ref; on timeout, fail naming the components that did not answer."""
        timeout_s = timeout_s or self.cfg.cluster.wait_timeout_s
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        stuck = [n for n, ref in refs.items() if ref not in ready]
        if stuck:
            raise TimeoutError(f"no answer within {timeout_s:.0f}s (cluster.wait_timeout_s) from: "
                               f"{', '.join(stuck)}")
        return {n: ray.get(ref) for n, ref in refs.items()}

    def ready(self, pending: Any, timeout_s: float) -> bool:
        return bool(ray.wait([pending], timeout=timeout_s)[0])

    def result(self, pending: Any) -> Any:
        try:
            return ray.get(pending)
        except ray.exceptions.RayActorError:
            raise TrainerRestarted("the trainer died; Ray restarts it from its newest checkpoint") from None

    def trainer_rows(self, since: int) -> list[dict[str, Any]]:
        try:
            return ray.get(self.trainer.metrics_since.remote(since), timeout=self.cfg.cluster.wait_timeout_s)
        except ray.exceptions.RayActorError:
            raise TrainerRestarted("the trainer is restarting") from None

    def trainer_pid(self) -> int:
        return ray.get(self.trainer.pid.remote())

    def process_ids(self, manager: dict[str, Any]) -> dict[str, Any]:
        """Which process is which (RUN_DIR/processes.json, for operators and `laminar bench
        faults`): the driver, the trainer, every live rollout and every relay in the chain."""
        try:
            trainer = ray.get(self.trainer.pid.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            trainer = None  # restarting
        live = {w: h for w, h in self._live().items() if w in manager["workers"]}
        pids = self._answers({w: h.pid.remote() for w, h in live.items()})
        ips = self._answers({w: h.node_ip.remote() for w, h in live.items()})
        return {"job": self.job, "driver": os.getpid(), "trainer": trainer, "rollouts": pids,
                "relays": {r: self.relays.pids.get(r) for r in manager["chain"]},
                "chain": list(manager["chain"]), "updated_at": time.time(),
                # where everything runs: node addresses (one machine: all the same)
                "rollout_nodes": ips, "rollout_relay": dict(manager.get("worker_relay", {})),
                "relay_addresses": manager.get("relay_addresses") or {
                    r: "%s:%d" % self.relays.infos[r].address for r in manager["chain"]},
                "nodes_joined": manager.get("nodes_joined", []),
                "trainer_node": self.node_ips.get(self.head or "", "")}

    def snapshots(self) -> dict[str, RolloutSnapshot]:
        """Rollouts that answer within 10 s (a dead one is the manager's to report)."""
        return self._answers({w: h.snapshot.remote() for w, h in self.workers.items()})

    @staticmethod
    def _answers(refs: dict[str, Any], timeout_s: float = 10) -> dict[str, Any]:
        """The answers that came within `timeout_s`, from actors still alive."""
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        out = {}
        for w, ref in refs.items():
            if ref in ready:
                try:
                    out[w] = ray.get(ref)
                except ray.exceptions.RayActorError:
                    pass
        return out

    def request_eval(self, job: Any) -> str | None:
        """A held-out evaluation by the next live rollout in turn; returns its id (None while
        no rollout is alive: the driver asks again once one is)."""
        live = sorted(self._live())
        if not live:
            return None
        self.eval_turn += 1
        wid = live[self.eval_turn % len(live)]
        self.workers[wid].request_eval.remote(job)
        return wid

    def take_records(self, close: bool = False) -> dict[str, dict[str, Any]]:
        """Per live rollout: evaluations finished, timeline spans and environment latencies
        since the last call (rollouts that do not answer within 10 s are skipped this time)."""
        return self._answers({w: h.take_records.remote(close) for w, h in self._live().items()})

    def idle(self, seconds: float) -> None:
        time.sleep(seconds)  # the loops run in their own threads

    def manager_stats(self) -> dict[str, Any]:
        return ray.get(self.manager.stats.remote(), timeout=self.cfg.cluster.wait_timeout_s)

    def finish(self) -> dict[str, Any]:
        """Stop the manager and every rollout loop (what reached the buffer is confirmed first);
        where every leased prompt group ended up."""
        self.manager.stop.remote()
        ray.wait([self.manager_loop], timeout=self.cfg.cluster.wait_timeout_s)
        self._live()  # a rollout the manager started in place of a dead one stops too
        refs = {w: h.stop.remote() for w, h in self.workers.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.cfg.cluster.wait_timeout_s)
        for w, ref in refs.items():
            if ref not in ready:
                raise TimeoutError(f"rollout loop {w} did not stop within cluster.wait_timeout_s")
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                pass  # died or retired: the manager's report says which
        ray.get([pool.flush.remote() for pool in self.pools.values()])  # batched writes
        return {"prompts": ray.get(self.pools["prompts"].accounting.remote()),
                "buffer": ray.get(self.pools["buffer"].counts.remote()),
                "manager": self.manager_stats()}

    # ------------------------------------------------------------------------- stop

    def shutdown(self) -> None:
        if self.staging:
            import shutil

            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None
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
        for handle in [*self.workers.values(), self.trainer, self.manager, *self.pools.values()]:
            if handle is not None:
                ray.kill(handle, no_restart=True)
        self.workers = {}
        if self.trainer_group is not None:  # the ranks' reserved resources
            ray.util.remove_placement_group(self.trainer_group)
            self.trainer_group = None
