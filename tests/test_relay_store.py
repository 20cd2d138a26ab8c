"""The shared-memory weight store, with readers in real separate processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid
import zlib
from pathlib import Path

import numpy as np
import pytest

from laminar.relay.reader import ShmReader, read_latest_version
from laminar.relay.store import WeightStore, cleanup
from laminar.relay.version import layout

SHM = "/dev/shm"


@pytest.fixture
def prefix():
    p = f"lam-test-{uuid.uuid4().hex[:8]}"
    yield p
    left = sorted(x.name for x in Path(SHM).glob(f"{p}.*"))
    cleanup(SHM, p)
    assert not left, f"test left shared-memory files behind: {left}"


def put_version(store: WeightStore, version: int, nbytes: int = 1 << 20, chunk: int = 64 << 10,
                pause_s: float = 0.0) -> None:
    """Write a version the way the transport does: chunk by chunk into the segment, then publish.
    Every byte of version v is v % 251, so a reader can tell versions apart and spot mixes."""
    header = layout([("a", "uint8", (nbytes // 2,)), ("b", "float32", (nbytes // 8,))], version, chunk)
    data = bytes([version % 251]) * header.nbytes
    header.checksums = [zlib.crc32(data[a:b]) for a, b in map(header.chunk_range, range(header.num_chunks))]
    buf = store.create(header)
    for i in range(header.num_chunks):
        a, b = header.chunk_range(i)
        buf.chunk(i)[:] = data[a:b]
        store.mark_verified(buf, i)
        if pause_s:
            time.sleep(pause_s)
    store.publish(version)


def test_a_published_version_reads_back_with_its_index(prefix):
    store = WeightStore(SHM, prefix, keep_versions=2)
    reader = ShmReader(SHM, prefix)
    try:
        assert read_latest_version(SHM, prefix) is None and reader.open_latest() is None
        put_version(store, 3)
        assert read_latest_version(SHM, prefix) == reader.newest_version() == 3
        with reader.open_latest() as snap:
            assert snap.version == 3
            assert [t.name for t in snap.header.tensors] == ["a", "b"]
            assert snap.header.tensors[1].offset % 64 == 0
            assert snap.verify() == []
            assert set(np.frombuffer(snap.data, dtype=np.uint8)) == {3}
        assert reader.open_latest(newer_than=3) is None
    finally:
        reader.close()
        store.close()


def test_slots_are_reused_instead_of_new_files_per_version(prefix):
    store = WeightStore(SHM, prefix, keep_versions=2)
    reader = ShmReader(SHM, prefix)
    try:
        for v in range(1, 8):
            put_version(store, v)
            with reader.open_latest() as snap:
                assert snap.version == v and snap.verify() == []
        assert store.versions() == [6, 7]
        assert sorted(p.name for p in Path(SHM).glob(f"{prefix}.s*")) == [f"{prefix}.s0", f"{prefix}.s1"]
    finally:
        reader.close()
        store.close()


def test_only_complete_versions_can_be_published(prefix):
    store = WeightStore(SHM, prefix)
    try:
        header = layout([("w", "uint8", (1000,))], 1, 256)
        header.checksums = [0] * header.num_chunks
        store.create(header)
        with pytest.raises(ValueError, match="only complete versions"):
            store.publish(1)
        assert read_latest_version(SHM, prefix) is None
    finally:
        store.close()


def _reader(prefix: str, seconds: float, out: mp.Queue) -> None:
    reads, versions, errors = 0, set(), []
    last = -1
    reader = ShmReader(SHM, prefix)
    end = time.time() + seconds
    while time.time() < end:
        snap = reader.open_latest()
        if snap is None:
            continue
        with snap:
            values = np.unique(np.frombuffer(snap.data, dtype=np.uint8))
            if list(values) != [snap.version % 251]:
                errors.append(f"version {snap.version} holds bytes {values[:5]}")
            if snap.verify():
                errors.append(f"version {snap.version} fails its checksums")
            if snap.version < last:
                errors.append(f"went back from {last} to {snap.version}")
            last = snap.version
        reads += 1
        versions.add(snap.version)
    out.put((reads, len(versions), errors))


def test_a_reader_always_sees_a_complete_version_while_newer_ones_are_written(prefix):
    store = WeightStore(SHM, prefix, keep_versions=2)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    put_version(store, 0)
    reader = ctx.Process(target=_reader, args=(prefix, 3.0, out))
    reader.start()
    try:
        v = 1
        while reader.is_alive():
            put_version(store, v, pause_s=0.002)  # slow writes: readers overlap every stage
            v += 1
        reads, distinct, errors = out.get(timeout=300)
    finally:
        reader.join(10)
        store.close()
    assert errors == []
    assert reads > 10 and distinct > 3, (reads, distinct)


def _holder(prefix: str, held: mp.Event, release: mp.Event, out: mp.Queue) -> None:
    snap = ShmReader(SHM, prefix).open_latest()
    view = np.frombuffer(snap.data, dtype=np.uint8)
    held.set()
    release.wait(300)  # meanwhile the owner writes three newer versions
    out.put((snap.version, bool((view == snap.version % 251).all()), snap.verify()))
    del view
    snap.close()


def slot_files(prefix: str) -> list[str]:
    return sorted(p.name for p in Path(SHM).glob(f"{prefix}.s*"))


def test_versions_a_reader_holds_are_kept_intact_and_released_after(prefix):
    store = WeightStore(SHM, prefix, keep_versions=2)
    ctx = mp.get_context("spawn")
    held, release, out = ctx.Event(), ctx.Event(), ctx.Queue()
    try:
        put_version(store, 1)
        holder = ctx.Process(target=_holder, args=(prefix, held, release, out))
        holder.start()
        assert held.wait(300)
        for v in (2, 3, 4):
            put_version(store, v)
        # K=2 versions are offered; v1's slot is held, so a third slot took its turn
        assert store.versions() == [3, 4]
        assert store.held_versions() == [1]
        assert len(slot_files(prefix)) == 3
        release.set()
        version, intact, bad_chunks = out.get(timeout=300)
        holder.join(30)
        assert (version, intact, bad_chunks) == (1, True, [])
        store.collect()
        assert len(slot_files(prefix)) == 2 and store.held_versions() == []
    finally:
        store.close()


def test_a_reader_lets_go_of_slots_the_owner_removed(prefix):
    """Regression: a removed extra slot is never re-created under its name, so a reader that
    kept it mapped would pin its memory for good."""
    store = WeightStore(SHM, prefix, keep_versions=2)
    reader = ShmReader(SHM, prefix)
    try:
        put_version(store, 1)
        held = reader.open_latest()  # holds s0 while three newer versions arrive
        for v in (2, 3, 4):
            put_version(store, v)
        assert len(slot_files(prefix)) == 3
        held.close()
        store.collect()  # s0 is spare and free now: removed
        assert len(slot_files(prefix)) == 2
        with reader.open_latest() as snap:
            assert snap.version == 4
        assert f"{prefix}.s0" not in reader.mapped_slots()
        assert set(reader.mapped_slots()) <= set(slot_files(prefix))
    finally:
        reader.close()
        store.close()


def test_a_new_store_removes_files_a_killed_owner_left_behind(prefix):
    store = WeightStore(SHM, prefix)
    put_version(store, 1)
    # as after SIGKILL: the owner's files stay, nothing closed them
    leftovers = sorted(p.name for p in Path(SHM).glob(f"{prefix}.*"))
    assert leftovers == [f"{prefix}.latest", f"{prefix}.s0"]
    again = WeightStore(SHM, prefix)
    assert not list(Path(SHM).glob(f"{prefix}.*"))
    again.close()
    store.close()


def test_store_rejects_bad_settings(prefix, tmp_path):
    with pytest.raises(ValueError, match="keep_versions=1"):
        WeightStore(SHM, prefix, keep_versions=1)
    with pytest.raises(ValueError, match="does not exist"):
        WeightStore(tmp_path / "nope", prefix)
    with pytest.raises(ValueError, match="dtype complex64"):
        layout([("x", "complex64", (2,))], 1, 1024)
    assert os.path.isdir(SHM)
