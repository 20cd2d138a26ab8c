"""A versioned weight store in shared memory, one per relay.

Parts:
- `TensorEntry`, `VersionHeader`, `layout`: a version is one flat byte buffer plus an index
  (name, dtype, shape, offset per tensor) and a crc32 per chunk of the buffer.
- Segment files: each version lives in its own file `<prefix>.v<version>` in the shm directory
  (/dev/shm by default): a fixed-size JSON header, then the buffer at a page-aligned offset.
  Files, not `multiprocessing.shared_memory`, on purpose: the stdlib's resource tracker unlinks
  segments when the process that merely attached exits, and flock on the file is what lets the
  owner see which versions readers still hold.
- `WeightStore`: the owner side (the relay process). Creates versions (filled chunk by chunk
  by the transport, or written whole by a local trainer and adopted), publishes them, frees old
  ones. Publishing writes `<prefix>.latest` with an atomic rename, after every chunk is in and
  verified: a reader never sees half a version.
- `Snapshot`, `open_latest`, `read_latest_version`: the reader side (rollout processes). A
  reader maps a complete version read-only, without copying, and holds it with a shared flock
  until the mapping is gone. The owner frees a version only when its exclusive flock succeeds,
  so a held version stays intact; at most `keep_versions` unheld versions are kept.
- `cleanup`: remove every file of a prefix (a relay killed with SIGKILL cannot clean up after
  itself; its successor process or the runtime calls this).
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import threading
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"LMRSEG01"
DATA_ALIGN = 4096  # the buffer starts on a page; tensors start on 64-byte boundaries
TENSOR_ALIGN = 64
DTYPE_SIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
               "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}

MISSING, RECEIVING, VERIFIED = 0, 1, 2  # chunk states


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the flat buffer

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(slots=True)
class VersionHeader:
    version: int
    nbytes: int  # size of the flat buffer
    chunk_bytes: int
    tensors: list[TensorEntry]
    checksums: list[int] = field(default_factory=list)  # crc32 per chunk; empty until computed

    @property
    def num_chunks(self) -> int:
        return max(1, -(-self.nbytes // self.chunk_bytes))

    def chunk_range(self, i: int) -> tuple[int, int]:
        start = i * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.nbytes)

    def to_bytes(self) -> bytes:
        # crcs as fixed-width hex: the header's size is known before the data is written
        sums = "".join(f"{c:08x}" for c in self.checksums) or "0" * 8 * self.num_chunks
        return json.dumps({"version": self.version, "nbytes": self.nbytes,
                           "chunk_bytes": self.chunk_bytes, "checksums": sums,
                           "tensors": [[t.name, t.dtype, list(t.shape), t.offset] for t in self.tensors]},
                          separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "VersionHeader":
        d = json.loads(raw)
        sums = d["checksums"]
        return cls(int(d["version"]), int(d["nbytes"]), int(d["chunk_bytes"]),
                   [TensorEntry(n, dt, tuple(s), int(o)) for n, dt, s, o in d["tensors"]],
                   [int(sums[i:i + 8], 16) for i in range(0, len(sums), 8)])

    @property
    def data_offset(self) -> int:
        return _align(16 + len(self.to_bytes()), DATA_ALIGN)


def layout(specs: Iterable[tuple[str, str, tuple[int, ...]]], version: int, chunk_bytes: int) -> VersionHeader:
    """Place tensors (name, dtype, shape) one after the other in a flat buffer."""
    tensors, offset = [], 0
    for name, dtype, shape in specs:
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"tensor '{name}' has dtype {dtype}, which the weight store does not "
                             f"handle; supported: {', '.join(DTYPE_SIZES)}")
        entry = TensorEntry(name, dtype, tuple(int(d) for d in shape), offset)
        tensors.append(entry)
        offset = _align(offset + entry.nbytes, TENSOR_ALIGN)
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be positive")
    return VersionHeader(version, offset, chunk_bytes, tensors)


def checksums(data: memoryview, header: VersionHeader) -> list[int]:
    return [zlib.crc32(data[a:b]) for a, b in (header.chunk_range(i) for i in range(header.num_chunks))]


def segment_path(directory: str | Path, prefix: str, version: int) -> Path:
    return Path(directory) / f"{prefix}.v{version}"


def pointer_path(directory: str | Path, prefix: str) -> Path:
    return Path(directory) / f"{prefix}.latest"


class VersionBuffer:
    """One version mapped read-write in the owner process, with per-chunk state."""

    def __init__(self, path: Path, header: VersionHeader, mm: mmap.mmap, fd: int,
                 cond: threading.Condition) -> None:
        self.path, self.header, self._mm, self._fd, self._cond = path, header, mm, fd, cond
        self.file = open(fd, "rb", buffering=0, closefd=False)  # for sendfile
        self.data = memoryview(mm)[header.data_offset:header.data_offset + header.nbytes]
        self.state = bytearray(header.num_chunks)
        self.num_verified = 0
        self.num_received = 0  # chunk frames that arrived for this version (duplicates included)
        self.num_rejected = 0  # of those, how many failed their checksum
        self.pins = 0  # users inside this process (senders); never freed while pinned
        self.published_at: float | None = None
        self.completed_at: float | None = None

    @property
    def version(self) -> int:
        return self.header.version

    @property
    def is_complete(self) -> bool:
        return self.num_verified == self.header.num_chunks

    def chunk(self, i: int) -> memoryview:
        a, b = self.header.chunk_range(i)
        return self.data[a:b]

    def have_bitmap(self) -> bytes:
        return bytes(1 if s == VERIFIED else 0 for s in self.state)

    def wait_chunk(self, i: int, timeout: float) -> bool:
        """Block until chunk i is verified (True) or `timeout` passes (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.state[i] == VERIFIED, timeout)

    def close(self) -> None:
        self.data.release()
        self._mm.close()
        self.file.close()
        os.close(self._fd)


