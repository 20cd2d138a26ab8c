"""The reader side of a relay's weight store (rollout processes on the relay's node).

`ShmReader(shm_dir, prefix)` keeps each slot file of the relay mapped between pulls, so a pull
after the first costs a lock and a copy, not a page-table rebuild. `newest_version()` is one
small file read. `open_latest()` returns a `Snapshot`: a complete version under a shared flock
(the owner never overwrites a held slot), whose `data` is the mapped buffer, no copy. It stays
valid until `close()`: copy out of it (load_weights does), do not keep views past that.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time
from pathlib import Path

from laminar.relay.version import VersionHeader, checksums, close_map, read_header, read_pointer


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
        close_map(self.mm)
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
        return read_pointer(self.directory, self.prefix)[0]

    def open_latest(self, newer_than: int | None = None, attempts: int = 100) -> "Snapshot | None":
        """The newest published version under a shared lock, or None if there is none newer
        than `newer_than`."""
        for _ in range(attempts):
            version, slot_name = read_pointer(self.directory, self.prefix)
            if version is None or (newer_than is not None and version <= newer_than):
                return None
            try:
                m = self._acquire(slot_name)
            except (FileNotFoundError, BlockingIOError):
                time.sleep(0.001)  # being rewritten or removed: the pointer has moved on
                continue
            header = read_header(m.mm, self.directory / slot_name)
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
            for gone in [n for n in self._maps if n != slot_name and not (self.directory / n).exists()]:
                self._forget(gone)  # the owner removed that slot: do not keep its pages alive
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

    def mapped_slots(self) -> list[str]:
        """Slot files this reader keeps mapped (each costs address space, not a copy)."""
        with self._lock:
            return sorted(self._maps)

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
    return read_pointer(directory, prefix)[0]
