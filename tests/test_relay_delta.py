"""Delta chunks (laminar/relay/delta.py): decoding gives back the new bytes bit for bit, for
Adam-like updates at several learning rates in bf16 and fp32; malformed payloads are errors;
the rule for when a version goes whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from laminar.relay.delta import RAW, SPARSE, decode_chunk, encode_chunk, should_send_full

CHUNK = 1 << 14


def adam_like_updates(n: int, lr: float, dtype: torch.dtype, steps: int, seed: int):
    """(base bytes, new bytes) of `steps` successive versions: fp32 masters of magnitude ~0.02
    moved by lr * (an Adam step's m / sqrt(v), about +-1 per element), published as `dtype`."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g) * 0.02
    prev = master.to(dtype).view(torch.uint8).numpy().copy()
    for _ in range(steps):
        master -= lr * torch.randn(n, generator=g).clamp(-3, 3)
        new = master.to(dtype).view(torch.uint8).numpy().copy()
        yield prev, new
        prev = new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lr", [1e-6, 1e-5, 1e-4])
def test_reconstruction_is_bit_for_bit_over_50_updates(lr, dtype):
    kinds = set()
    for base, new in adam_like_updates(12_000 + 7, lr, dtype, 50, seed=int(lr * 1e7)):
        out = np.empty_like(new)
        for a in range(0, new.size, CHUNK):  # chunk by chunk, the last one short
            payload = encode_chunk(new[a:a + CHUNK].data, base[a:a + CHUNK].data)
            kinds.add(payload[0])
            assert len(payload) <= min(CHUNK, new.size - a) + 1  # never over full by more than its kind
            decode_chunk(payload, base[a:a + CHUNK].data, out[a:a + CHUNK].data)
        assert out.tobytes() == new.tobytes()
    if dtype == torch.bfloat16 and lr == 1e-6:
        assert kinds == {SPARSE}  # most words unchanged: the sparse encoding


def test_bf16_at_small_lr_is_a_small_fraction_of_full():
    base, new = next(adam_like_updates(100_000, 1e-6, torch.bfloat16, 1, seed=0))
    changed = np.mean(base.view(np.uint16) != new.view(np.uint16))
    size = sum(len(encode_chunk(new[a:a + CHUNK].data, base[a:a + CHUNK].data))
               for a in range(0, new.size, CHUNK))
    assert changed < 0.05 and size / new.size < 2.5 * changed + 0.01


def test_extreme_changes_are_escaped_and_each_kind_decodes():
    base = np.zeros(4096, dtype=np.uint16)
    new = base.copy()
    new[[0, 1, 300, 4095]] = [1, 40000, 65535, 2]  # steps in and out of int8, a gap over 255
    payload = encode_chunk(new.tobytes(), base.tobytes())
    assert payload[0] == SPARSE
    out = bytearray(base.nbytes)
    decode_chunk(payload, base.tobytes(), memoryview(out))
    assert bytes(out) == new.tobytes()
    dense = np.random.default_rng(0).integers(1, 65536, 4096, dtype=np.uint16)
    payload = encode_chunk(dense.tobytes(), base.tobytes())  # every word changed: whole
    assert payload[0] == RAW and len(payload) == dense.nbytes + 1
    decode_chunk(payload, base.tobytes(), memoryview(out))
    assert bytes(out) == dense.tobytes()


def test_malformed_payloads_are_errors():
    base = np.zeros(1024, dtype=np.uint16).tobytes()
    new = np.zeros(1024, dtype=np.uint16)
    new[5] = 3
    good = encode_chunk(new.tobytes(), base)
    out = memoryview(bytearray(len(base)))
    for bad in (b"", bytes([9]) + good[1:], good[:-1], good + b"x", bytes([RAW]) + b"short"):
        with pytest.raises(ValueError):
            decode_chunk(bad, base, out)


def test_a_full_version_every_n():
    assert should_send_full(1, None, 8)
    assert not should_send_full(5, 1, 8) and should_send_full(9, 1, 8)
    assert should_send_full(2, 1, 1) and should_send_full(2, 1, 0)
