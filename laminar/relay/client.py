"""The two ends of the relay tier that the trainer and the rollouts hold.

    pusher = Pusher(plan, secret, cfg)            # trainer: plan from the relay group/manager
    pusher.push(model.state_dict(), version=7)    # returns once the master holds version 7

    puller = Puller(local_relay_info, cfg)        # rollout: the relay on its own node
    puller.newest_version()                       # one small file read: no copy, no RPC
    puller.pull_latest(engine)                    # -> 7, or None if nothing newer than last time

Parts:
- `stage_version`: write named tensors into a version file in shared memory (one copy, from
  the GPU this is the device-to-host copy) with a crc32 per chunk.
- `Pusher`: stages the version next to the master relay and asks the master to adopt it (a
  rename, no copy), so the trainer's stall is one copy plus one round trip whatever the chain
  length. A master on another machine is fed over the chain transport instead. If the master
  is dead, the next live relay of the chain becomes master (`plan.choose_master`).
- `Puller` / `PulledVersion`: map the newest complete version read-only and hand out named
  tensors that are zero-copy views of shared memory, for `engine.load_weights(named, version)`
  or a copy into `model.state_dict()` (to a GPU: the host-to-device copy).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from laminar.config import RelayConfig
from laminar.relay.chain import ROLE_FEED, Inbox, LinkError, call, connect, feed_version, make_transport
from laminar.relay.plan import ChainPlan, RelayInfo, choose_master
from laminar.relay.store import (Snapshot, WeightStore, checksums, finish_segment, layout, open_latest,
                                 read_latest_version, write_segment)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def stage_version(named_tensors: Mapping[str, Any], version: int, directory: str | Path, name: str,
                  chunk_bytes: int) -> Path:
    """Write tensors (torch, or numpy arrays) into a new version file `directory/name`."""
    tensors = {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v))
               for k, v in named_tensors.items()}
    header = layout(((k, _dtype_name(t), tuple(t.shape)) for k, t in tensors.items()), version, chunk_bytes)
    path = Path(directory) / name
    mm, data, fd = write_segment(path, header)
    flat = None
    try:
        flat = torch.from_numpy(np.frombuffer(data, dtype=np.uint8))
        for entry, t in zip(header.tensors, tensors.values()):
            flat[entry.offset:entry.offset + entry.nbytes].copy_(_as_bytes(t))
        header.checksums = checksums(data, header)
        finish_segment(mm, header)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        del flat
        data.release()
        mm.close()
        os.close(fd)
    return path


@dataclass(slots=True)
class PushResult:
    version: int
    master: str  # the relay that now holds the version
    seconds: float  # the trainer's stall
    failed_masters: list[str]  # masters found dead during this push


class Pusher:
    """The trainer's handle on the relay tier."""

    def __init__(self, plan: ChainPlan, secret: bytes, cfg: RelayConfig | None = None,
                 node: str | None = None) -> None:
        from laminar.relay.relay import node_id

        self.plan, self.secret, self.cfg = plan, secret, cfg or RelayConfig()
        self.node = node or node_id()
        self.dead: set[str] = set()
        self.transport = make_transport(self.cfg.transport, self.cfg.timeout_s)
        self._remote_store: WeightStore | None = None  # staging store when the master is remote

    @property
    def master(self) -> str | None:
        return choose_master(self.plan, self.dead)

    def push(self, state_dict: Mapping[str, Any], version: int) -> PushResult:
        """Put `version` into the master relay's memory and return; the chain broadcast goes on
        without the caller. A dead master is replaced by the next live relay of the chain."""
        start = time.perf_counter()
        failed: list[str] = []
        staged: Path | None = None
        try:
            while (master := self.master) is not None:
                info = self.plan.relays[master]
                try:
                    if info.node == self.node:
                        # a master that died while adopting may have taken the file with it
                        if staged is None or not staged.exists():
                            staged = stage_version(state_dict, version, self.cfg.shm_dir,
                                                   f"lam-push-{os.getpid()}.v{version}",
                                                   self.cfg.chunk_bytes)
                        call(self.transport, info.address, self.secret, "adopt",
                             version=version, path=str(staged))
                        staged = None  # renamed into the master's store
                    else:
                        self._feed_remote(info, state_dict, version)
                    return PushResult(version, master, time.perf_counter() - start, failed)
                except LinkError:
                    self.dead.add(master)
                    failed.append(master)
            raise RuntimeError(f"no live relay to push version {version} to; the chain "
                               f"{list(self.plan.order)} is all dead")
        finally:
            if staged is not None and staged.exists():
                staged.unlink()

    def set_plan(self, plan: ChainPlan) -> None:
        self.plan = plan
        self.dead &= set(plan.order)

    def _feed_remote(self, info: RelayInfo, state_dict: Mapping[str, Any], version: int) -> None:
        if self._remote_store is None:
            self._remote_store = WeightStore(self.cfg.shm_dir, f"lam-push-{os.getpid()}-store", 2)
        store = self._remote_store
        if store.get(version) is None:
            staged = stage_version(state_dict, version, self.cfg.shm_dir,
                                   f"lam-push-{os.getpid()}-store.staged", self.cfg.chunk_bytes)
            store.adopt(staged, version)
            store.publish(version)
        link = connect(self.transport, info.address, self.secret, ROLE_FEED)
        buf = store.pin(version)
        try:
            feed_version(link, Inbox(link), buf, self.cfg.timeout_s, heartbeat_s=self.cfg.heartbeat_s)
        finally:
            store.unpin(buf)
            link.close()

    def close(self) -> None:
        if self._remote_store is not None:
            self._remote_store.close()


