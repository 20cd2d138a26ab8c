"""Micro-batches by token budget: sort sequences by length and cut them into groups whose padded
size (rows x longest row) stays under a budget. On long-tailed lengths this removes most of the
padding a random batch would carry (one 140-token sample no longer pads 63 short ones)."""

from __future__ import annotations

from collections.abc import Sequence


def token_budget_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices into `lengths`, grouped; each group has len(group) * max(length) <= max_tokens,
    except that a single sequence longer than the budget forms a group of its own."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:  # ascending, so lengths[i] is the longest of `current + [i]`
        if current and (len(current) + 1) * lengths[i] > max_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups
