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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from laminar.types import SamplingParams

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31, so that a 32-bit value times one stays inside int64 (no overflow).
_MUL1, _MUL2 = 0x7FEB352D, 0x2C1B3C6D
_GOLDEN = 0x1E3779B9


@dataclass(slots=True)
class SamplingRows:
    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows
    top_k: torch.Tensor  # [B] int64; vocab size where off
    top_p: torch.Tensor  # [B] float32; > 1 where off (never filters)
    greedy: torch.Tensor  # [B] bool
    seeds: torch.Tensor  # [B] int64
    counters: torch.Tensor  # [B] int64; index of the token being drawn within its request
    all_greedy: bool
    any_filter: bool  # some non-greedy row uses top-k or top-p

    @staticmethod
    def build(params: Sequence[SamplingParams], seeds: Sequence[int], counters: Sequence[int],
              vocab_size: int, device: torch.device | str = "cpu") -> "SamplingRows":
        greedy = [p.temperature == 0.0 for p in params]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = [vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size)
                 for p, g in zip(params, greedy)]
        top_p = [2.0 if g or p.top_p >= 1.0 else p.top_p for p, g in zip(params, greedy)]
        any_filter = any(k < vocab_size for k in top_k) or any(p <= 1.0 for p in top_p)
        return SamplingRows(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            seeds=torch.tensor(seeds, dtype=torch.long, device=device),
            counters=torch.tensor(counters, dtype=torch.long, device=device),
            all_greedy=all(greedy), any_filter=any_filter)


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
    vocab_ids = _mix32(torch.arange(vocab_size, device=seeds.device, dtype=torch.long) + _GOLDEN)
    bits = _mix32(key[:, None] ^ vocab_ids[None, :])
    uniform = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))  # 24 bits: exact in float32, in (0, 1)
    return -torch.log(-torch.log(uniform))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An integer hash on int64 tensors holding 32-bit values (xorshift-multiply rounds)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 16)
