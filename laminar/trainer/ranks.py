"""The data-parallel trainer group: N processes, one torch process group; rank 0 leads.

    store = rendezvous(host)                                   # rank 0: picks a free port
    ranks = Ranks.join(store, 0, world_size, timeout_s)        # every rank, once all have come
    model = shard(model, ranks, "full")                        # FSDP2 (or DDP: "none")
    ranks.call(trainer, Trainer.train_shard, per_rank_args)    # rank 0: every rank runs it
    follow(trainer, ranks)                                     # ranks 1..N-1: run what rank 0 calls
    spawn_ranks(2, main, *args)                                # a local group without Ray

Parts:
- `Ranks`: this process's place in the group (rank, world size, device, the device mesh FSDP
  shards over) and the command channel. Only rank 0 is seen by the rest of the system; it
  scatters a function and each rank's arguments, every rank runs the function on its own
  `Trainer` (so the collectives inside meet, in the same order), rank 0 gathers the answers.
  A rank that dies makes the next collective fail at once (gloo: connection closed): `call`
  raises `RankLost`, and the group is finished (the Ray shell restarts it from a checkpoint).
- `split_by_tokens`, `plan_micro_batches` (pure): sequences go to ranks longest first, each to
  the rank with the fewest tokens so far; each rank cuts its share into micro-batches by the
  token budget. Ranks then run the same number of micro-batches (one with fewer pads with empty
  ones: under FSDP every forward and backward is a collective).
- `shard`: FSDP2 `fully_shard` per decoder layer and on the root, or a DDP wrapper;
  `use_interface_of`: the group's connections go over the interface holding the node's address.
- `spawn_ranks`: N local processes forming a group, no Ray (tests, `laminar bench trainer`).
- `rank_bundles`, `fit_problem` (pure): the Ray resources of each rank, and why N ranks do not
  fit a cluster's nodes (None when they do).
"""

from __future__ import annotations

import datetime
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from laminar.config import ConfigError
from laminar.devices import resolve_device
from laminar.relay.address import local_interfaces
from laminar.trainer.batching import token_budget_batches


class RankLost(RuntimeError):
    """A collective of the trainer group failed (a rank died, or a step raised on one rank
    while the others waited in a collective): the group cannot go on."""


def rendezvous(host: str, timeout_s: float = 300.0) -> dist.TCPStore:
    """Rank 0's key-value store for the group to meet at, on a free port of `host`."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


@dataclass
class Ranks:
    rank: int
    world_size: int
    device: torch.device
    mesh: Any  # torch DeviceMesh over all ranks (what FSDP shards over)
    control: Any  # process group for Python objects: gloo, also when tensors go over nccl

    @classmethod
    def join(cls, store: dist.Store | None, rank: int, world_size: int, timeout_s: float,
             host: str = "", port: int = 0, node_ip: str | None = None,
             device: str = "auto") -> "Ranks":
        """Join the group (rank 0 passes the store `rendezvous` made, the others its host and
        port). `device` is trainer.device: on a GPU (`auto` where this process sees one, or
        `cuda`) the group is nccl, on the CPU gloo. `node_ip`: this node's cluster address; the
        group's connections use the interface that holds it."""
        from torch.distributed.device_mesh import init_device_mesh

        cuda = resolve_device(device, "trainer.device").type == "cuda"  # before any waiting
        if node_ip:
            use_interface_of(node_ip)
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=timeout)
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        control = dist.new_group(backend="gloo", timeout=timeout) if cuda else None
        return cls(rank, world_size, device, init_device_mesh(device.type, (world_size,)), control)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def call(self, target: Any, fn: Callable[..., Any], args: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Rank 0: every rank runs `fn(its target, *args[rank])`; returns every rank's answer.
        Any failure leaves the other ranks inside a collective, so it is `RankLost`."""
        if len(args) != self.world_size:
            raise ValueError(f"{len(args)} argument tuples for {self.world_size} ranks")
        try:
            fn_args = self._scatter([(fn, a) for a in args])[1]
            answer = fn(target, *fn_args)
            return self._gather(answer)
        except Exception as e:
            raise RankLost(f"trainer rank group failed in {fn.__qualname__}: {e}") from e

    def call_all(self, target: Any, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`call` with the same arguments for every rank."""
        return self.call(target, fn, [args] * self.world_size)

    def stop(self) -> None:
        """Rank 0: the followers return from `follow`; then the group is taken down."""
        self._scatter([(None, ())] * self.world_size)
        dist.destroy_process_group()

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def all_reduce_sum(self, values: Mapping[str, float]) -> dict[str, float]:
        """Sum a dict of floats over the ranks (every rank passes the same keys)."""
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t, group=self.control)
        return dict(zip(keys, t.tolist()))

    def _scatter(self, items: list[Any] | None) -> Any:
        out: list[Any] = [None]
        dist.scatter_object_list(out, items if self.rank == 0 else None, src=0, group=self.control)
        return out[0]

    def _gather(self, item: Any) -> list[Any]:
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(item, out, dst=0, group=self.control)
        return out or []