class PulledVersion:
    """A complete version mapped read-only. `named_tensors()` are zero-copy views of shared
    memory: copy them (load_weights does) and do not write into them. The version stays held
    (its relay will not free it) until `close()` and until the last view is gone."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.version = snapshot.version

    def named_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")  # read-only by design
            for e in self.snapshot.header.tensors:
                raw = np.frombuffer(self.snapshot.data, dtype=np.uint8, count=e.nbytes, offset=e.offset)
                out[e.name] = torch.from_numpy(raw).view(getattr(torch, e.dtype)).reshape(e.shape)
        return out

    def close(self) -> None:
        self.snapshot.close()

    def __enter__(self) -> "PulledVersion":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Puller:
    """A rollout's handle on the relay of its own node."""

    def __init__(self, relay: RelayInfo, cfg: RelayConfig | None = None) -> None:
        self.cfg = cfg or RelayConfig()
        self.directory, self.prefix = self.cfg.shm_dir, relay.shm_prefix
        self.version: int | None = None  # the last version this puller delivered

    def newest_version(self) -> int | None:
        """The newest complete version at the local relay, without mapping or copying it."""
        return read_latest_version(self.directory, self.prefix)

    def open_latest(self, newer_than: int | None = None) -> PulledVersion | None:
        snap = open_latest(self.directory, self.prefix, newer_than)
        return PulledVersion(snap) if snap is not None else None

    def pull_latest(self, target: Any, newer_than: int | None = -1) -> int | None:
        """Copy the newest version into `target` if it is newer than what this puller last
        delivered (or than `newer_than`; None = always). `target` is an engine with
        `load_weights(named_tensors, version)` or a torch module. Returns the version, or None."""
        floor = self.version if newer_than == -1 else newer_than
        pulled = self.open_latest(floor)
        if pulled is None:
            return None
        with pulled:
            named = pulled.named_tensors()
            if hasattr(target, "load_weights"):
                target.load_weights(named, pulled.version)
            else:
                copy_into_module(target, named)
            del named
        self.version = pulled.version
        return pulled.version


def copy_into_module(module: torch.nn.Module, named: Mapping[str, torch.Tensor]) -> None:
    """Copy every tensor of `named` into the module's state dict, which must have the same names."""
    state = module.state_dict()
    missing, extra = sorted(set(state) - set(named)), sorted(set(named) - set(state))
    if missing or extra:
        raise ValueError(f"pulled weights do not match the model: missing {missing[:5]} "
                         f"({len(missing)} in all), unexpected {extra[:5]} ({len(extra)} in all); "
                         "push the same model's state_dict() the rollout runs")
    with torch.no_grad():
        for name, dst in state.items():
            src = named[name]
            if src.shape != dst.shape:
                raise ValueError(f"pulled tensor '{name}' has shape {tuple(src.shape)}, the model's "
                                 f"has {tuple(dst.shape)}")
            dst.copy_(src, non_blocking=False)

