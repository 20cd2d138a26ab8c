"""Prompt order: epochs over the task's prompts, shuffled per epoch, resumable.

`PromptSampler` is the pure core (no Ray): it hands out `PromptGroup`s in a deterministic order
given a seed, and its position is part of every checkpoint so a resumed run sees the same data.
"""

from __future__ import annotations

import time
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


class PromptPool:
    """Leases of prompt groups with an owner and a deadline (pure; the runtime hosts it in a
    Ray actor). A group is leased until `complete`; a dead owner's leases go back to the
    front of the queue, so nothing leased is ever lost.

    Accounting invariant: every group handed out is in exactly one of `leases` (in flight),
    `returned` (pending re-issue) or `completed`: issued = leased + returned + completed."""

    def __init__(self, sampler: PromptSampler, lease_timeout_s: float = 600.0,
                 max_outstanding: int | None = None) -> None:
        self.sampler = sampler
        self.lease_timeout_s = lease_timeout_s
        self.max_outstanding = max_outstanding  # admission control: groups not yet trained
        self.consumed = 0  # groups the trainer has taken
        self.issued = 0  # distinct groups ever handed out (re-issues not counted)
        self.leases: dict[str, tuple[PromptGroup, str, float]] = {}  # group id -> (group, owner, deadline)
        self.returned: list[PromptGroup] = []  # groups of dead owners, issued again first
        self.completed: list[str] = []

    def outstanding(self) -> int:
        """Groups handed out (or due to be) that the trainer has not consumed yet."""
        return len(self.leases) + len(self.returned) + len(self.completed) - self.consumed

    def lease(self, owner: str, n: int, now: float | None = None) -> list[PromptGroup]:
        """Up to `n` groups; fewer (possibly none) when admission control holds back."""
        if self.max_outstanding is not None:
            n = min(n, len(self.returned) + max(0, self.max_outstanding - self.outstanding()))
        now = time.monotonic() if now is None else now
        groups = []
        for _ in range(n):
            if self.returned:
                group = self.returned.pop(0)
            else:
                group = self.sampler.next_group()
                self.issued += 1
            self.leases[group.group_id] = (group, owner, now + self.lease_timeout_s)
            groups.append(group)
        return groups

    def renew(self, owner: str, now: float | None = None) -> None:
        """An owner's heartbeat: push its deadlines out."""
        now = time.monotonic() if now is None else now
        for gid, (group, who, _) in self.leases.items():
            if who == owner:
                self.leases[gid] = (group, who, now + self.lease_timeout_s)

    def complete(self, group_id: str) -> bool:
        """Every sample of the group reached the experience buffer; False if not leased."""
        if self.leases.pop(group_id, None) is None:
            return False
        self.completed.append(group_id)
        return True

    def complete_many(self, group_ids: list[str]) -> int:
        """`complete` for several groups in one call; returns how many were leased."""
        return sum(self.complete(gid) for gid in group_ids)

    def release_owner(self, owner: str, keep: set[str] = frozenset()) -> list[str]:
        """A dead owner's leases return to the pool, except groups in `keep` (whose samples live
        on elsewhere: in the partial pool or the buffer). Returns the group ids returned."""
        back = [gid for gid, (_, who, _) in self.leases.items() if who == owner and gid not in keep]
        for gid in back:
            self.returned.append(self.leases.pop(gid)[0])
        return back

    def expired_owners(self, now: float | None = None) -> set[str]:
        """Owners with a lease past its deadline: they stopped renewing. The rollout manager
        asks every health check and fails over (or releases) any of them."""
        now = time.monotonic() if now is None else now
        return {who for _, who, deadline in self.leases.values() if deadline < now}

    def mark_consumed(self, n: int) -> None:
        self.consumed += n

    def accounting(self) -> dict[str, int]:
        return {"issued": self.issued, "leased": len(self.leases), "returned": len(self.returned),
                "completed": len(self.completed), "consumed": self.consumed}

    def state_dict(self) -> dict:
        """Position plus every unfinished group, so a restored pool re-issues them first."""
        pending = [g for g, _, _ in self.leases.values()] + self.returned
        return {"sampler": self.sampler.state_dict(),
                "pending": [(g.group_id, g.item.index) for g in pending]}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.leases.clear()
        self.returned = [PromptGroup(gid, self.sampler.items[idx],
                                     self.sampler.encode(self.sampler.items[idx].prompt),
                                     self.sampler.num_samples) for gid, idx in state["pending"]]
