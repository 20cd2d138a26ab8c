"""The trainer as Ray actors: `TrainerService` with the pool actors and the relay pusher.

    handle, group = start_trainer_group(cfg, ...)   # trainer.world_size > 1 (the runtime)

The runtime starts `TrainerActor` with `max_restarts`: a trainer process that dies is started
again by Ray with the same arguments, finds the pools by name (a restarted actor must not hold
other actors' handles in its constructor arguments), and recovers from the run's newest
checkpoint.

With trainer.world_size = N, `TrainerActor` is rank 0 and the only trainer the rest of the
system talks to. `start_trainer_group` checks that N ranks fit the cluster and reserves a
placement group (one bundle per rank, spread over nodes where possible, rank 0's on the
driver's node); rank 0 starts ranks 1..N-1 (`TrainerRank`, owned by it, so they die with it)
in the other bundles, and they form the process group (laminar/trainer/ranks.py). A rank that
dies makes the group's next collective fail: rank 0 then exits, so Ray restarts it, and the
new rank 0 starts a new group from the newest checkpoint; the driver sees `TrainerRestarted`
as for a one-process trainer.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch

from laminar.actor import materialize, start_failure
from laminar.config import Config, ConfigError
from laminar.devices import pin_cpus
from laminar.models import load_pretrained
from laminar.relay.client import Pusher
from laminar.relay.plan import ChainPlan
from laminar.relay.version import VersionHeader
from laminar.trainer.ranks import RankLost, Ranks, fit_problem, follow, rank_bundles, rendezvous
from laminar.trainer.service import TrainerService
from laminar.trainer.trainer import Trainer
from laminar.types import Trajectory

log = logging.getLogger("laminar.trainer")
SEEN = "trainer-ranks.token"  # in RUN_DIR: rank 0 writes it, every other rank must read it


class RayTrainerData:
    def __init__(self, pool_names: dict[str, str], timeout_s: float) -> None:
        self.prompts = ray.get_actor(pool_names["prompts"])
        self.buffer = ray.get_actor(pool_names["buffer"])
        self.timeout_s = timeout_s

    def sample(self, num_groups: int, trainer_version: int) -> list[list[Trajectory]] | None:
        return ray.get(self.buffer.sample.remote(num_groups, trainer_version), timeout=self.timeout_s)

    def consumed(self, num_groups: int) -> None:
        self.prompts.mark_consumed.remote(num_groups)

    def ack(self, version: int) -> None:
        self.buffer.ack.remote(version)

    def rewind(self, version: int | None) -> int:
        return ray.get(self.buffer.rewind.remote(version), timeout=self.timeout_s)

    def counts(self) -> dict[str, int]:
        return ray.get(self.buffer.counts.remote(), timeout=self.timeout_s)

    def prompt_state(self) -> dict[str, Any]:
        return ray.get(self.prompts.state_dict.remote(), timeout=self.timeout_s)

    def load_prompt_state(self, state: dict[str, Any]) -> None:
        ray.get(self.prompts.load_state_dict.remote(state), timeout=self.timeout_s)


class RelayPush:
    def __init__(self, pusher: Pusher) -> None:
        self.pusher = pusher

    def push(self, named: dict[str, torch.Tensor], version: int) -> float:
        return self.pusher.push(named, version).seconds

    def push_parts(self, header: VersionHeader, fill: Callable[[memoryview, Path], None]) -> float:
        return self.pusher.push_parts(header, fill).seconds


class TrainerActor(TrainerService):
    def __init__(self, cfg: Config, model_dir: str, plan: dict[str, Any], secret: bytes,
                 pool_names: dict[str, str], group: dict[str, Any] | None = None) -> None:
        """`group` (world size > 1): {"pg": the placement group, "bundles": its bundles,
        "model": the starting model as ranks on other nodes get it (a path or a
        actor.ShippedDir)}."""
        pin_cpus(cfg, None)  # cluster.cpu_affinity=split: the trainer's own cores
        self.pusher = Pusher(ChainPlan.from_dict(plan), secret, cfg.relay)
        with warnings.catch_warnings():  # Ray's own property trips its deprecation warning
            warnings.simplefilter("ignore")
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        ranks, self.ranks_started = None, []
        if group is not None:
            ranks = self._start_group(cfg, group)
        self._or_restart(lambda: TrainerService.__init__(  # it loads a checkpoint on every rank
            self, cfg, model_dir, RayTrainerData(pool_names, cfg.cluster.wait_timeout_s),
            RelayPush(self.pusher), restarted, ranks))
        # every rank built its shard of the model: they answer with their process ids
        self.rank_pids = [os.getpid()] + ray.get(self.ranks_started, timeout=cfg.cluster.wait_timeout_s)

    def _start_group(self, cfg: Config, group: dict[str, Any]) -> Ranks:
        """Start ranks 1..N-1 in the placement group's other bundles and join them. A rank that
        fails to start is an error naming it, not a wait for the rendezvous timeout."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n, timeout = cfg.trainer.world_size, cfg.cluster.wait_timeout_s
        host = ray.util.get_node_ip_address()
        store = rendezvous(host, timeout)
        token = os.urandom(8).hex()  # every rank must see the run directory (checkpoints)
        cfg.resolved_run_dir.mkdir(parents=True, exist_ok=True)
        (cfg.resolved_run_dir / SEEN).write_text(token)
        self.followers = [
            ray.remote(TrainerRank).options(
                **actor_resources(group["bundles"][r]), scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group["pg"], placement_group_bundle_index=r)).remote(cfg, group["model"], r)
            for r in range(1, n)]
        self.ranks_started = [f.start.remote(host, store.port, token) for f in self.followers]
        self.following = [f.run.remote() for f in self.followers]  # after start: one call at a time
        watch = {ref: (r, "start") for r, ref in enumerate(self.ranks_started, 1)}
        watch |= {ref: (r, "run") for r, ref in enumerate(self.following, 1)}
        # join in a daemon thread, which may stay blocked: a failed rank never comes to meet
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["ranks"] = Ranks.join(store, 0, n, timeout, node_ip=host,
                                             device=cfg.trainer.device)
            except BaseException as e:
                joined["error"] = e

        joining = threading.Thread(target=join, daemon=True, name="trainer-rendezvous")
        joining.start()
        while joining.is_alive():
            done, _ = ray.wait(list(watch), timeout=0.2)
            for ref in done:
                rank, what = watch.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as e:
                    cause = getattr(e, "cause", None)
                    if isinstance(cause, ConfigError):  # the user's setup: one line, as it is
                        raise ConfigError(str(cause)) from None
                    raise RuntimeError(f"trainer rank {rank} failed to start: "
                                       f"{start_failure(e)[1]}") from None
                if what == "run":
                    raise RuntimeError(f"trainer rank {rank} stopped before the group formed")
        if "error" in joined:
            raise joined["error"]
        return joined["ranks"]

    def _or_restart(self, call: Callable[[], Any]) -> Any:
        """A rank died (or one rank's step failed with the others inside a collective): the
        group is gone, so this process exits and Ray starts the trainer group again."""
        try:
            return call()
        except RankLost:
            log.exception("the trainer group lost a rank; restarting it from the newest checkpoint")
            os._exit(1)

    def train_once(self) -> dict[str, Any]:
        return self._or_restart(super().train_once)

    def train_streaming(self) -> dict[str, Any]:
        return self._or_restart(super().train_streaming)

    def train_next(self) -> dict[str, Any]:
        return self._or_restart(super().train_next)

    def run(self, total_steps: int) -> int:
        return self._or_restart(lambda: super(TrainerActor, self).run(total_steps))

    def pid(self) -> int:
        return os.getpid()

    def pids(self) -> list[int]:
        """Process ids of the trainer's ranks, rank 0 first."""
        return self.rank_pids

    def set_plan(self, plan: dict[str, Any]) -> None:
        """The relay chain changed (the manager repaired it)."""
        self.pusher.set_plan(ChainPlan.from_dict(plan))