class WeightStore:
    """Versions owned by one relay process. Thread-safe; `cond` wakes senders on new chunks."""

    def __init__(self, directory: str | Path, prefix: str, keep_versions: int = 2) -> None:
        if keep_versions < 2:
            raise ValueError(f"keep_versions={keep_versions}: at least 2 are needed so the newest "
                             "complete version stays readable while the next one arrives")
        self.directory, self.prefix, self.keep_versions = Path(directory), prefix, keep_versions
        if not self.directory.is_dir():
            raise ValueError(f"shared-memory directory '{self.directory}' does not exist; set "
                             "relay.shm_dir to a tmpfs directory such as /dev/shm")
        self.cond = threading.Condition()
        self._versions: dict[int, VersionBuffer] = {}
        self._latest: int | None = None
        cleanup(self.directory, prefix)  # leftovers of an earlier process with our name

    # -- creating versions -----------------------------------------------------------------

    def create(self, header: VersionHeader) -> VersionBuffer:
        """A new, empty version whose chunks the transport fills (header carries the crcs)."""
        with self.cond:
            if header.version in self._versions:
                raise ValueError(f"version {header.version} already exists in store '{self.prefix}'")
            path = segment_path(self.directory, self.prefix, header.version)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            size = header.data_offset + header.nbytes
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            _write_header(mm, header)
            buf = VersionBuffer(path, header, mm, fd, self.cond)
            self._versions[header.version] = buf
            self.collect()
            return buf

    def adopt(self, staged: str | Path, version: int) -> VersionBuffer:
        """Take over a complete version file written by another process on this machine
        (a trainer's push): rename it into this store and treat every chunk as verified."""
        with self.cond:
            if version in self._versions:
                raise ValueError(f"version {version} already exists in store '{self.prefix}'")
            path = segment_path(self.directory, self.prefix, version)
            os.rename(staged, path)
            fd = os.open(path, os.O_RDWR)
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            header = _read_header(mm, path)
            if header.version != version or size < header.data_offset + header.nbytes:
                mm.close()
                os.close(fd)
                os.unlink(path)
                raise ValueError(f"staged file '{staged}' holds version {header.version} of "
                                 f"{size} bytes, not a complete version {version}")
            buf = VersionBuffer(path, header, mm, fd, self.cond)
            buf.state[:] = bytes([VERIFIED]) * header.num_chunks
            buf.num_verified = header.num_chunks
            self._versions[version] = buf
            return buf

    def mark_verified(self, buf: VersionBuffer, i: int) -> bool:
        """Chunk i is in and its crc matched; True when this completed the version."""
        with self.cond:
            if buf.state[i] != VERIFIED:
                buf.state[i] = VERIFIED
                buf.num_verified += 1
            self.cond.notify_all()
            return buf.is_complete

    def publish(self, version: int) -> None:
        """Make a complete version the one readers get (atomic: the pointer file is renamed)."""
        with self.cond:
            buf = self._versions[version]
            if not buf.is_complete:
                raise ValueError(f"version {version} has {buf.num_verified}/{buf.header.num_chunks} "
                                 "chunks; only complete versions can be published")
            if self._latest is not None and version <= self._latest:
                return
            buf.completed_at = buf.completed_at or time.time()
            ptr = pointer_path(self.directory, self.prefix)
            tmp = ptr.with_name(ptr.name + ".tmp")
            tmp.write_text(f"{version}\n")
            os.replace(tmp, ptr)
            buf.published_at = time.time()
            self._latest = version
            self.cond.notify_all()
            self.collect()

    # -- queries ------------------------------------------------------------------------------

    def latest(self) -> VersionBuffer | None:
        with self.cond:
            return self._versions.get(self._latest) if self._latest is not None else None

    def newest(self) -> VersionBuffer | None:
        """The newest version, complete or still arriving: what a sender forwards."""
        with self.cond:
            return self._versions[max(self._versions)] if self._versions else None

    def get(self, version: int) -> VersionBuffer | None:
        with self.cond:
            return self._versions.get(version)

    def versions(self) -> list[int]:
        with self.cond:
            return sorted(self._versions)

    def pin(self, version: int) -> VersionBuffer | None:
        with self.cond:
            buf = self._versions.get(version)
            if buf is not None:
                buf.pins += 1
            return buf

    def unpin(self, buf: VersionBuffer) -> None:
        with self.cond:
            buf.pins -= 1
            self.collect()

    # -- freeing ------------------------------------------------------------------------------

    def collect(self) -> list[int]:
        """Free versions outside the keep set (the latest complete one plus the newest
        keep_versions-1 others) that nobody pins in-process and no reader holds. Held versions
        are retried on the next call. Returns the versions freed."""
        with self.cond:
            newest = sorted(self._versions, reverse=True)
            keep = set(v for v in newest if v != self._latest)
            keep = set(sorted(keep, reverse=True)[:self.keep_versions - 1])
            if self._latest is not None:
                keep.add(self._latest)
            freed = []
            for v in newest:
                buf = self._versions[v]
                if v in keep or buf.pins or not _try_unlink_unheld(buf.path):
                    continue
                buf.close()
                del self._versions[v]
                freed.append(v)
            return freed

    def held_versions(self) -> list[int]:
        """Versions that some reader process holds right now."""
        with self.cond:
            return [v for v, b in self._versions.items() if _is_held(b.path)]

    def close(self) -> None:
        with self.cond:
            for buf in self._versions.values():
                buf.close()
            self._versions.clear()
            self._latest = None
        cleanup(self.directory, self.prefix)


