"""GRPO advantages: each reward normalised within its group of samples of the same prompt.

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

std is the unbiased sample standard deviation (as TRL and verl compute it). A group whose
rewards are all equal gets advantage 0 for every member: it carries no learning signal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def group_advantages(rewards: Sequence[float], group_ids: Sequence[str], eps: float = 1e-6) -> torch.Tensor:
    """One advantage per sample. Samples may arrive in any order; `group_ids` says which belong
    together. Returns a float32 tensor of shape [len(rewards)]."""
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    r = torch.tensor(rewards, dtype=torch.float32)
    out = torch.zeros_like(r)
    members: dict[str, list[int]] = {}
    for i, gid in enumerate(group_ids):
        members.setdefault(gid, []).append(i)
    for idx in members.values():
        g = r[idx]
        if len(idx) < 2:
            continue  # a lone sample has no baseline to compare against
        out[idx] = (g - g.mean()) / (g.std() + eps)
    return out
