"""A weight version published from a sharded model: every rank copies its own rows into the
master relay's slot, so nothing is gathered.

    push_from_shards(trainer, sink, version, chunk_bytes)    # rank 0; sink.push_parts (service.py)

FSDP splits every parameter by rows (dim 0, as torch.chunk does) and a tensor is row-major in
a version's flat buffer, so a rank's rows are one contiguous byte range of it. Rank 0 has the
sink reserve a slot (the master relay's, in shared memory: `Pusher.push_parts`); every rank
maps the slot file, copies its rows in (`write_rows`), waits at a barrier, then checksums its
share of the chunks (chunk i on rank i mod N); rank 0 sets the checksums and the relay
publishes. The copy and the crc32 are split N ways and only the checksums cross the process
group, so the trainer's stall does not grow with N. DDP (every rank holds every row) splits the
same rows the same way.

`gather_rows` is the other way: tensor by tensor rank 0 gathers the rows over the process group
into the slot, then checksums alone. It is what a push falls back to when a rank is not on the
machine of the slot (it cannot map it), and what `laminar bench trainer` compares against.
"""

from __future__ import annotations

import mmap
import os
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from laminar.relay.address import node_id
from laminar.relay.version import VersionHeader, checksums, layout

_MAPS: dict[str, tuple[int, mmap.mmap]] = {}  # this process's slot mappings, kept across pushes
_TOGETHER: dict[str, bool] = {}  # rank 0: directory -> every rank sees it (the same machine)


def version_header(trainer: Any, version: int, chunk_bytes: int) -> VersionHeader:
    """The layout `Pusher.push(trainer.named_weights())` would make: full shapes, in order."""
    dtype = trainer.publish_dtype
    return layout(((name, str(dtype or p.dtype).removeprefix("torch."), tuple(p.shape))
                   for name, p in trainer.module.named_parameters()), version, chunk_bytes)


def push_from_shards(trainer: Any, sink: Any, version: int, chunk_bytes: int,
                     method: str | None = None) -> float:
    """Rank 0: publish the current weights as `version`; returns the stall in seconds.
    `method`: "shards" or "gather"; None = shards when every rank shares the slot's machine."""
    header = version_header(trainer, version, chunk_bytes)
    raw = header.to_bytes()

    def fill(data: memoryview, path: Path) -> None:
        ranks = trainer.ranks
        chosen = method
        if chosen is None:  # asked once per directory (the master's or a staging store's)
            if str(path.parent) not in _TOGETHER:
                here = node_id(path.parent)
                seen = ranks.call_all(trainer, _same_machine, str(path.parent), here)
                _TOGETHER[str(path.parent)] = all(seen)
                away = [r for r, ok in enumerate(seen) if not ok]
                print(f"trainer push into {path.parent}: " + (
                    f"rank 0 gathers the rows (ranks {away} are on another machine)" if away
                    else f"each of the {len(seen)} ranks writes its own rows"), flush=True)
            chosen = "shards" if _TOGETHER[str(path.parent)] else "gather"
        fn = write_rows if chosen == "shards" else gather_rows
        sums: dict[int, int] = {}
        for part in ranks.call_all(trainer, fn, str(path), raw):
            sums.update(part)
        header.checksums = [sums[i] for i in range(header.num_chunks)]

    return sink.push_parts(header, fill)