def use_interface_of(ip: str) -> None:
    """gloo and nccl advertise the address of the interface named by GLOO_SOCKET_IFNAME /
    NCCL_SOCKET_IFNAME, else whatever the hostname resolves to (often loopback, which a rank on
    another node cannot reach): name the interface holding `ip`, unless the user did."""
    name = next((n for n, addresses in local_interfaces().items() if ip in addresses), None)
    if name is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


def shard(model: torch.nn.Module, ranks: Ranks, sharding: str, frozen: bool = False) -> torch.nn.Module:
    """Spread `model` over the ranks as trainer.sharding says. `full` / `grad_op`: FSDP2
    `fully_shard` on every decoder layer (the model's `_no_split_modules`), then on the root
    (`grad_op` on CPU: the root alone);
    parameters stay sharded in place, so the module is returned as it is. `none`: a DDP wrapper
    (frozen models stay plain replicas: they have no gradients to reduce)."""
    if sharding == "none":
        if frozen:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [ranks.device] if ranks.device.type == "cuda" else None
        with warnings.catch_warnings():  # the newer name is not in every torch the range admits
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*deprecated")
            return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        raise ConfigError(f"trainer.sharding={sharding} uses FSDP2 (torch.distributed.fsdp."
                          f"fully_shard), which torch {torch.__version__} lacks: install torch "
                          ">= 2.6, or set trainer.sharding=none (DDP)") from None

    keep = sharding == "grad_op" and not frozen  # keep gathered weights from forward to backward
    # grad_op holds every layer gathered through an update anyway; per-layer units only buy the
    # overlap of a layer's transfer with another's compute, which needs a device that computes
    # while the transfer runs (CUDA streams). On CPU (gloo) the whole model is one unit: the
    # same bytes in fewer collectives, fewer hooks (docs/trainer.md: 3-4% of throughput here)
    units = (set() if keep and ranks.device.type == "cpu" else
             set(getattr(model, "_no_split_modules", None) or ()))
    for module in list(model.modules()):
        if type(module).__name__ in units:
            fully_shard(module, mesh=ranks.mesh, reshard_after_forward=not keep)
    fully_shard(model, mesh=ranks.mesh, reshard_after_forward=not keep)
    return model


def follow(target: Any, ranks: Ranks) -> None:
    """Ranks 1..N-1: run what rank 0 calls, in order, until it stops the group."""
    while True:
        fn, args = ranks._scatter(None)
        if fn is None:
            dist.destroy_process_group()
            return
        ranks._gather(fn(target, *args))


