"""Vectorised sampling for a whole batch: temperature, top-k, top-p and seeds as per-row tensors.

    rows = SamplingRows.build(params_list, seeds, counters, device)
    tokens, logprobs = sample(logits, rows)          # [B] token ids, [B] log-probs

Parts:
- `SamplingRows`: the per-row settings as tensors, plus two flags that let the common cases
  (all greedy; no top-k/top-p anywhere) skip work.
- `process_logits`: temperature, then top-k, then top-p (the order `transformers` applies them),
  all rows at once. Its log-softmax is the sampling distribution whose log-probs we report:
  the behaviour policy that PPO/GRPO importance ratios need. Greedy rows keep the raw logits
  (temperature 1, no filtering), so their log-probs are the model's own, as in `HFEngine`.
- `gumbel_noise`: counter-based noise from an integer hash of (seed, token index, vocab id).
  A row's draw depends on nothing else — not on the batch it shares, the step it runs in or the
  engine it runs on — so a seeded request samples the same tokens however it is scheduled, and
  an aborted request resumed elsewhere continues exactly as if it had never moved.
- `sample`: Gumbel-max over the processed log-probs, i.e. an exact draw from the distribution.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from laminar.types import SamplingParams

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31, so that a 32-bit value times one stays inside int64 (no overflow).
_MUL1, _MUL2 = 0x7FEB352D, 0x2C1B3C6D
_GOLDEN = 0x1E3779B9


def sampling_row(params: SamplingParams) -> tuple[tuple[float, float, float, float], bool, bool]:
    """A request's settings as one row of floats (temperature, top-k, top-p, greedy) with the
    "off" values filled in, plus (is greedy, uses top-k or top-p). Computed once per request."""
    greedy = params.temperature == 0.0
    top_k = float(params.top_k) if params.top_k > 0 and not greedy else _OFF_TOP_K
    top_p = params.top_p if params.top_p < 1.0 and not greedy else _OFF_TOP_P
    temperature = 1.0 if greedy else params.temperature
    filtered = top_k != _OFF_TOP_K or top_p != _OFF_TOP_P
    return (temperature, top_k, top_p, float(greedy)), greedy, filtered


_OFF_TOP_K = float(1 << 30)  # clamped to the vocabulary size
_OFF_TOP_P = 2.0  # above any cumulative mass: never filters


@dataclass(slots=True)
class SamplingRows:
    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows
    top_k: torch.Tensor  # [B] int64; >= vocab size where off
    top_p: torch.Tensor  # [B] float32; > 1 where off (never filters)
    greedy: torch.Tensor  # [B] bool
    seeds: torch.Tensor  # [B] int64
    counters: torch.Tensor  # [B] int64; index of the token being drawn within its request
    all_greedy: bool
    any_filter: bool  # some non-greedy row uses top-k or top-p

    @staticmethod
    def build(params: Sequence[SamplingParams], seeds: Sequence[int], counters: Sequence[int],
              device: torch.device | str = "cpu") -> "SamplingRows":
        rows = [sampling_row(p) for p in params]
        return SamplingRows.from_rows([r[0] for r in rows], list(zip(seeds, counters)),
                                      all(r[1] for r in rows), any(r[2] for r in rows), device)

    @staticmethod
    def from_rows(rows: Sequence[tuple[float, float, float, float]],
                  seeds_counters: Sequence[tuple[int, int]], all_greedy: bool, any_filter: bool,
                  device: torch.device | str = "cpu") -> "SamplingRows":
        """From precomputed `sampling_row`s: two host-to-device copies for the whole batch."""
        table = torch.tensor(rows, dtype=torch.float32, device=device)  # [B, 4]
        ints = torch.tensor(seeds_counters, dtype=torch.long, device=device)  # [B, 2]
        return SamplingRows(temperature=table[:, 0], top_k=table[:, 1].long(), top_p=table[:, 2],
                            greedy=table[:, 3] > 0, seeds=ints[:, 0], counters=ints[:, 1],
                            all_greedy=all_greedy, any_filter=any_filter)


def process_logits(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Logits [B, V] -> processed float32 logits with filtered entries at -inf."""
    logits = logits.float()
    if rows.all_greedy:
        return logits
    scaled = logits / rows.temperature[:, None]
    if not rows.any_filter:
        return scaled
    vocab = scaled.shape[-1]
    sorted_vals = scaled.sort(dim=-1, descending=True).values
    # top_k >= vocab (off) keeps every column
    in_top_k = torch.arange(vocab, device=scaled.device)[None, :] < rows.top_k[:, None]
    probs = sorted_vals.masked_fill(~in_top_k, float("-inf")).softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs
    # keep the smallest prefix whose mass reaches top_p (the first token always survives)
    num_keep = (in_top_k & (mass_above < rows.top_p[:, None])).sum(dim=-1).clamp_(min=1)
    cutoff = sorted_vals.gather(-1, (num_keep - 1)[:, None])
    return scaled.masked_fill(scaled < cutoff, float("-inf"))


def sample(logits: torch.Tensor, rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. Returns (token ids [B] int64, their log-probs [B] float32)."""
    logprobs = process_logits(logits, rows).log_softmax(dim=-1)
    if rows.all_greedy:
        tokens = logprobs.argmax(dim=-1)
    else:
        noise = gumbel_noise(rows.seeds, rows.counters, logprobs.shape[-1])
        drawn = (logprobs + noise).argmax(dim=-1)
        tokens = torch.where(rows.greedy, logprobs.argmax(dim=-1), drawn)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [B, V], a pure function of (seed, counter, vocab index)."""
    key = _mix32(seeds & _MASK32) ^ _mix32(((seeds >> 32) & _MASK32) ^ _GOLDEN)
    key = _mix32(key ^ _mix32(counters & _MASK32))
    bits = _mix32(key[:, None] ^ _vocab_hash(vocab_size, seeds.device)[None, :])
    # 24 bits: exact in float32, strictly inside (0, 1)
    uniform = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(uniform))


@functools.cache
def _vocab_hash(vocab_size: int, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # a plain tensor, usable in and out of inference mode
        return _mix32(torch.arange(vocab_size, device=device, dtype=torch.long) + _GOLDEN)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An integer hash on int64 tensors holding 32-bit values (xorshift-multiply rounds)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 16)
