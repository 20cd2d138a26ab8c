"""The partial response pool: every unfinished trajectory's state, outside any rollout.

A rollout registers each sample when it leases the group, streams new tokens every few steps,
and removes the entry when the finished trajectory is in the experience buffer. Because the
state lives here, a rollout that dies or is released by repack loses nothing: its entries are
handed to another rollout of the same weight version, which re-prefills prompt + prefix and
continues. Pure; the runtime hosts it in a Ray actor.
"""

from __future__ import annotations

from dataclasses import dataclass

from laminar.types import GenerationRequest, PromptGroup


@dataclass(slots=True)
class PartialEntry:
    request: GenerationRequest  # prompt ids, tokens, log-probs and their versions so far
    group: PromptGroup  # the prompt (and reference answer) the sample belongs to
    owner: str  # rollout generating it now


@dataclass(slots=True)
class TokenUpdate:
    """New tokens of one trajectory since the last update (what a rollout streams)."""

    traj_id: str
    token_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]  # the version that generated each of them


class PartialPool:
    def __init__(self) -> None:
        self.entries: dict[str, PartialEntry] = {}

    def register(self, owner: str, group: PromptGroup, requests: list[GenerationRequest]) -> None:
        for req in requests:
            self.entries[req.request_id] = PartialEntry(_copy(req), group, owner)

    def register_many(self, owner: str, groups: list[tuple[PromptGroup, list[GenerationRequest]]]) -> None:
        for group, requests in groups:
            self.register(owner, group, requests)

    def update(self, owner: str, updates: list[TokenUpdate]) -> int:
        """Append streamed tokens; updates from a rollout that no longer owns the entry are
        ignored (it was declared dead or the entry moved). Returns how many were applied."""
        applied = 0
        for u in updates:
            entry = self.entries.get(u.traj_id)
            if entry is None or entry.owner != owner:
                continue
            req = entry.request
            req.output_ids.extend(u.token_ids)
            req.logprobs.extend(u.logprobs)
            req.token_versions.extend(u.token_versions)
            if req.version is None and u.token_versions:
                req.version = u.token_versions[0]
            applied += 1
        return applied

    def remove(self, traj_ids: list[str]) -> None:
        for tid in traj_ids:
            self.entries.pop(tid, None)

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

    def group_ids(self) -> set[str]:
        return {e.group.group_id for e in self.entries.values()}

    def __len__(self) -> int:
        return len(self.entries)


def _copy(req: GenerationRequest) -> GenerationRequest:
    """The pool's own record: the rollout's request object keeps growing in its engine."""
    return GenerationRequest(req.request_id, list(req.prompt_ids), req.params, list(req.output_ids),
                             list(req.logprobs), list(req.token_versions), req.version)
