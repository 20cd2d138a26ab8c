"""What a weight version is: one flat byte buffer, an index and a checksum per chunk.

Parts: `TensorEntry` (name, dtype, shape, offset of one tensor), `VersionHeader` (the index,
chunking and crc32s, serialised as JSON with fixed-width checksums so its size is known before
the data is written), `layout` (place tensors in a flat buffer), `checksums`, and the slot-file
helpers both sides use: `write_header` / `read_header` / `close_map` (a slot file is MAGIC, the header's
length, the header, then the buffer at a page-aligned offset) and `pointer_path` /
`read_pointer` (`<prefix>.latest` names the newest published version and its slot).
"""

from __future__ import annotations

import json
import mmap
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"LMRSEG02"
DATA_ALIGN = 4096  # the buffer starts on a page; tensors start on 64-byte boundaries
TENSOR_ALIGN = 64
DTYPE_SIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
               "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


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


def read_pointer(directory: str | Path, prefix: str) -> tuple[int | None, str]:
    try:
        version, slot = pointer_path(directory, prefix).read_text().split()
        return int(version), slot
    except (FileNotFoundError, ValueError):
        return None, ""


def write_header(mm: mmap.mmap, header: VersionHeader) -> None:
    raw = header.to_bytes()
    mm[0:8] = MAGIC
    mm[8:16] = len(raw).to_bytes(8, "little")
    mm[16:16 + len(raw)] = raw


def read_header(mm: mmap.mmap, path: Path) -> VersionHeader:
    if mm[0:8] != MAGIC:
        raise ValueError(f"'{path}' is not a laminar weight slot (bad magic)")
    n = int.from_bytes(mm[8:16], "little")
    return VersionHeader.from_bytes(mm[16:16 + n])


def close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # views still point into it; it is unmapped when the last of them goes


def _align(n: int, a: int) -> int:
    return -(-n // a) * a
