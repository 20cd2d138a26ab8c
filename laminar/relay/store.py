"""The owner side of a relay's weight store: versions in a pool of shared-memory slots.

A relay keeps a small pool of files `<prefix>.s<n>` in the shm directory (/dev/shm by default),
each holding one version (see `version.py` for the layout). Slots are reused, so readers and
writers map each one once and then copy at memory speed instead of faulting in fresh pages for
every version. Files, not `multiprocessing.shared_memory`, on purpose: the stdlib's resource
tracker unlinks segments when a process that merely attached exits, and flock on a file is
what lets the owner and the readers (`reader.py`) coordinate across processes.

Parts:
- `WeightStore.create` reserves a slot for a version, filled chunk by chunk by the transport
  (`mark_verified`) or whole by a local writer (`finish`); `publish` makes it the latest by
  renaming `<prefix>.latest` into place after every chunk is verified. While a slot is being
  written its owner holds an exclusive flock on it, so a reader never sees half a version.
- At most `keep_versions` versions are offered; a slot whose old version a reader still holds
  (shared flock) is never overwritten: a new slot is added instead, and removed again once
  released (`collect`).
- `VersionBuffer`: one version in a slot, with per-chunk state the transport waits on, and
  its `Delta` when it travels as one (delta.py): the base version's number and each chunk's
  encoded payload, kept in memory to forward; the slot always holds the whole version.
- `cleanup`: remove every file of a prefix (a relay killed with SIGKILL cannot clean up after
  itself; the next store with that prefix, or the runtime, calls this).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time
from pathlib import Path

from laminar.relay.version import VersionHeader, close_map, pointer_path, read_header, write_header

MISSING, RECEIVING, VERIFIED = 0, 1, 2  # chunk states


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
            close_map(self.mm)
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
            close_map(self.mm)
        self.file.close()
        os.close(self.fd)
        if unlink:
            self.path.unlink(missing_ok=True)


class Delta:
    """A version as a delta against `base`: `payloads[i]` is chunk i's encoding (delta.py),
    None until known, b"" for a chunk that is forwarded whole."""

    def __init__(self, base: int, num_chunks: int) -> None:
        self.base = base
        self.payloads: list[bytes | None] = [None] * num_chunks

    @property
    def nbytes(self) -> int:
        """Bytes this delta puts on the wire, once every payload is known (whole chunks: 0)."""
        return sum(len(p) for p in self.payloads if p)


class VersionBuffer:
    """One version in a slot of the owner process, with per-chunk state."""

    def __init__(self, slot: _Slot, header: VersionHeader, cond: threading.Condition) -> None:
        self.slot, self.header, self._cond = slot, header, cond
        self.created_at = time.time()  # when its offer (or a local writer's reservation) came
        self.data = memoryview(slot.mm)[header.data_offset:header.file_size]
        self.state = bytearray(header.num_chunks)
        self.num_verified = 0
        self.num_received = 0  # chunk frames that arrived for this version (duplicates included)
        self.num_rejected = 0  # of those, how many failed their checksum
        self.wire_bytes = 0  # chunk payload bytes that arrived (a delta's: its encoding)
        self.delta: Delta | None = None  # set when it travels as a delta against a base
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

    def wait_sendable(self, i: int, timeout: float) -> bool:
        """Block until chunk i may be forwarded: verified and, for a delta, encoded."""
        with self._cond:
            return self._cond.wait_for(lambda: self.state[i] == VERIFIED and (
                self.delta is None or self.delta.payloads[i] is not None), timeout)

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
                write_header(slot.mm, header)
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
            write_header(buf.slot.mm, header)
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
            self.finish(buf, read_header(buf.slot.mm, buf.path))
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
        """The latest published version: complete, what readers get (the pointer file)."""
        with self.cond:
            return self._versions.get(self._latest) if self._latest is not None else None

    def forwardable(self) -> VersionBuffer | None:
        """The newest version that may be forwarded down the chain, complete or still
        arriving (its header is final): newer than `latest()` while it arrives."""
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
