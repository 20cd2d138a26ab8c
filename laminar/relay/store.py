"""A versioned weight store in shared memory, one per relay.

Parts:
- `TensorEntry`, `VersionHeader`, `layout`: a version is one flat byte buffer plus an index
  (name, dtype, shape, offset per tensor) and a crc32 per chunk of the buffer.
- Slots: a relay keeps a small pool of files `<prefix>.s<n>` in the shm directory (/dev/shm by
  default), each holding one version: a fixed-size JSON header, then the buffer at a
  page-aligned offset. Slots are reused, so readers and writers map each one once and then
  copy at memory speed instead of faulting in fresh pages for every version. Files, not
  `multiprocessing.shared_memory`, on purpose: the stdlib's resource tracker unlinks segments
  when a process that merely attached exits, and flock on a file is what lets the owner and
  readers coordinate across processes.
- `WeightStore`: the owner side (the relay process). `create` reserves a slot for a version
  (filled chunk by chunk by the transport, or written whole by a local trainer), `publish`
  makes it the latest by renaming `<prefix>.latest` into place after every chunk is verified.
  While a slot is being written its owner holds an exclusive flock on it, so a reader never
  sees half a version. At most `keep_versions` versions are kept; a slot whose old version a
  reader still holds is never overwritten (a new slot is added instead, and dropped again once
  released).
- `ShmReader` / `Snapshot`: the reader side (rollout processes). A snapshot is a complete
  version under a shared flock; its `data` is the mapped buffer, no copy. It stays valid until
  `close()`: copy out of it (load_weights does), do not keep views past that.
- `cleanup`: remove every file of a prefix (a relay killed with SIGKILL cannot clean up after
  itself; the next store with that prefix, or the runtime, calls this).
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

MAGIC = b"LMRSEG02"
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

    @property
    def file_size(self) -> int:
        return self.data_offset + self.nbytes


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


def pointer_path(directory: str | Path, prefix: str) -> Path:
    return Path(directory) / f"{prefix}.latest"


# ---------------------------------------------------------------------------------------------
# Owner side


class _Slot:
    """One reusable file of the pool, mapped read-write by its owner."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.file = open(self.fd, "rb", buffering=0, closefd=False)  # for sendfile
        self.size = 0
        self.mm: mmap.mmap | None = None
        self.buf: VersionBuffer | None = None  # the version it holds (kept or not)
        self.locked = False  # whether we hold the exclusive lock (being written)

    def ensure(self, size: int) -> None:
        if size <= self.size:
            return
        if self.mm is not None:
            _close_map(self.mm)
        os.ftruncate(self.fd, size)  # only ever grows: readers' existing mappings stay valid
        self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.size = size

    def try_lock(self) -> bool:
        """Exclusive lock, without waiting: fails while any reader holds the slot."""
        if not self.locked:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            self.locked = True
        return True

    def unlock(self) -> None:
        if self.locked:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.locked = False

    def close(self, unlink: bool) -> None:
        if self.buf is not None:
            self.buf.release()
        if self.mm is not None:
            _close_map(self.mm)
        self.file.close()
        os.close(self.fd)
        if unlink:
            self.path.unlink(missing_ok=True)


