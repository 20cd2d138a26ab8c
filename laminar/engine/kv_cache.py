"""The KV buffer: one preallocated tensor, a slot per running sequence, written in place.

Layout: `kv[0 or 1, layer, slot, kv_head, position, head_dim]` (keys, values). Running sequences
occupy slots 0..n-1 with no holes, so a decode step attends over the slice `[:n, :, :L]` — a view,
never a copy. A step writes only its new tokens (`write`); a sequence that leaves has its slot
filled by the last running one (`move`: one copy of that row, once). The position axis grows
by doubling when a longer sequence arrives (`reserve`), so the cost of growth is paid a
logarithmic number of times, not per step.

Capacity in *tokens* (what the scheduler admits against and what `stats()` reports) is counted
by the scheduler; this buffer's size is max_batch x longest sequence seen (rounded up to a
power of two). `kv_capacity_from_memory` turns a memory budget into a token capacity.
"""

from __future__ import annotations

import torch

_MIN_POSITIONS = 64


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.dtype = dtype
        self.device = device
        with torch.inference_mode():  # every later write happens in inference mode too
            self.kv = self._allocate(min(_MIN_POSITIONS, max_positions))

    @property
    def num_positions(self) -> int:
        return self.kv.shape[4]

    def _allocate(self, positions: int) -> torch.Tensor:
        # zeros, not empty: masked-out positions still flow through the attention matmuls, and
        # 0 * NaN from uninitialised memory would poison real rows
        return torch.zeros(2, self.num_layers, self.num_slots, self.num_kv_heads, positions,
                           self.head_dim, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def reserve(self, positions: int) -> None:
        """Make room for sequences of `positions` tokens (grows by doubling, keeps contents)."""
        if positions <= self.num_positions:
            return
        if positions > self.max_positions:
            raise ValueError(f"a sequence of {positions} tokens exceeds the model's "
                             f"max_position_embeddings={self.max_positions}")
        new_size = min(self.max_positions, max(positions, 2 * self.num_positions))
        grown = self._allocate(new_size)
        grown[..., :self.num_positions, :] = self.kv
        self.kv = grown

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer, each [slots, kv_heads, positions, head_dim]."""
        return self.kv[0, index], self.kv[1, index]

    @torch.inference_mode()
    def move(self, dst: list[int], src: list[int], length: int) -> None:
        """Copy the first `length` positions of slots `src` into slots `dst` (all layers)."""
        if not dst:
            return
        dst_idx = torch.tensor(dst, device=self.device)
        src_idx = torch.tensor(src, device=self.device)
        self.kv[:, :, dst_idx, :, :length] = self.kv[:, :, src_idx, :, :length]

    def bytes_per_token(self) -> int:
        return bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * element


def kv_capacity_from_memory(model_config, memory_bytes: int, dtype: torch.dtype) -> int:
    """KV tokens that fit in `memory_bytes` for a transformers model config."""
    head_dim = getattr(model_config, "head_dim", None) or (
        model_config.hidden_size // model_config.num_attention_heads)
    per_token = bytes_per_token(model_config.num_hidden_layers, model_config.num_key_value_heads,
                                head_dim, dtype)
    return int(memory_bytes // per_token)