# ---------------------------------------------------------------------------------------------
# Reader side


class Snapshot:
    """A complete version mapped read-only in a reader process. While the mapping exists the
    version is held (shared flock) and its owner will not free it. Tensors made from `data`
    keep the mapping alive; `close` releases it once no such view is left."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        size = os.fstat(fd).st_size
        # MAP_POPULATE: one call maps every page, instead of a fault per 4 KiB on first read
        self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        os.close(fd)  # the mapping keeps its own duplicate of fd, and with it the flock
        self.header = _read_header(self._mm, path)
        off = self.header.data_offset
        self.data = memoryview(self._mm)[off:off + self.header.nbytes]

    @property
    def version(self) -> int:
        return self.header.version

    def verify(self) -> list[int]:
        """Chunks whose crc32 does not match the header (empty when intact)."""
        return [i for i, c in enumerate(checksums(self.data, self.header)) if c != self.header.checksums[i]]

    def close(self) -> None:
        if self._mm is None:
            return
        self.data.release()
        try:
            self._mm.close()
        except BufferError:
            pass  # arrays still point into the mapping; it is unmapped with the last of them
        self._mm = None

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_latest_version(directory: str | Path, prefix: str) -> int | None:
    """The newest published version of a store: one small file read, no mapping, no copy."""
    try:
        return int(pointer_path(directory, prefix).read_text())
    except (FileNotFoundError, ValueError):
        return None


def open_latest(directory: str | Path, prefix: str, newer_than: int | None = None,
                attempts: int = 20) -> Snapshot | None:
    """Map the newest published version, or None if there is none newer than `newer_than`."""
    for _ in range(attempts):
        version = read_latest_version(directory, prefix)
        if version is None or (newer_than is not None and version <= newer_than):
            return None
        path = segment_path(directory, prefix, version)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # freed between reading the pointer and opening: read the pointer again
        fcntl.flock(fd, fcntl.LOCK_SH)
        if os.fstat(fd).st_nlink == 0:  # the owner unlinked it just before we locked
            os.close(fd)
            continue
        return Snapshot(path, fd)
    raise RuntimeError(f"could not open the latest version of '{prefix}' in {directory} after "
                       f"{attempts} attempts; versions are replaced faster than they can be opened")


def cleanup(directory: str | Path, prefix: str) -> int:
    """Remove every segment and pointer file of `prefix`; returns how many were removed."""
    n = 0
    for p in Path(directory).glob(f"{prefix}.*"):
        try:
            p.unlink()
            n += 1
        except FileNotFoundError:
            pass
    return n


# ---------------------------------------------------------------------------------------------


def write_segment(path: str | Path, header: VersionHeader) -> tuple[mmap.mmap, memoryview, int]:
    """Create a segment file for `header` and map it for writing; returns (mapping, data view,
    fd). The caller fills the data, sets header.checksums, calls `finish_segment`."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    size = header.data_offset + header.nbytes
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return mm, memoryview(mm)[header.data_offset:header.data_offset + header.nbytes], fd


def finish_segment(mm: mmap.mmap, header: VersionHeader) -> None:
    _write_header(mm, header)


def _write_header(mm: mmap.mmap, header: VersionHeader) -> None:
    raw = header.to_bytes()
    mm[0:8] = MAGIC
    mm[8:16] = len(raw).to_bytes(8, "little")
    mm[16:16 + len(raw)] = raw


def _read_header(mm: mmap.mmap, path: Path) -> VersionHeader:
    if mm[0:8] != MAGIC:
        raise ValueError(f"'{path}' is not a laminar weight segment (bad magic)")
    n = int.from_bytes(mm[8:16], "little")
    return VersionHeader.from_bytes(mm[16:16 + n])


def _is_held(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _try_unlink_unheld(path: Path) -> bool:
    """Unlink `path` if no reader holds it. The exclusive lock is kept across the unlink so a
    reader that opened the file in between sees st_nlink == 0 and retries."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    os.unlink(path)
    os.close(fd)
    return True


def _align(n: int, a: int) -> int:
    return -(-n // a) * a