class VersionBuffer:
    """One version in a slot of the owner process, with per-chunk state."""

    def __init__(self, slot: _Slot, header: VersionHeader, cond: threading.Condition) -> None:
        self.slot, self.header, self._cond = slot, header, cond
        self.data = memoryview(slot.mm)[header.data_offset:header.file_size]
        self.state = bytearray(header.num_chunks)
        self.num_verified = 0
        self.num_received = 0  # chunk frames that arrived for this version (duplicates included)
        self.num_rejected = 0  # of those, how many failed their checksum
        self.pins = 0  # users inside this process (senders); never dropped while pinned
        self.completed_at: float | None = None
        # checksums known: a transport-fed version has them from the offer, a locally written
        # one only once it is finished; only then may it be forwarded
        self.header_final = True

    @property
    def version(self) -> int:
        return self.header.version

    @property
    def file(self):  # noqa: ANN201 - a raw file object, for sendfile
        return self.slot.file

    @property
    def path(self) -> Path:
        return self.slot.path

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

    def release(self) -> None:
        self.data.release()


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
        self._slots: list[_Slot] = []
        self._versions: dict[int, VersionBuffer] = {}
        self._latest: int | None = None
        self._next_slot = 0
        cleanup(self.directory, prefix)  # leftovers of an earlier process with our name

    # -- creating versions -----------------------------------------------------------------

    def create(self, header: VersionHeader, header_final: bool = True) -> VersionBuffer:
        """Reserve a slot for a new version and write its header. The transport fills it chunk
        by chunk (`mark_verified`); a local writer fills it whole and then calls `finish` with
        the checksums (pass header_final=False: until then the version is not forwarded)."""
        with self.cond:
            if header.version in self._versions:
                raise ValueError(f"version {header.version} already exists in store '{self.prefix}'")
            self._versions[header.version] = None  # type: ignore[assignment]  # counts in keep()
            try:
                slot = self._free_slot(self._keep())
                slot.ensure(header.file_size)
                _write_header(slot.mm, header)
                buf = VersionBuffer(slot, header, self.cond)
                buf.header_final = header_final
            except BaseException:
                del self._versions[header.version]
                raise
            slot.buf = buf
            self._versions[header.version] = buf
            return buf

    def finish(self, buf: VersionBuffer, header: VersionHeader) -> None:
        """A local writer filled the whole buffer and computed `header.checksums`."""
        with self.cond:
            if header.version != buf.version or header.nbytes != buf.header.nbytes:
                raise ValueError(f"finished header is for version {header.version} of "
                                 f"{header.nbytes} bytes, the slot holds version {buf.version}")
            buf.header = header
            _write_header(buf.slot.mm, header)
            buf.state[:] = bytes([VERIFIED]) * header.num_chunks
            buf.num_verified = header.num_chunks
            buf.header_final = True
            self.cond.notify_all()

    def finish_from_slot(self, version: int) -> VersionBuffer:
        """A writer in another process filled the slot and wrote the final header into it."""
        with self.cond:
            buf = self._versions.get(version)
            if buf is None:
                raise ValueError(f"version {version} was never reserved in store '{self.prefix}'")
            self.finish(buf, _read_header(buf.slot.mm, buf.path))
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
        """Make a complete version the one readers get: release the slot's write lock, then
        atomically rename the pointer file into place."""
        with self.cond:
            buf = self._versions[version]
            if not buf.is_complete:
                raise ValueError(f"version {version} has {buf.num_verified}/{buf.header.num_chunks} "
                                 "chunks; only complete versions can be published")
            buf.completed_at = buf.completed_at or time.time()
            buf.slot.unlock()
            if self._latest is not None and version <= self._latest:
                return
            ptr = pointer_path(self.directory, self.prefix)
            tmp = ptr.with_name(ptr.name + ".tmp")
            tmp.write_text(f"{version} {buf.slot.path.name}\n")
            os.replace(tmp, ptr)
            self._latest = version
            self.cond.notify_all()
            self.collect()

    # -- queries ------------------------------------------------------------------------------

    def latest(self) -> VersionBuffer | None:
        with self.cond:
            return self._versions.get(self._latest) if self._latest is not None else None

    def newest(self) -> VersionBuffer | None:
        """The newest version that may be forwarded, complete or still arriving."""
        with self.cond:
            ready = [v for v, b in self._versions.items() if b is not None and b.header_final]
            return self._versions[max(ready)] if ready else None

    def get(self, version: int) -> VersionBuffer | None:
        with self.cond:
            return self._versions.get(version)

    def versions(self) -> list[int]:
        with self.cond:
            return sorted(self._versions)

    def slot_paths(self) -> list[Path]:
        with self.cond:
            return [s.path for s in self._slots]

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

    def _keep(self) -> set[int]:
        """The latest complete version plus the newest keep_versions-1 others."""
        others = sorted((v for v in self._versions if v != self._latest), reverse=True)
        keep = set(others[:self.keep_versions - 1])
        if self._latest is not None:
            keep.add(self._latest)
        return keep

    def _is_spare(self, slot: _Slot, keep: set[int] | None = None) -> bool:
        """The slot holds nothing this store offers (or, given `keep`, nothing it must keep);
        a reader may still be reading the bytes in it."""
        buf = slot.buf
        if buf is None or self._versions.get(buf.version) is not buf:
            return True
        return keep is not None and buf.version not in keep and not buf.pins

    def _free_slot(self, keep: set[int]) -> _Slot:
        for slot in self._slots:
            if self._is_spare(slot, keep) and slot.try_lock():  # and no reader holds it
                if slot.buf is not None:
                    if self._versions.get(slot.buf.version) is slot.buf:
                        del self._versions[slot.buf.version]
                    slot.buf.release()
                    slot.buf = None
                return slot
        slot = _Slot(self.directory / f"{self.prefix}.s{self._next_slot}")
        self._next_slot += 1
        slot.try_lock()
        self._slots.append(slot)
        return slot

    def collect(self) -> list[int]:
        """Stop offering versions outside the keep set that nobody pins in-process (their
        slots become reusable once no reader holds them) and remove slots beyond
        keep_versions that no reader holds. Returns the versions dropped."""
        with self.cond:
            keep = self._keep()
            dropped = [v for v, b in self._versions.items()
                       if b is not None and v not in keep and not b.pins]
            for v in dropped:
                self._versions.pop(v).slot.unlock()  # unlock: it may be an abandoned partial
            spare = [s for s in self._slots if self._is_spare(s)]
            for slot in spare[:max(0, len(self._slots) - self.keep_versions)]:
                if slot.try_lock():
                    slot.close(unlink=True)
                    self._slots.remove(slot)
            return dropped

    def held_versions(self) -> list[int]:
        """Versions (offered or already dropped) in slots that some reader holds right now."""
        with self.cond:
            return sorted(s.buf.version for s in self._slots
                          if s.buf is not None and not s.locked and _is_held(s.path))

    def close(self) -> None:
        with self.cond:
            for slot in self._slots:
                slot.close(unlink=True)
            self._slots.clear()
            self._versions.clear()
            self._latest = None
        cleanup(self.directory, self.prefix)


