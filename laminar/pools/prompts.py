"""Prompt order: epochs over the task's prompts, shuffled per epoch, resumable.

`PromptSampler` is the pure core (no Ray): it hands out `PromptGroup`s in a deterministic order
given a seed, and its position is part of every checkpoint so a resumed run sees the same data.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from laminar.types import PromptGroup, PromptItem


class PromptSampler:
    def __init__(self, items: list[PromptItem], encode: Callable[[str], list[int]],
                 num_samples: int, seed: int = 0) -> None:
        if not items:
            raise ValueError("PromptSampler needs at least one prompt")
        self.items = items
        self.encode = encode
        self.num_samples = num_samples
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.items))

    def next_group(self) -> PromptGroup:
        if self.position == len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        item = self.items[int(self._order[self.position])]
        group = PromptGroup(group_id=f"e{self.epoch}-p{self.position}", item=item,
                            prompt_ids=self.encode(item.prompt), num_samples=self.num_samples)
        self.position += 1
        return group

    def next_groups(self, n: int) -> list[PromptGroup]:
        return [self.next_group() for _ in range(n)]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