class TrainerRank:
    """Rank 1..N-1 of the trainer group: its shard of the model and optimizer, and `follow`
    (whatever rank 0 calls, it runs too)."""

    def __init__(self, cfg: Config, model: Any, rank: int) -> None:
        self.cfg, self.model_source, self.rank = cfg, model, rank

    def start(self, host: str, port: int, token: str) -> int:
        cfg = self.cfg
        seen = cfg.resolved_run_dir / SEEN
        if not seen.is_file() or seen.read_text() != token:
            raise ConfigError(
                f"trainer rank {self.rank} on {ray.util.get_node_ip_address()} does not see the run "
                f"directory {cfg.resolved_run_dir} as rank 0 does (every rank writes its shards of "
                "a checkpoint there): set run_dir to a folder every trainer node mounts (a shared "
                "filesystem), or run the ranks on one node")
        pin_cpus(cfg, None)
        torch.set_num_threads(cfg.trainer.threads)
        torch.manual_seed(cfg.trainer.seed)
        self.ranks = Ranks.join(None, self.rank, cfg.trainer.world_size, cfg.cluster.wait_timeout_s,
                                host, port, node_ip=ray.util.get_node_ip_address(),
                                device=cfg.trainer.device)
        model, tokenizer = load_pretrained(materialize(self.model_source), cfg.model.attn_implementation)
        self.trainer = Trainer(model, cfg.trainer, tokenizer.pad_token_id, cfg.rollout.temperature,
                               self.ranks)
        return os.getpid()

    def run(self) -> None:
        if not hasattr(self, "trainer"):
            return  # `start` failed, and rank 0 has its error
        try:
            follow(self.trainer, self.ranks)
        except BaseException:  # rank 0 must learn at once, not at a collective's timeout
            log.exception("trainer rank %d failed", self.rank)
            os._exit(1)