def write_rows(trainer: Any, path: str, raw: bytes) -> dict[int, int]:
    """Every rank: copy its rows of every parameter into the slot, then crc32 chunks
    rank, rank + N, ... once every rank has written."""
    ranks = trainer.ranks
    header = VersionHeader.from_bytes(raw)
    data = _data(path, header)
    flat = torch.frombuffer(data, dtype=torch.uint8)
    with torch.no_grad():  # plain tensors: no DTensor dispatch per parameter
        for entry, p in zip(header.tensors, trainer.module.parameters()):
            rows, first = _my_rows(p, ranks.rank, ranks.world_size)
            if rows.numel():
                start = entry.offset + first * (entry.nbytes // entry.shape[0])
                rows = rows.to(getattr(torch, entry.dtype))  # trainer.publish_dtype's cast
                flat[start:start + rows.numel() * rows.element_size()].copy_(
                    rows.contiguous().reshape(-1).view(torch.uint8))
    del flat
    ranks.barrier()
    sums = {i: zlib.crc32(data[a:b]) for i in range(ranks.rank, header.num_chunks, ranks.world_size)
            for a, b in [header.chunk_range(i)]}
    data.release()
    return sums


def gather_rows(trainer: Any, path: str, raw: bytes) -> dict[int, int]:
    """Every rank: send its rows of each parameter to rank 0 (one gather per tensor), which
    copies the whole tensor into the slot and then checksums every chunk."""
    ranks = trainer.ranks
    header = VersionHeader.from_bytes(raw)
    lead = ranks.is_leader
    data = _data(path, header) if lead else None
    flat = torch.frombuffer(data, dtype=torch.uint8) if lead else None
    with torch.no_grad():
        for entry, p in zip(header.tensors, trainer.module.parameters()):
            if hasattr(p, "to_local"):  # a shard: pad to the common row count, gather, cut
                size = _rows_per_rank(p.shape[0], ranks.world_size)
                rows, _ = _my_rows(p, ranks.rank, ranks.world_size)
                padded = rows.new_zeros((size, *p.shape[1:]))
                padded[:rows.shape[0]] = rows
                parts = [torch.empty_like(padded) for _ in range(ranks.world_size)] if lead else None
                dist.gather(padded, parts, dst=0)
                full = torch.cat(parts)[:p.shape[0]] if lead else None
            else:  # replicated (DDP): rank 0 has it all
                full = p
            if lead:
                flat[entry.offset:entry.offset + entry.nbytes].copy_(
                    full.to(getattr(torch, entry.dtype)).contiguous().reshape(-1).view(torch.uint8))
    if not lead:
        return {}
    del flat
    sums = dict(enumerate(checksums(data, header)))
    data.release()
    return sums


def _rows_per_rank(dim0: int, world_size: int) -> int:
    return -(-dim0 // world_size)


def _my_rows(p: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, int]:
    """This rank's rows of parameter `p` and the index of the first: FSDP's local shard, or
    the same rows cut from a replicated tensor."""
    size = _rows_per_rank(p.shape[0], world_size)
    first = min(rank * size, p.shape[0])
    if hasattr(p, "to_local"):
        rows = p.to_local()
        expected = min(size, p.shape[0] - first)
        if rows.shape[0] != expected:
            raise RuntimeError(f"rank {rank} holds {rows.shape[0]} rows of a {tuple(p.shape)} "
                               f"parameter, not the {expected} of an even dim-0 split: a sharding "
                               "laminar/trainer/shards.py does not know")
        return rows, first
    return p[first:first + size], first


def _data(path: str, header: VersionHeader) -> memoryview:
    """The version buffer of the slot file `path`, through a mapping kept across pushes (the
    relay reuses its slots: no page is faulted in twice)."""
    for gone in [p for p in _MAPS if p != path and not os.path.exists(p)]:
        _MAPS.pop(gone)[1].close()
    ino = os.stat(path).st_ino
    held = _MAPS.get(path)
    if held is None or held[0] != ino or len(held[1]) < header.file_size:
        if held is not None:
            held[1].close()
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            held = _MAPS[path] = (ino, mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                                 prot=mmap.PROT_READ | mmap.PROT_WRITE))
        finally:
            os.close(fd)
    return memoryview(held[1])[header.data_offset:header.file_size]


def _same_machine(trainer: Any, directory: str, machine: str) -> bool:
    """Does this rank see the shared memory rank 0 sees (so it can map rank 0's slot)?"""
    return node_id(directory) == machine
