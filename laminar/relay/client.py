"""The two ends of the relay tier that the trainer and the rollouts hold.

    pusher = Pusher(plan, secret, cfg)            # trainer: plan from the relay group/manager
    pusher.push(model.state_dict(), version=7)    # returns once the master holds version 7

    puller = Puller(local_relay_info, cfg)        # rollout: the relay on its own node
    puller.newest_version()                       # one small file read: no copy, no RPC
    puller.pull_latest(engine)                    # -> 7, or None if nothing newer than last time

Parts:
- `Pusher`: asks the master relay for a slot, writes the version straight into it (the
  mapping is kept across pushes, so no page is faulted in twice) and has the master publish
  it: the trainer's stall is one copy plus two round trips, whatever the chain length. A
  master on another machine is fed over the chain transport instead. If the master is dead,
  the next live relay of the chain becomes master (`plan.choose_master`). `push_parts` is the
  same with the caller writing the bytes (each rank of a sharded trainer its own rows).
- `Puller` / `PulledVersion`: hold the newest complete version of the local relay and hand out
  named tensors that are zero-copy views of shared memory, for
  `engine.load_weights(named, version)` or a copy into `model.state_dict()` (to a GPU: the
  host-to-device copy).
"""

from __future__ import annotations

import mmap
import os
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from laminar.config import RelayConfig
from laminar.devices import StagingBuffer, load_into_module
from laminar.engine.protocol import WeightTarget
from laminar.relay.address import node_id
from laminar.relay.chain import Inbox, feed_version, request
from laminar.relay.pack import prepare_version, write_version
from laminar.relay.plan import ChainPlan, RelayInfo, choose_master
from laminar.relay.reader import ShmReader, Snapshot
from laminar.relay.store import WeightStore
from laminar.relay.transport import (ROLE_CONTROL, ROLE_FEED, Link, LinkError, connect,
                                     make_transport)
from laminar.relay.version import VersionHeader, write_header