def spawn_ranks(world_size: int, main: Callable[..., Any], *args: Any, threads: int = 1,
                timeout_s: float = 600.0, device: str = "auto") -> Any:
    """Run `main(ranks, *args)` in `world_size` fresh local processes forming one group (no
    Ray: tests and `laminar bench trainer`); returns rank 0's answer, after which the group is
    stopped. `main` must be importable (a module-level function); on ranks 1..N-1 it ends in
    `follow`. One process gets `ranks=None` (no process group, as trainer.world_size=1 runs).
    `device`: trainer.device of the ranks (laminar/devices.py)."""
    import multiprocessing as mp
    import queue

    host = "127.0.0.1"
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, host, store.port, threads, timeout_s,
                                                  answers, main, args, device), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        rank, ok, value = answers.get(timeout=timeout_s)
    except queue.Empty:
        raise TimeoutError(f"{world_size} local trainer ranks gave no answer within {timeout_s:.0f}s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if not ok:
        raise RuntimeError(f"trainer rank {rank} failed:\n{value}")
    import pickle

    return pickle.loads(value)


def _rank_main(rank: int, world_size: int, host: str, port: int, threads: int, timeout_s: float,
               answers: Any, main: Callable[..., Any], args: tuple[Any, ...],
               device: str = "auto") -> None:
    import pickle
    import traceback

    torch.set_num_threads(threads)
    try:
        ranks = (Ranks.join(None, rank, world_size, timeout_s, host, port, device=device)
                 if world_size > 1 else None)
        value = main(ranks, *args)
        if rank == 0:
            if ranks is not None:
                ranks.stop()
            answers.put((rank, True, pickle.dumps(value)))  # by value: this process ends now
    except BaseException:
        answers.put((rank, False, traceback.format_exc()))
        raise


# --------------------------------------------------------------------------------------- pure


def split_by_tokens(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Indices into `lengths` dealt to `parts` ranks, balanced by tokens: longest first, each to
    the rank with the fewest tokens so far (the lower rank on ties). Each list is ascending."""
    load = [0] * parts
    shares: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min(range(parts), key=lambda r: load[r])
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


def plan_micro_batches(lengths: Sequence[int], parts: int, max_tokens: int) -> list[list[list[int]]]:
    """Per rank, its micro-batches as indices into `lengths`: its share by `split_by_tokens`,
    cut by `token_budget_batches`. With one part this is `[token_budget_batches(lengths, ...)]`."""
    plan = []
    for share in split_by_tokens(lengths, parts):
        groups = token_budget_batches([lengths[i] for i in share], max_tokens)
        plan.append([[share[j] for j in g] for g in groups])
    return plan


def rank_bundles(world_size: int, threads: int, resources: Mapping[str, float],
                 head_ip: str | None = None) -> list[dict[str, float]]:
    """The Ray placement-group bundle of each rank: trainer.threads CPUs plus
    cluster.trainer_resources; rank 0's is pinned to the driver's node (`head_ip`, where the
    master relay is) on a real cluster."""
    bundle = {"CPU": float(threads), **{k: float(v) for k, v in resources.items()}}
    first = {**bundle, f"node:{head_ip}": 0.001} if head_ip else dict(bundle)
    return [first] + [dict(bundle) for _ in range(world_size - 1)]


def fit_problem(bundles: Sequence[Mapping[str, float]],
                nodes: Mapping[str, Mapping[str, float]]) -> str | None:
    """Why `bundles` cannot be placed on `nodes` (address -> total resources), or None. First
    fit in order, which is exact here: the bundles are equal but for rank 0's node pin."""
    free = {n: dict(r) for n, r in nodes.items()}
    for k, bundle in enumerate(bundles):
        node = next((n for n, r in free.items()
                     if all(r.get(key, 0.0) >= need for key, need in bundle.items())), None)
        if node is None:
            plain = {key: v for key, v in bundle.items() if not key.startswith("node:")}
            have = "; ".join(f"{n}: " + ", ".join(f"{key} {v:g}" for key, v in sorted(r.items())
                                                   if key in plain) for n, r in nodes.items())
            pinned = " (rank 0 on the driver's node)" if len(plain) < len(bundle) else ""
            return (f"{len(bundles)} trainer ranks of {_fmt(plain)} each do not fit: only {k} "
                    f"can be placed{pinned}; the nodes have {have or 'nothing'}")
        for key, need in bundle.items():
            free[node][key] -= need
    return None


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"
