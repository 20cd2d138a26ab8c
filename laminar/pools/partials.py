"""The partial response pool: every unfinished trajectory's state, outside any rollout.

A rollout registers each sample when it leases the group, streams new tokens every few steps,
and removes the entry when the finished trajectory is in the experience buffer. Because the
state lives here, a rollout that dies or is released by repack loses nothing: its entries are
handed to another rollout of the same weight version, which re-prefills prompt + prefix and
continues. Pure; the runtime hosts it in a Ray actor.

Durability (laminar/pools/store.py): every entry is written through (`partials` table:
owner, prompt group, request with its tokens so far). A registration commits before it
returns; streamed tokens are written at the store's batched commits (an entry rewritten once
per commit however many updates it got), so a whole-job kill loses at most the last
`commit_interval_s` of tokens, which are generated again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from laminar.pools.store import (Store, decode_group, decode_request, encode_group,
                                 encode_request, open_store)
from laminar.types import GenerationRequest, PromptGroup, TokenDelta


@dataclass(slots=True)
class PartialEntry:
    """The pool's durable record of a trajectory in flight: who generates it (`owner`) and its
    tokens as last streamed. A move between rollouts is an `Unfinished` (laminar.types)."""

    request: GenerationRequest  # prompt ids, tokens, log-probs and their versions so far
    group: PromptGroup  # the prompt (and reference answer) the sample belongs to
    owner: str  # rollout generating it now


class PartialPool:
    def __init__(self, store: Store | str | None = None, restore: bool = False) -> None:
        self.entries: dict[str, PartialEntry] = {}
        self.store = open_store(store)
        self.dirty: set[str] = set()  # entries changed since the last write to the store
        if restore:
            for tid, row in self.store.load("partials").items():
                self.entries[tid] = PartialEntry(decode_request(row["request"]),
                                                 decode_group(row["group"]), row["owner"])

    def _write(self, tid: str) -> None:
        entry = self.entries[tid]
        self.store.put("partials", tid, {"owner": entry.owner, "group": encode_group(entry.group),
                                         "request": encode_request(entry.request)})

    def _maybe_commit(self) -> None:
        """Write the entries that changed, when the store's batch interval has passed."""
        store = self.store
        if self.dirty and time.monotonic() - store.last_commit >= store.commit_interval_s:
            for tid in self.dirty:
                if tid in self.entries:
                    self._write(tid)
            self.dirty.clear()
        store.maybe_commit()

    def flush(self) -> None:
        for tid in self.dirty:
            if tid in self.entries:
                self._write(tid)
        self.dirty.clear()
        self.store.commit()

    def register(self, owner: str, group: PromptGroup, requests: list[GenerationRequest]) -> None:
        for req in requests:
            self.entries[req.request_id] = PartialEntry(_copy(req), group, owner)
            self._write(req.request_id)

    def register_many(self, owner: str, groups: list[tuple[PromptGroup, list[GenerationRequest]]]) -> None:
        for group, requests in groups:
            self.register(owner, group, requests)
        self.store.commit()  # a durable point: every started sample is on record before its put

    def update(self, owner: str, updates: list[TokenDelta]) -> int:
        """Append streamed tokens; updates from a rollout that no longer owns the entry are
        ignored (it was declared dead or the entry moved). Returns how many were applied."""
        applied = 0
        for u in updates:
            entry = self.entries.get(u.request_id)
            if entry is None or entry.owner != owner:
                continue
            req = entry.request
            req.output_ids.extend(u.token_ids)
            req.logprobs.extend(u.logprobs)
            req.token_versions.extend(u.token_versions)
            if req.version is None and u.token_versions:
                req.version = u.token_versions[0]
            self.dirty.add(u.request_id)
            applied += 1
        self._maybe_commit()
        return applied

    def remove(self, traj_ids: list[str]) -> None:
        for tid in traj_ids:
            self.entries.pop(tid, None)
            self.dirty.discard(tid)
        self.store.delete("partials", traj_ids)
        self._maybe_commit()

    def owned_by(self, owner: str) -> list[PartialEntry]:
        return [e for e in self.entries.values() if e.owner == owner]

    def reassign(self, traj_ids: list[str], owner: str,
                 states: list[GenerationRequest] | None = None) -> None:
        """Move entries to a new owner; `states` (from the source engine's abort) replace the
        streamed state when given, since they include tokens not yet streamed."""
        for i, tid in enumerate(traj_ids):
            entry = self.entries.get(tid)
            if entry is None:
                continue
            entry.owner = owner
            if states is not None:
                entry.request = _copy(states[i])
            self._write(tid)
        self._maybe_commit()

    def group_ids(self) -> set[str]:
        return {e.group.group_id for e in self.entries.values()}

    def size(self) -> int:
        """Trajectories in flight (a Ray actor method: `len()` cannot be called remotely)."""
        return len(self)

    def __len__(self) -> int:
        return len(self.entries)


def _copy(req: GenerationRequest) -> GenerationRequest:
    """The pool's own record: the rollout's request object keeps growing in its engine."""
    return GenerationRequest(req.request_id, list(req.prompt_ids), req.params, list(req.output_ids),
                             list(req.logprobs), list(req.token_versions), req.version)