class _SlotWriter:
    """A pusher's mapping of one of the master's slots, kept across pushes."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR)
        st = os.fstat(self.fd)
        self.ino, self.size = st.st_ino, st.st_size
        self.mm = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)


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
        self.plan, self.secret, self.cfg = plan, secret, cfg or RelayConfig()
        self.node = node or node_id(self.cfg.shm_dir)
        self.dead: set[str] = set()
        self.transport = make_transport(self.cfg.transport, self.cfg.timeout_s)
        self._remote_store: WeightStore | None = None  # staging store when the master is remote
        self._writers: dict[Path, _SlotWriter] = {}  # mappings of the master's slots
        self._links: dict[str, Link] = {}  # open control connections, by relay id

    @property
    def master(self) -> str | None:
        return choose_master(self.plan, self.dead)

    def push(self, state_dict: Mapping[str, Any], version: int) -> PushResult:
        """Put `version` into the master relay's memory and return; the chain broadcast goes on
        without the caller. A dead master is replaced by the next live relay of the chain."""
        start = time.perf_counter()
        header, tensors = prepare_version(state_dict, version, self.cfg.chunk_bytes)
        return self.push_parts(header, lambda data, path: write_version(data, header, tensors), start)

    def push_parts(self, header: VersionHeader, fill: Callable[[memoryview, Path], None],
                   start: float | None = None) -> PushResult:
        """`push` of a version whose bytes the caller writes: `fill(data, path)` fills the flat
        buffer `data` and sets `header.checksums`; `data` lies in the file `path` from
        `header.data_offset` on, so other processes of this machine may write parts of it
        (the ranks of a sharded trainer)."""
        start = time.perf_counter() if start is None else start
        failed: list[str] = []
        while (master := self.master) is not None:
            info = self.plan.relays[master]
            try:
                if info.node == self.node:
                    self._push_local(info, header, fill)
                else:
                    self._push_remote(info, header, fill)
                return PushResult(header.version, master, time.perf_counter() - start, failed)
            except LinkError:
                self.dead.add(master)
                failed.append(master)
        raise RuntimeError(f"no live relay to push version {header.version} to; the chain "
                           f"{list(self.plan.order)} is all dead")

    def set_plan(self, plan: ChainPlan) -> None:
        self.plan = plan
        self.dead &= set(plan.order)

    def _request(self, info: RelayInfo, op: str, **args: Any) -> Any:
        """A request on a control connection kept open across pushes. A connection that broke
        is reopened once before the relay counts as dead (it may just have been idle-closed)."""
        for attempt in (0, 1):
            link = self._links.get(info.id)
            if link is None:
                link = self._links[info.id] = connect(self.transport, info.address, self.secret,
                                                      ROLE_CONTROL)
            try:
                return request(link, op, **args)
            except LinkError:
                self._links.pop(info.id).close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _push_local(self, info: RelayInfo, header: VersionHeader,
                    fill: Callable[[memoryview, Path], None]) -> None:
        """Write straight into a slot the master reserved, then have it publish: one copy."""
        reply = self._request(info, "reserve", header=header.to_bytes().decode())
        path = Path(reply["slot"])
        for gone in [p for p in self._writers if p != path and not p.exists()]:
            self._writers.pop(gone).close()  # the master removed that slot: free our mapping
        w = self._writers.get(path)
        if w is None or os.stat(path).st_ino != w.ino or w.size < header.file_size:
            if w is not None:
                w.close()
            w = self._writers[path] = _SlotWriter(path)
        data = memoryview(w.mm)[header.data_offset:header.file_size]
        try:
            fill(data, path)
        finally:
            data.release()
        write_header(w.mm, header)
        self._request(info, "commit", version=header.version)

    def _push_remote(self, info: RelayInfo, header: VersionHeader,
                     fill: Callable[[memoryview, Path], None]) -> None:
        """The master is on another machine: stage the version locally, feed it over the chain
        transport; returns once the master holds it."""
        if self._remote_store is None:
            self._remote_store = WeightStore(self.cfg.shm_dir, f"lam-push-{os.getpid()}", 2)
        store = self._remote_store
        if store.get(header.version) is None:
            buf = store.create(header, header_final=False)
            fill(buf.data, buf.path)
            store.finish(buf, header)
            store.publish(header.version)
        link = connect(self.transport, info.address, self.secret, ROLE_FEED)
        buf = store.pin(header.version)
        try:
            feed_version(link, Inbox(link), buf, self.cfg.timeout_s, heartbeat_s=self.cfg.heartbeat_s)
        finally:
            store.unpin(buf)
            link.close()

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
        for w in self._writers.values():
            w.close()
        self._writers.clear()
        if self._remote_store is not None:
            self._remote_store.close()


class PulledVersion:
    """A complete version, held (its relay will not overwrite it) until `close()`.
    `named_tensors()` are zero-copy, read-only views of shared memory that are valid only until
    then: copy them (load_weights does) and do not write into them."""

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
        here = node_id(self.cfg.shm_dir)
        if relay.node and relay.node != here:  # its shared memory is not this machine's
            raise RuntimeError(
                f"relay {relay.id} ({relay.host}:{relay.port}) is on another node ({relay.node}) "
                f"than this rollout ({here}): a rollout reads only its own node's relay, through "
                "shared memory. This is a placement bug: please report it")
        self.reader = ShmReader(self.cfg.shm_dir, relay.shm_prefix)
        self.version: int | None = None  # the last version this puller delivered

    def newest_version(self) -> int | None:
        """The newest complete version at the local relay, without mapping or copying it."""
        return self.reader.newest_version()

    def open_latest(self, newer_than: int | None = None) -> PulledVersion | None:
        snap = self.reader.open_latest(newer_than)
        return PulledVersion(snap) if snap is not None else None

    def pull_latest(self, target: WeightTarget | torch.nn.Module, newer_than: int | None = None,
                    force: bool = False) -> int | None:
        """Copy the newest version into `target` if it is newer than `newer_than` (default: than
        what this puller last delivered); `force` copies it in any case. `target` is a torch
        module (its `state_dict()` is overwritten, same names) or a `WeightTarget` (a rollout
        engine, or the LoRA merge in front of one: `load_weights(named, version)`). Returns the
        version, or None when nothing newer is there."""
        floor = None if force else newer_than if newer_than is not None else self.version
        pulled = self.open_latest(floor)
        if pulled is None:
            return None
        with pulled:
            named = pulled.named_tensors()
            if isinstance(target, torch.nn.Module):
                copy_into_module(target, named)
            else:
                target.load_weights(named, pulled.version)
            del named
        self.version = pulled.version
        return pulled.version

    def close(self) -> None:
        self.reader.close()


def copy_into_module(module: torch.nn.Module, named: Mapping[str, torch.Tensor],
                     staging: StagingBuffer | None = None) -> None:
    """Copy every tensor of `named` into the module's state dict, which must have the same names,
    wherever the module is (`laminar.devices.load_into_module`). On a GPU the copies go through
    `staging` (pinned host memory; without one, a buffer is allocated for this call: a caller that
    pulls into the same GPU module again and again should keep one and pass it)."""
    state = module.state_dict()
    missing, extra = sorted(set(state) - set(named)), sorted(set(named) - set(state))
    if missing or extra:
        raise ValueError(f"pulled weights do not match the model: missing {missing[:5]} "
                         f"({len(missing)} in all), unexpected {extra[:5]} ({len(extra)} in all); "
                         "push the same model's state_dict() the rollout runs")
    device = torch.device("cpu")
    for name, dst in state.items():
        src = named[name]
        if src.shape != dst.shape:
            raise ValueError(f"pulled tensor '{name}' has shape {tuple(src.shape)}, the model's "
                             f"has {tuple(dst.shape)}")
        if dst.device.type == "cuda":
            device = dst.device
    if staging is None:
        staging = StagingBuffer.for_device(device)  # None on the CPU: one copy_ per tensor
    load_into_module(module, named, staging)

