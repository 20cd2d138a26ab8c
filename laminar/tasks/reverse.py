"""The built-in `reverse` task: the answer is the prompt string reversed.

A prompt reads `abc=` and its answer `cba`. Lengths are log-normal around `median_len`, clipped
to [min_len, max_len]: with tail_sigma 1.0 the p99 is ~10x the median, the long tail of the
paper's Fig. 2 that makes static batches wait for their slowest member.
"""

from __future__ import annotations

import numpy as np

from laminar.config import ReverseTaskConfig
from laminar.types import PromptItem

SEPARATOR = "="


def sample_lengths(cfg: ReverseTaskConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    raw = cfg.median_len * np.exp(cfg.tail_sigma * rng.standard_normal(n))
    return np.clip(np.rint(raw), cfg.min_len, cfg.max_len).astype(int)


def make_prompts(cfg: ReverseTaskConfig, n: int, seed: int) -> list[PromptItem]:
    rng = np.random.default_rng(seed)
    alphabet = np.array(list(cfg.alphabet))
    items = []
    for i, length in enumerate(sample_lengths(cfg, n, rng)):
        text = "".join(rng.choice(alphabet, size=length))
        items.append(PromptItem(index=i, prompt=text + SEPARATOR, answer=text[::-1]))
    return items