def start_trainer_group(cfg: Config, model_dir: str, model_source: Any, plan: dict[str, Any],
                        secret: bytes, names: dict[str, str], head_ip: str | None) -> tuple[Any, Any]:
    """trainer.world_size > 1: reserve a placement group for the ranks (a ConfigError when
    they cannot fit the cluster) and start rank 0 in its first bundle. Returns (rank 0's
    handle, the placement group; remove it when the job ends)."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    n = cfg.trainer.world_size
    bundles = rank_bundles(n, cfg.trainer.threads, cfg.cluster.trainer_resources, head_ip)
    nodes = {node["NodeManagerAddress"]: node["Resources"] for node in ray.nodes() if node["Alive"]}
    problem = fit_problem(bundles, nodes)
    if problem is None:
        pg = placement_group(bundles, strategy=cfg.cluster.trainer_placement.upper(),
                             name=f"{names['trainer']}-ranks")
        if pg.wait(timeout_seconds=int(cfg.cluster.wait_timeout_s)):
            handle = ray.remote(TrainerActor).options(
                max_concurrency=8, **actor_resources(bundles[0]), name=names["trainer"],
                max_restarts=cfg.trainer.max_restarts,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            ).remote(cfg, model_dir, plan, secret, names, {"pg": pg, "model": model_source,
                                                         "bundles": bundles})
            return handle, pg
        remove_placement_group(pg)
        problem = (f"the cluster has room for them in all, but they could not be placed within "
                   f"cluster.wait_timeout_s={cfg.cluster.wait_timeout_s:g}s (other jobs hold the "
                   "resources?)")
    fix = ("lower trainer.world_size or trainer.threads, or add nodes" if cfg.cluster.address else
           "lower trainer.world_size or trainer.threads, or raise cluster.num_cpus (the CPUs of "
           "the embedded cluster)")
    raise ConfigError(f"trainer.world_size={n}: {problem}; {fix}")


def actor_resources(bundle: dict[str, float]) -> dict[str, Any]:
    """Ray actor options that take a placement-group bundle's resources (not its node pin)."""
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU") and not k.startswith("node:")}
    return {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0),
            **({"resources": custom} if custom else {})}
