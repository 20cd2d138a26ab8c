"""Prompt order: epochs over the task's prompts, shuffled per epoch, resumable.

`PromptSampler` is the pure core (no Ray): it hands out `PromptGroup`s in a deterministic order
given a seed, and its position is part of every checkpoint so a resumed run sees the same data.
`PromptEncoder` turns a prompt into its token ids without transformers, so the prompt pool's
process does not import transformers or torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from laminar.pools.store import Store, open_store
from laminar.types import PromptGroup, PromptItem


class PromptEncoder:
    """A prompt's token ids, BOS first when the tokenizer has one: what
    `laminar.models.tokenizer.encode_prompt` gives, through the fast tokenizer's Rust backend
    alone. It pickles without transformers, so the prompt pool that unpickles it never imports
    transformers or torch (about 4 s of CPU and 300 MB at every start of a job)."""

    def __init__(self, backend: Any, bos_token_id: int | None) -> None:
        self.backend, self.bos_token_id = backend, bos_token_id  # a `tokenizers.Tokenizer`

    @classmethod
    def of(cls, tokenizer: Any) -> Callable[[str], list[int]]:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:  # a slow (pure Python) tokenizer: the pool imports transformers after all
            from laminar.models.tokenizer import encode_prompt  # transformers, torch

            return partial(encode_prompt, tokenizer)
        return cls(backend, tokenizer.bos_token_id)

    def __call__(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ids if self.bos_token_id is None else [self.bos_token_id, *ids]


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
    `returned` (pending re-issue) or `completed`: issued = leased + returned + completed.

    Durability (laminar/pools/store.py): the sampler's position and every group's state
    (`leases` table: index, owner, leased | returned | completed) are written through to the
    store; a lease commits before it is answered, the rest is batched. `restore=True` rebuilds
    the pool from the store (after `laminar.pools.resume.reconcile`): leases of the dead job
    keep their owner name, with a deadline already past, so the manager returns them."""

    def __init__(self, sampler: PromptSampler, lease_timeout_s: float = 600.0,
                 max_outstanding: int | None = None, store: Store | str | None = None,
                 restore: bool = False) -> None:
        self.sampler = sampler
        self.lease_timeout_s = lease_timeout_s
        self.max_outstanding = max_outstanding  # admission control: groups not yet trained
        self.consumed = 0  # groups the trainer has taken
        self.issued = 0  # distinct groups ever handed out (re-issues not counted)
        self.leases: dict[str, tuple[PromptGroup, str, float]] = {}  # group id -> (group, owner, deadline)
        self.returned: list[PromptGroup] = []  # groups of dead owners, issued again first
        self.completed: list[str] = []
        self.store = open_store(store)
        self.seq = 0  # order of the rows written (the returned queue's order on restore)
        if restore:
            self._restore()

    # ------------------------------------------------------------------------- durability

    def _row(self, group: PromptGroup, owner: str | None, state: str) -> None:
        self.seq += 1
        self.store.put("leases", group.group_id, {"index": group.item.index, "owner": owner,
                                                  "state": state, "seq": self.seq})

    def _save_position(self) -> None:
        self.store.put("meta", "prompts", {"sampler": self.sampler.state_dict(), "issued": self.issued,
                                           "consumed": self.consumed, "seq": self.seq})

    def _group(self, group_id: str, index: int) -> PromptGroup:
        item = self.sampler.items[index]
        return PromptGroup(group_id, item, self.sampler.encode(item.prompt), self.sampler.num_samples)

    def _restore(self) -> None:
        meta = self.store.load("meta").get("prompts")
        if meta is None:
            return  # nothing was ever leased
        self.sampler.load_state_dict(meta["sampler"])
        self.issued, self.consumed, self.seq = meta["issued"], meta["consumed"], meta["seq"]
        rows = sorted(self.store.load("leases").items(), key=lambda kv: kv[1]["seq"])
        expired = time.monotonic() - 1.0
        for gid, row in rows:
            if row["state"] == "completed":
                self.completed.append(gid)
            elif row["state"] == "returned":
                self.returned.append(self._group(gid, row["index"]))
            else:
                self.leases[gid] = (self._group(gid, row["index"]), row["owner"], expired)
            self.seq = max(self.seq, row["seq"])

    def flush(self) -> None:
        """Commit what is batched (the runtime calls it at the end of a run)."""
        self._save_position()
        self.store.commit()

    def outstanding(self) -> int:
        """Groups handed out (or due to be) that the trainer has not consumed yet."""
        return len(self.leases) + len(self.returned) + len(self.completed) - self.consumed

    def untrained(self) -> int:
        """Groups leased or complete that the trainer has not taken (`outstanding` less those
        waiting to be issued again): after a resume, the batch the killed job was making."""
        return self.outstanding() - len(self.returned)

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
            self._row(group, owner, "leased")
            groups.append(group)
        if groups:
            self._save_position()
            self.store.commit()  # a durable point: what a rollout holds is on disk first
        return groups

    def renew(self, owner: str, now: float | None = None) -> None:
        """An owner's heartbeat: push its deadlines out."""
        now = time.monotonic() if now is None else now
        for gid, (group, who, _) in self.leases.items():
            if who == owner:
                self.leases[gid] = (group, who, now + self.lease_timeout_s)
        self.store.maybe_commit()  # the heartbeats keep batched writes flowing

    def complete(self, group_id: str) -> bool:
        """Every sample of the group reached the experience buffer; False if not leased."""
        lease = self.leases.pop(group_id, None)
        if lease is None:
            return False
        self.completed.append(group_id)
        self._row(lease[0], lease[1], "completed")
        self.store.maybe_commit()
        return True

    def complete_many(self, group_ids: list[str]) -> int:
        """`complete` for several groups in one call; returns how many were leased."""
        return sum(self.complete(gid) for gid in group_ids)

    def release_owner(self, owner: str, keep: set[str] = frozenset()) -> list[str]:
        """A dead owner's leases return to the pool, except groups in `keep` (whose samples live
        on elsewhere: in the partial pool or the buffer). Returns the group ids returned."""
        back = [gid for gid, (_, who, _) in self.leases.items() if who == owner and gid not in keep]
        for gid in back:
            group = self.leases.pop(gid)[0]
            self.returned.append(group)
            self._row(group, None, "returned")
        if back:
            self.store.maybe_commit()
        return back

    def expired_owners(self, now: float | None = None) -> set[str]:
        """Owners with a lease past its deadline: they stopped renewing. The rollout manager
        asks every health check and fails over (or releases) any of them."""
        now = time.monotonic() if now is None else now
        return {who for _, who, deadline in self.leases.values() if deadline < now}

    def mark_consumed(self, n: int) -> None:
        self.consumed += n
        self._save_position()
        self.store.maybe_commit()

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
