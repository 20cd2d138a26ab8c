"""How a Ray job is assembled: which actors start, with what, and where (DESIGN.md §3).

    check_gpu_reservations(cfg)                      # before anything starts
    pools = start_pools(cfg, task, prompt_encoder(model_dir), policy, db, names, head)
    relays = start_relays(cfg, placement, job, secret, nodes)
    spec = rollout_spec(cfg, model_source(cfg, model_dir), ...);  spec.start(wid, relay)
    trainer, group = start_trainer(cfg, ...);  manager = start_manager(cfg, ...)
    wait_started(cfg, workers, trainer, manager, placement, node_ips)

- The three pools (one each) write RUN_DIR/pools.db: they run on the driver's node, named so
  that a restarted trainer finds them.
- `place` (placement.py, pure) decides which relay each rollout pulls from: one relay per
  node; on one machine `cluster.virtual_nodes: K` gives K relay processes, each serving its
  share of the rollouts, so the chain is real.
- One `RolloutActor` per rollout, started from a `RolloutSpec` (the manager starts a dead
  one's replacement from the same spec); the `TrainerActor` (restarted by Ray after a crash;
  ranks in a placement group when trainer.world_size > 1); the `ManagerActor`.
- GPUs: Ray shows an actor only the GPUs it reserves (`CUDA_VISIBLE_DEVICES=''` for one that
  reserves none). The trainer reserves `cluster.trainer_resources`, each rollout
  `cluster.rollout_resources`; `check_gpu_reservations` refuses `trainer.device=cuda` /
  `rollout.device=cuda` without a GPU there before anything starts.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup

from laminar.actor import ShippedDir, fingerprint, pack, pin, start_failure
from laminar.config import Config, ConfigError
from laminar.manager.actor import ManagerActor, RolloutSpec
from laminar.models.builder import load_tokenizer
from laminar.pools.build import pool_specs
from laminar.pools.prompts import PromptEncoder
from laminar.pools.resume import ResumeSummary, claim_run_dir, prepare_pools
from laminar.relay.actor import RelayGroup
from laminar.rollout.policy import Policy
from laminar.runtime.placement import Placement
from laminar.runtime.raytools import LIGHT, THREADED, ray_resources, wait_all
from laminar.tasks import Task
from laminar.trainer.actor import TrainerActor, start_trainer_group
from laminar.trainer.service import newest_checkpoint


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


def job_secret(cfg: Config) -> bytes:
    """The job's secret: `$relay.secret_env` if set, else a fresh random one."""
    return (os.environ.get(cfg.relay.secret_env) or secrets.token_hex(16)).encode()


def actor_names(job: str) -> dict[str, str]:
    """Named actors, so that a restarted trainer finds them by name."""
    return {k: f"laminar-{job}-{k}" for k in ("prompts", "partials", "buffer", "trainer")}


def prepare_job_pools(cfg: Config, start_version: int, policy: Policy,
                      job: str) -> tuple[str | None, ResumeSummary | None]:
    """RUN_DIR/pools.db (None: pools in memory) and, when the job resumes, what the
    reconciliation of the killed job's pools did (printed); the run directory is claimed for
    `job`."""
    ckpt = newest_checkpoint(cfg.resolved_run_dir) if cfg.resume else None
    db, summary = prepare_pools(cfg, start_version if ckpt else None, start_version,
                                policy.mixes_versions)
    if summary is not None:
        print(f"resume: {summary.line()}", flush=True)
    claim_run_dir(cfg.resolved_run_dir, job, cfg.relay.shm_dir)
    return db, summary


def prompt_encoder(model_dir: str) -> PromptEncoder:
    """A prompt's token ids, picklable without transformers (the prompt pool's process)."""
    return PromptEncoder.of(load_tokenizer(model_dir))


def start_pools(cfg: Config, task: Task, encode: PromptEncoder, policy: Policy, db: str | None,
                names: dict[str, str], head: str | None) -> dict[str, ActorHandle]:
    """The prompt pool, the partial pool and the experience buffer (pools/build.py), one named
    actor each on `head` (the driver's node: they write RUN_DIR/pools.db)."""
    here = {**LIGHT, **pin(head)}
    specs = pool_specs(cfg, task.train, encode, policy.max_outstanding, db)
    return {k: ray.remote(spec.cls).options(**here, name=names[k]).remote(*spec.args, **spec.kwargs)
            for k, spec in specs.items()}