# ---------------------------------------------------------------------------------------------
# Reader side


class _Mapping:
    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        st = os.fstat(self.fd)
        self.ino, self.size = st.st_ino, st.st_size
        # MAP_POPULATE: one call maps every page instead of a fault per 4 KiB on first read
        self.mm = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                            prot=mmap.PROT_READ)
        self.users = 0  # open snapshots; the shared lock is held while > 0

    def close(self) -> None:
        _close_map(self.mm)
        os.close(self.fd)


class ShmReader:
    """Reads a relay's store from another process. Keeps each slot mapped between pulls, so a
    pull after the first costs a lock and a copy, not a page-table rebuild."""

    def __init__(self, directory: str | Path, prefix: str) -> None:
        self.directory, self.prefix = Path(directory), prefix
        self._maps: dict[str, _Mapping] = {}
        self._lock = threading.Lock()

    def newest_version(self) -> int | None:
        """The newest published version: one small file read, no mapping, no copy."""
        return _read_pointer(self.directory, self.prefix)[0]

    def open_latest(self, newer_than: int | None = None, attempts: int = 100) -> "Snapshot | None":
        """The newest published version under a shared lock, or None if there is none newer
        than `newer_than`."""
        for _ in range(attempts):
            version, slot_name = _read_pointer(self.directory, self.prefix)
            if version is None or (newer_than is not None and version <= newer_than):
                return None
            try:
                m = self._acquire(slot_name)
            except (FileNotFoundError, BlockingIOError):
                time.sleep(0.001)  # being rewritten or removed: the pointer has moved on
                continue
            header = _read_header(m.mm, self.directory / slot_name)
            if header.version == version and header.file_size <= m.size:
                return Snapshot(self, slot_name, m, header)
            self._release(slot_name, m)
            if header.file_size > m.size:
                self._forget(slot_name)  # the owner grew the slot: map it again
        raise RuntimeError(f"could not open the latest version of '{self.prefix}' in "
                           f"{self.directory} after {attempts} attempts; versions are replaced "
                           "faster than they can be opened")

    def _acquire(self, slot_name: str) -> _Mapping:
        with self._lock:
            path = self.directory / slot_name
            m = self._maps.get(slot_name)
            if m is None or os.stat(path).st_ino != m.ino:
                if m is not None:
                    self._forget(slot_name)
                m = self._maps[slot_name] = _Mapping(path)
            if m.users == 0:
                fcntl.flock(m.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # BlockingIOError: being written
            m.users += 1
            return m

    def _release(self, slot_name: str, m: _Mapping) -> None:
        with self._lock:
            m.users -= 1
            if m.users == 0:
                fcntl.flock(m.fd, fcntl.LOCK_UN)
                if self._maps.get(slot_name) is not m:
                    m.close()

    def _forget(self, slot_name: str) -> None:
        m = self._maps.pop(slot_name, None)
        if m is not None and m.users == 0:
            m.close()

    def close(self) -> None:
        with self._lock:
            for name in list(self._maps):
                self._forget(name)


class Snapshot:
    """A complete version, held (shared flock) until `close()`. `data` is the mapped buffer."""

    def __init__(self, reader: ShmReader, slot_name: str, m: _Mapping, header: VersionHeader) -> None:
        self._reader, self._slot_name, self._map = reader, slot_name, m
        self.header = header
        self.data = memoryview(m.mm)[header.data_offset:header.file_size]
        self._open = True

    @property
    def version(self) -> int:
        return self.header.version

    def verify(self) -> list[int]:
        """Chunks whose crc32 does not match the header (empty when intact)."""
        return [i for i, c in enumerate(checksums(self.data, self.header)) if c != self.header.checksums[i]]

    def close(self) -> None:
        if self._open:
            self._open = False
            self.data.release()
            self._reader._release(self._slot_name, self._map)

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_latest_version(directory: str | Path, prefix: str) -> int | None:
    return _read_pointer(directory, prefix)[0]


def cleanup(directory: str | Path, prefix: str) -> int:
    """Remove every slot and pointer file of `prefix`; returns how many were removed."""
    n = 0
    for p in Path(directory).glob(f"{prefix}.*"):
        try:
            p.unlink()
            n += 1
        except FileNotFoundError:
            pass
    return n


# ---------------------------------------------------------------------------------------------


def write_header(mm: mmap.mmap, header: VersionHeader) -> None:
    _write_header(mm, header)


def _write_header(mm: mmap.mmap, header: VersionHeader) -> None:
    raw = header.to_bytes()
    mm[0:8] = MAGIC
    mm[8:16] = len(raw).to_bytes(8, "little")
    mm[16:16 + len(raw)] = raw


def _read_header(mm: mmap.mmap, path: Path) -> VersionHeader:
    if mm[0:8] != MAGIC:
        raise ValueError(f"'{path}' is not a laminar weight slot (bad magic)")
    n = int.from_bytes(mm[8:16], "little")
    return VersionHeader.from_bytes(mm[16:16 + n])


def _read_pointer(directory: str | Path, prefix: str) -> tuple[int | None, str]:
    try:
        version, slot = pointer_path(directory, prefix).read_text().split()
        return int(version), slot
    except (FileNotFoundError, ValueError):
        return None, ""


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


def _close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # views still point into it; it is unmapped when the last of them goes


def _align(n: int, a: int) -> int:
    return -(-n // a) * a
