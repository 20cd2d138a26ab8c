"""Delta versions: one chunk of a version encoded against the same chunk of a base version.

A delta travels chunk by chunk like a full version (chain.py), and each chunk decodes on its
own, so a relay forwards delta chunk i while chunk i+1 arrives and rebuilds the FULL version
in its slot, checked against the full version's crc32s. Every encoding is exact: decoding
gives back the new chunk bit for bit.

Parts:
- `encode_chunk(new, base)`: one of two payloads, each one byte of kind first: `SPARSE` (the
  16-bit words that changed: their gaps as one byte each, a word's change as one signed byte,
  escapes for what does not fit) while under a third of the words changed, else `RAW` (the new
  bytes: a delta is never more than one byte a chunk over whole). In bf16 at small learning
  rates most words do not change and a changed one moves by one or two units of its last
  place, so a changed word costs about 2 bytes.
- `decode_chunk(payload, base, out)`: writes the new chunk into `out` (may be `base` itself).
- `xor_zlib_size`: the other candidate the benchmark measures, XOR of the raw bytes + zlib
  level 1 (zstd and lz4 are not installed). It is smaller than SPARSE only where most words
  change (lr >= 1e-5 in bf16, and fp32), and zlib encoded at 9-24 MB/s on this machine,
  slower than a 1 Gbit/s link sends the chunk whole; so the relay does not use it.
- `should_send_full(...)`: the pure rule for when a version goes whole (every N versions).

docs/relay.md ("Delta versions") has the measurements behind the choice.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

RAW, SPARSE = 0, 1
_COUNTS = struct.Struct("<III")  # changed words, gaps >= 255, changes outside int8
_BIG_GAP, _BIG_STEP = 255, -128  # escapes: the real value follows in its own array


def _words(view: memoryview | bytes | np.ndarray) -> np.ndarray:
    a = np.frombuffer(view, dtype=np.uint8)
    if a.size % 2:
        raise ValueError(f"a delta chunk has {a.size} bytes; chunks are whole 16-bit words")
    return a.view(np.uint16)


def _changed_words(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Indices of the words where `a` and `b` differ. Compared 64 bits at a time first: most
    blocks of four words are equal, and only the differing blocks are looked at word by word."""
    if a.size % 4:
        return np.flatnonzero(a != b)
    blocks = np.flatnonzero(a.view(np.uint64) != b.view(np.uint64))
    if 3 * blocks.size >= a.size:  # at least a third of the words changed: no need to count them
        return np.arange(a.size)
    words = (blocks[:, None] * 4 + np.arange(4)).reshape(-1)
    return words[a[words] != b[words]]


def encode_chunk(new: memoryview | bytes, base: memoryview | bytes) -> bytes:
    """The payload that turns `base` into `new` (same length): SPARSE when smaller, else RAW."""
    if len(new) != len(base):
        raise ValueError(f"chunk of {len(new)} bytes against a base chunk of {len(base)}")
    if len(new) % 2:
        return bytes([RAW]) + bytes(new)
    a, b = _words(new), _words(base)
    idx = _changed_words(a, b)
    if 3 * idx.size >= a.size:  # ~2 bytes a changed word: whole is as small, and cheaper
        return bytes([RAW]) + bytes(new)
    gaps = np.diff(idx, prepend=-1) - 1  # words skipped before each changed one
    big_gaps = gaps[gaps >= _BIG_GAP].astype("<u4")
    steps = (a[idx].astype(np.int32) - b[idx].astype(np.int32) + 32768) % 65536 - 32768
    wide = (steps < -127) | (steps > 127)
    big_vals = a[idx][wide].astype("<u2")
    small = np.where(wide, _BIG_STEP, steps).astype(np.int8)
    payload = b"".join((bytes([SPARSE]), _COUNTS.pack(idx.size, big_gaps.size, big_vals.size),
                        np.minimum(gaps, _BIG_GAP).astype(np.uint8).tobytes(), big_gaps.tobytes(),
                        small.tobytes(), big_vals.tobytes()))
    if len(payload) > len(new):
        return bytes([RAW]) + bytes(new)
    return payload


def decode_chunk(payload: bytes | memoryview, base: memoryview | bytes, out: memoryview) -> None:
    """Write the chunk that `payload` encodes against `base` into `out` (same length as the
    base; `out` may be the base's own memory). Raises ValueError on a malformed payload."""
    payload = memoryview(payload)
    if len(payload) == 0 or len(out) != len(base):
        raise ValueError("empty delta payload or an output of another size than the base")
    kind = payload[0]
    if kind == RAW:
        if len(payload) - 1 != len(out):
            raise ValueError(f"raw delta chunk of {len(payload) - 1} bytes for a {len(out)}-byte chunk")
        out[:] = payload[1:]
        return
    if kind != SPARSE:
        raise ValueError(f"unknown delta chunk kind {kind}")
    n, n_gaps, n_vals = _COUNTS.unpack_from(payload, 1)
    at = 1 + _COUNTS.size
    sizes = (n, 4 * n_gaps, n, 2 * n_vals)
    if at + sum(sizes) != len(payload) or n_gaps > n or n_vals > n:
        raise ValueError(f"sparse delta chunk of {len(payload)} bytes does not match its counts")
    parts = []
    for size in sizes:
        parts.append(payload[at:at + size])
        at += size
    gaps = np.frombuffer(parts[0], dtype=np.uint8).astype(np.int64)
    big = gaps == _BIG_GAP
    if int(big.sum()) != n_gaps:
        raise ValueError("sparse delta chunk: gap escapes do not match their count")
    gaps[big] = np.frombuffer(parts[1], dtype="<u4")
    idx = np.cumsum(gaps + 1) - 1
    words = _words(base)
    if idx.size and idx[-1] >= words.size:
        raise ValueError("sparse delta chunk points past the end of its chunk")
    steps = np.frombuffer(parts[2], dtype=np.int8)
    wide = steps == _BIG_STEP
    if int(wide.sum()) != n_vals:
        raise ValueError("sparse delta chunk: value escapes do not match their count")
    vals = ((words[idx].astype(np.int32) + steps) % 65536).astype(np.uint16)
    vals[wide] = np.frombuffer(parts[3], dtype="<u2")
    target = np.frombuffer(out, dtype=np.uint16)  # `out` is writable: the slot's memory
    target[:] = words
    target[idx] = vals


def xor_zlib_size(new: memoryview | bytes, base: memoryview | bytes, level: int = 1) -> int:
    """Bytes of the other candidate encoding, XOR of the raw bytes then zlib (measured only)."""
    x = np.bitwise_xor(np.frombuffer(new, dtype=np.uint8), np.frombuffer(base, dtype=np.uint8))
    return len(zlib.compress(x.tobytes(), level))


def should_send_full(version: int, last_full: int | None, full_every: int) -> bool:
    """A version goes whole when there is no full version to count from yet or `full_every`
    versions have passed since the last whole one (so a chain of deltas on a base is never
    longer than `full_every - 1`); full_every <= 1: every version whole."""
    return last_full is None or full_every <= 1 or version - last_full >= full_every