def start_relays(cfg: Config, placement: Placement, job: str, secret: bytes,
                 nodes: dict[str, str] | None) -> RelayGroup:
    """One relay per (virtual) node, chained; on a real cluster, the placement is printed."""
    options = {r: pin(n) for r, n in placement.relay_node.items()}
    relays = RelayGroup(placement.relay_ids, job, secret, cfg.relay, options,
                        {r: (nodes or {}).get(n) for r, n in placement.relay_node.items()},
                        timeout_s=cfg.cluster.wait_timeout_s)
    if nodes:
        print("placement: " + "; ".join(
            f"relay {r} on {nodes[n]}" + ("" if k else " (master, with the trainer)") + ": "
            + (", ".join(w for w, rr in placement.worker_relay.items() if rr == r) or "no rollouts")
            for k, (r, n) in enumerate(placement.relay_node.items())), flush=True)
    return relays


def model_source(cfg: Config, model_dir: str) -> str | ShippedDir:
    """The starting model as rollouts get it: its path on one machine; on a cluster, the
    directory through the object store for nodes that do not have it (laminar/actor.py)."""
    if not cfg.cluster.address:
        return model_dir
    d = Path(model_dir)
    return ShippedDir(str(d), fingerprint(d), ray.put(pack(d)))


def rollout_spec(cfg: Config, source: str | ShippedDir, start_version: int, relays: RelayGroup,
                 placement: Placement, pools: dict[str, ActorHandle], policy: Policy) -> RolloutSpec:
    """How a rollout actor starts; the manager starts a dead one's replacement from it."""
    reserve = ray_resources(cfg.cluster.rollout_resources)  # e.g. a share of a GPU
    return RolloutSpec(cfg, source, start_version,
                       {r: info.to_dict() for r, info in relays.infos.items()},
                       {r: {**THREADED, **pin(n), **reserve} for r, n in placement.relay_node.items()},
                       pools, ray.put(policy))


def start_trainer(cfg: Config, model_dir: str, source: str | ShippedDir, relays: RelayGroup,
                  secret: bytes, names: dict[str, str], head: str | None,
                  head_ip: str | None) -> tuple[ActorHandle, PlacementGroup | None]:
    """The trainer actor (rank 0) and, when trainer.world_size > 1, its ranks' placement group
    (rank 0 starts the others); Ray restarts it after a crash (trainer.max_restarts)."""
    if cfg.trainer.world_size > 1:
        return start_trainer_group(cfg, model_dir, source, relays.plan.to_dict(), secret, names, head_ip)
    trainer_opts = ({**THREADED, **ray_resources(cfg.cluster.trainer_resources)}
                    if cfg.cluster.trainer_resources else {**THREADED, **pin(head)})
    trainer = ray.remote(TrainerActor).options(
        **trainer_opts, name=names["trainer"], max_restarts=cfg.trainer.max_restarts).remote(
        cfg, model_dir, relays.plan.to_dict(), secret, names)
    return trainer, None


def start_manager(cfg: Config, workers: dict[str, ActorHandle], placement: Placement,
                  pools: dict[str, ActorHandle], relays: RelayGroup, names: dict[str, str],
                  policy: Policy, spec: RolloutSpec, head: str | None) -> ActorHandle:
    """The rollout manager: health, failover, repack (when the schedule allows it), elasticity."""
    repack = cfg.manager.repack and policy.repacks
    return ray.remote(ManagerActor).options(**THREADED, **pin(head)).remote(
        cfg, workers, dict(placement.worker_relay), pools, relays, names["trainer"], repack,
        policy.mixes_versions, spec)


def wait_started(cfg: Config, workers: dict[str, ActorHandle], trainer: ActorHandle,
                 manager: ActorHandle, placement: Placement, node_ips: dict[str, str]) -> None:
    """Every rollout, the trainer and the manager answer once; one that failed to start is
    an error naming it and its node (e.g. a reward module that node cannot import)."""
    refs = ({f"rollout worker {w}": h.snapshot.remote() for w, h in workers.items()}
            | {"trainer": trainer.metrics_since.remote(0), "rollout manager": manager.stats.remote()})
    try:
        wait_all(refs, cfg.cluster.wait_timeout_s)
    except ray.exceptions.RayActorError:
        for name, ref in refs.items():
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError as e:
                wid = name.removeprefix("rollout worker ")
                relay = placement.worker_relay.get(wid)
                node = node_ips.get(placement.relay_node.get(relay) or "", "")
                kind, message = start_failure(e)
                # the user's setup (a module a node cannot import): one line; else a bug
                error = ConfigError if kind == "ConfigError" else RuntimeError
                raise error(f"{name}{f' on node {node}' if node else ''} failed to "
                            f"start: {message}") from None
            except Exception:
                continue
        raise
