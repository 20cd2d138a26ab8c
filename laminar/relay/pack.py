"""Named tensors into one weight version's flat buffer (torch).

- `prepare_version`: the header (the layout of the tensors, torch or numpy, in the buffer) and
  the tensors as torch.
- `write_version`: copy them in (one copy; from a GPU this is the device-to-host copy) and
  compute a crc32 per chunk.

The trainer's pusher (client.py) and a master relay publishing a state dict (relay.py) use both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from laminar.relay.version import VersionHeader, checksums, layout


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def prepare_version(named_tensors: Mapping[str, Any], version: int,
                    chunk_bytes: int) -> tuple[VersionHeader, list[torch.Tensor]]:
    """The header (layout, no checksums yet) and the tensors, torch or numpy, as torch."""
    tensors = [v if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v))
               for v in named_tensors.values()]
    header = layout(((k, _dtype_name(t), tuple(t.shape)) for k, t in zip(named_tensors, tensors)),
                    version, chunk_bytes)
    return header, tensors


def write_version(data: memoryview, header: VersionHeader, tensors: list[torch.Tensor]) -> None:
    """Copy tensors into a version's flat buffer (from a GPU: the device-to-host copy) and
    compute the per-chunk checksums into `header`."""
    flat = torch.from_numpy(np.frombuffer(data, dtype=np.uint8))
    for entry, t in zip(header.tensors, tensors):
        flat[entry.offset:entry.offset + entry.nbytes].copy_(
            t.detach().contiguous().reshape(-1).view(torch.uint8))
    del flat
    header.checksums = checksums(data, header)
