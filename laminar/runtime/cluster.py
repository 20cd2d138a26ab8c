"""The processes of DESIGN.md §3 as Ray actors, on an embedded or an existing cluster, behind
the driver API (laminar/runtime/api.py).

    with ClusterRuntime(cfg, model_dir, start_version, policy) as rt:   # starts everything
        rt.wait(rt.generate(32), "generation")                           # the driver API

- Start-up: Ray joined or started (raytools.py), then the job's actors in order (assembly.py):
  pools, relays, rollouts, trainer, manager; the rollout loops and the manager's health loop
  start here; the schedule's driver (laminar/modes/<mode>.py) only says where it waits.
- The driver API: global batches dealt out, weight syncs, trainer calls, held-out evaluations.
  Every wait fails after `cluster.wait_timeout_s` naming the stuck component; a trainer that
  died surfaces as `TrainerRestarted`, so the driver can make its call again.
- Elasticity (`laminar scale`): rollouts added or retired while the job runs.
- Operator views: which process is which, where each rollout runs, what the pools hold.
- At the end, the job's actors (only them, on a shared cluster) or the embedded cluster stop.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from functools import cached_property
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup

from laminar.actor import ShippedDir, alive_nodes
from laminar.config import Config, ConfigError
from laminar.cores import loan_path, release_trainer_cores
from laminar.devices import PINNED, claim_cores, restore_cores, settle_affinity
from laminar.manager.actor import RolloutSpec
from laminar.pools.resume import RESUMED, ResumeSummary, deal_resumed
from laminar.relay.actor import RelayGroup
from laminar.rollout.evals import EvalJob
from laminar.rollout.policy import Policy
from laminar.runtime.api import TrainerCall, TrainerRestarted
from laminar.runtime.assembly import (actor_names, check_gpu_reservations, job_secret, model_source,
                                      prepare_job_pools, prompt_encoder, rollout_spec, start_manager,
                                      start_pools, start_relays, start_trainer, wait_started)
from laminar.runtime.placement import place
from laminar.runtime.raytools import answers, init_ray, wait_all
from laminar.tasks import Task, build_task
from laminar.types import RolloutSnapshot


class ClusterRuntime:
    one_process = False  # processes to name, nodes, elasticity: the follower reports them

    def __init__(self, cfg: Config, model_dir: str, start_version: int, policy: Policy) -> None:
        self.cfg, self.model_dir, self.start_version, self.policy = cfg, model_dir, start_version, policy
        self.started_ray = False
        self.relays: RelayGroup | None = None
        self.workers: dict[str, ActorHandle] = {}
        self.trainer: ActorHandle | None = None
        self.manager: ActorHandle | None = None
        self.trainer_group: PlacementGroup | None = None  # the trainer ranks' (trainer.world_size > 1)
        self.pools: dict[str, ActorHandle] = {}
        self.eval_turn = -1  # request_eval: whose turn it is
        self.head: str | None = None  # the driver's Ray node on a real cluster
        self.node_ips: dict[str, str] = {}  # Ray node id -> address, on a real cluster
        self.node_of: dict[str, str] = {}  # rollout id -> its node's address (rollout_nodes)
        self.staging: str | None = None  # user code staged for shipping (shipping.py)
        self.job: str | None = None  # the job's id: its actors' names and RUN_DIR/job.json
        self.resumed: ResumeSummary | None = None  # what the reconciliation of a resumed job did
        self.claimed = False  # whether this driver recorded its trainer's cores (claim_cores)

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
        asked = self.cfg.cluster.cpu_affinity
        self.cfg, why = settle_affinity(self.cfg)  # cluster.cpu_affinity: auto decided once, here
        cfg = self.cfg
        if cfg.cluster.cpu_affinity in PINNED or asked == "auto":
            print(f"cpus: {why}", flush=True)
        self.claimed = claim_cores(cfg)  # the trainer's cores, for the other jobs here
        check_gpu_reservations(cfg)  # before anything starts
        secret = job_secret(cfg)
        if not ray.is_initialized():
            self.staging = init_ray(cfg, secret)
            self.started_ray = True
        self.job = uuid.uuid4().hex[:8]
        encode = prompt_encoder(self.model_dir)
        self.task: Task = build_task(cfg.task, cfg.sandbox)
        self.names = actor_names(self.job)
        db, self.resumed = prepare_job_pools(cfg, self.start_version, self.policy, self.job)
        nodes = self._cluster_nodes()  # sets self.head, which the pools are pinned to
        self.pools = start_pools(cfg, self.task, encode, self.policy, db, self.names, self.head)
        self.placement = place(cfg.rollout.num_workers, cfg.cluster.virtual_nodes,
                               list(nodes) if nodes else None, self.head, cfg.cluster.rollouts_on_head)
        self.relays = start_relays(cfg, self.placement, self.job, secret, nodes)
        for wid in self.placement.worker_relay:
            self.workers[wid] = self._start_rollout(wid)
        self.trainer, self.trainer_group = start_trainer(
            cfg, self.model_dir, self.model_source, self.relays, secret, self.names, self.head,
            self.node_ips.get(self.head or ""))
        self.manager = start_manager(cfg, self.workers, self.placement, self.pools, self.relays,
                                     self.names, self.policy, self.rollout_spec, self.head)
        self._pools_started()
        wait_started(cfg, self.workers, self.trainer, self.manager, self.placement, self.node_ips)
        if cfg.resume and not self.policy.defers_resumed:
            self.hand_out_resumed()
        self.started_at = time.time()  # the driver's rows count from here
        self.wait_all({f"start of {w}": h.start.remote() for w, h in self.workers.items()})
        self.manager_loop = self.manager.run_loop.remote()

    def _pools_started(self) -> None:
        """Every pool answers, or the job fails now with the pool's own error (a pools.db it
        cannot read is a ConfigError naming the file and the fix) rather than after
        cluster.wait_timeout_s of a trainer waiting for data no rollout can lease."""
        try:
            wait_all({f"start of the {k} pool": h.__ray_ready__.remote()
                      for k, h in self.pools.items()}, self.cfg.cluster.wait_timeout_s)
        except ray.exceptions.ActorDiedError as e:
            said = e.error_msg or ""
            if "ConfigError: " in said:
                raise ConfigError(said.rsplit("ConfigError: ", 1)[1].strip()) from None
            raise

    def hand_out_resumed(self, started: bool | None = None) -> None:
        """The killed job's in-flight trajectories (owned by `RESUMED` after the
        reconciliation) go to the live rollouts, dealt out evenly: each continues from its
        streamed tokens (or from its prompt, when reset). Free-running schedules: before the
        loops start; global-batch ones when their driver says (`resume_global_batches`)."""
        entries = ray.get(self.pools["partials"].owned_by.remote(RESUMED))
        for wid, mine in deal_resumed(entries, sorted(self._live()), started).items():
            if not ray.get(self.workers[wid].adopt.remote(mine)):
                raise RuntimeError(f"rollout {wid} refused the resumed trajectories (version "
                                   "mismatch); this is a bug: please report it")
            ray.get(self.pools["partials"].reassign.remote(
                [m.request.request_id for m in mine], wid, [m.request for m in mine]))

    @cached_property
    def model_source(self) -> str | ShippedDir:
        """The starting model as rollouts get it (assembly.py `model_source`)."""
        return model_source(self.cfg, self.model_dir)

    @cached_property
    def rollout_spec(self) -> RolloutSpec:
        """How a rollout actor starts; the manager starts a dead one's replacement from it."""
        return rollout_spec(self.cfg, self.model_source, self.start_version, self.relays,
                            self.placement, self.pools, self.policy)

    def _start_rollout(self, wid: str) -> ActorHandle:
        return self.rollout_spec.start(wid, self.placement.worker_relay[wid])

    def _cluster_nodes(self) -> dict[str, str] | None:
        """Node id -> address of the live nodes of a real cluster (None: one machine); the
        driver's node is `self.head`."""
        if not self.cfg.cluster.address:
            return None
        self.head = ray.get_runtime_context().get_node_id()
        self.node_ips = alive_nodes()
        return self.node_ips

    # ------------------------------------------------------------------------- the driver API

    def _live(self) -> dict[str, ActorHandle]:
        manager = self.manager_stats()
        joined = sorted(set(manager["workers"]) - set(self.workers))
        if joined:  # the manager started them in place of dead ones
            self.workers |= ray.get(self.manager.rollouts.remote(joined), timeout=self.cfg.cluster.wait_timeout_s)
        dead = set(manager["dead"])
        return {w: h for w, h in self.workers.items() if w not in dead}

    def generate(self, num_groups: int) -> list[ray.ObjectRef]:
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

    def train(self, method: TrainerCall) -> ray.ObjectRef:
        """Start a trainer call: train_once | train_streaming | train_next | run."""
        if method == "run":
            return self.trainer.run.remote(self.cfg.trainer.total_steps)
        return getattr(self.trainer, method).remote()

    def wait(self, pending: ray.ObjectRef | list[ray.ObjectRef], what: str) -> Any:
        if isinstance(pending, list):
            return list(self.wait_all({f"{what} part {i}": p for i, p in enumerate(pending)}).values())
        return self.wait_all({what: pending})[what]

    def wait_all(self, refs: dict[str, ray.ObjectRef], timeout_s: float | None = None) -> dict[str, Any]:
        """ray.get every ref; on timeout (default cluster.wait_timeout_s), fail naming the
        components that did not answer."""
        return wait_all(refs, timeout_s or self.cfg.cluster.wait_timeout_s)

    def ready(self, pending: ray.ObjectRef, timeout_s: float) -> bool:
        return bool(ray.wait([pending], timeout=timeout_s)[0])

    def result(self, pending: ray.ObjectRef) -> Any:
        try:
            return ray.get(pending)
        except ray.exceptions.RayActorError:
            raise TrainerRestarted("the trainer died; Ray restarts it from its newest checkpoint") from None

    def trainer_rows(self, since: int) -> list[dict[str, Any]]:
        try:
            return ray.get(self.trainer.metrics_since.remote(since), timeout=self.cfg.cluster.wait_timeout_s)
        except ray.exceptions.RayActorError:
            raise TrainerRestarted("the trainer is restarting") from None

    def snapshots(self) -> dict[str, RolloutSnapshot]:
        """Rollouts that answer within 10 s (a dead one is the manager's to report)."""
        return answers({w: h.snapshot.remote() for w, h in self.workers.items()})

    def request_eval(self, job: EvalJob) -> str | None:
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
        return answers({w: h.take_records.remote(close) for w, h in self._live().items()})

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

    # ------------------------------------------------------------------------- elasticity

    def add_worker(self) -> str:
        """One more rollout on the next (virtual) node. It starts with the starting weights,
        pulls the newest version from its relay before generating (its policy says so), and is
        registered with the manager."""
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

    def retire_worker(self, wid: str) -> int:
        """A rollout leaves; its in-flight work moves to peers first."""
        moved = self.wait(self.manager.retire.remote(wid), f"retirement of {wid}")
        self.workers.pop(wid, None)
        return moved

    # ------------------------------------------------------------------------- operator views

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
        pids = answers({w: h.pid.remote() for w, h in live.items()})
        ips = answers({w: h.node_ip.remote() for w, h in live.items()})
        return {"job": self.job, "driver": os.getpid(), "trainer": trainer, "rollouts": pids,
                "relays": {r: self.relays.pids.get(r) for r in manager["chain"]},
                "chain": list(manager["chain"]), "updated_at": time.time(),
                # where everything runs: node addresses (one machine: all the same)
                "rollout_nodes": ips, "rollout_relay": dict(manager.get("worker_relay", {})),
                "relay_addresses": manager.get("relay_addresses") or {
                    r: "%s:%d" % self.relays.infos[r].address for r in manager["chain"]},
                "nodes_joined": manager.get("nodes_joined", []),
                "trainer_node": self.node_ips.get(self.head or "", "")}

    def rollout_nodes(self) -> dict[str, str]:
        """Rollout id -> its node's address (asked once per rollout: they do not move)."""
        missing = {w: h for w, h in self._live().items() if w not in self.node_of}
        self.node_of.update(answers({w: h.node_ip.remote() for w, h in missing.items()}, timeout_s=2))
        return dict(self.node_of)

    def pool_depths(self) -> dict[str, int]:
        """What the pools hold now: groups leased to rollouts, waiting to be leased again,
        trajectories in flight (partial pool), groups ready for the trainer."""
        refs = {"prompts": self.pools["prompts"].accounting.remote(),
                "partials": self.pools["partials"].size.remote(),
                "buffer": self.pools["buffer"].counts.remote()}
        got = answers(refs, timeout_s=2)
        out: dict[str, int] = {}
        if "prompts" in got:
            out |= {"groups_leased": got["prompts"]["leased"], "groups_returned": got["prompts"]["returned"],
                    "groups_trained": got["prompts"]["consumed"]}
        if "partials" in got:
            out["trajectories_in_flight"] = got["partials"]
        if "buffer" in got:
            out["groups_ready"] = got["buffer"]["ready_groups"]
        return out

    # ------------------------------------------------------------------------- stop

    def shutdown(self) -> None:
        if self.claimed:
            release_trainer_cores()
            self.claimed = False
        if self.cfg.cluster.cpu_affinity == "lend":  # the trainer's flag, if it left one
            with contextlib.suppress(OSError):
                os.unlink(loan_path(self.cfg.resolved_run_dir))
        if self.staging:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None
        if not ray.is_initialized():
            return
        if self.relays is not None:
            self.relays.shutdown()
            self.relays = None
        if self.started_ray:
            ray.shutdown()
            restore_cores()  # the driver's own cores again, when it left the trainer's
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
