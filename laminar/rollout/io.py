"""The four doors of a rollout loop, and their in-process implementations.

    prompts  (PromptSource)    ① lease prompt groups, renew the leases, close finished groups
    partials (PartialSink)     ② register and stream unfinished trajectories, drop finished ones
    buffer   (ExperienceSink)  ③ put finished trajectories; confirmations come back later
    weights  (WeightSource)    ⑦ the newest complete version, and loading it into the engine

Every call is non-blocking for the loop: a lease is asked with `request` and collected with
`poll`; a put is confirmed through `landed`. The Ray-backed implementations (actor calls) are
in `laminar/rollout/actor.py`; the in-process ones below wrap the pools themselves and serve
`cluster.backend: local` and the tests. `RelayWeights` reads the node's relay through shared
memory, so it serves both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from laminar.engine.protocol import WeightTarget
from laminar.pools.experience import ExperienceBuffer
from laminar.pools.partials import PartialPool
from laminar.pools.prompts import PromptPool
from laminar.relay.client import Puller
from laminar.relay.plan import RelayInfo
from laminar.types import GenerationRequest, PromptGroup, TokenDelta, Trajectory

Registration = tuple[PromptGroup, list[GenerationRequest]]


class PromptSource(Protocol):
    def request(self, owner: str, num_groups: int) -> None:
        """Ask for up to `num_groups` groups (admission control may hand out fewer or none)."""

    def poll(self) -> list[PromptGroup] | None:
        """The answer to the outstanding request once it has come; None before."""

    def renew(self, owner: str) -> None:
        """Heartbeat: push the owner's lease deadlines out."""

    def complete(self, group_ids: list[str]) -> None:
        """Every sample of these groups is safely in the experience buffer."""


class PartialSink(Protocol):
    def register(self, owner: str, registrations: list[Registration]) -> None: ...

    def update(self, owner: str, updates: list[TokenDelta]) -> None: ...

    def remove(self, traj_ids: list[str]) -> None: ...


class ExperienceSink(Protocol):
    def put(self, trajs: list[Trajectory]) -> None:
        """Store finished trajectories (idempotent on the trajectory id)."""

    def landed(self) -> list[tuple[list[str], list[str]]]:
        """Puts confirmed since the last call: (their trajectory ids, the groups they completed)."""

    def settle(self, timeout_s: float) -> None:
        """Wait until every put so far has been confirmed (or `timeout_s` passed)."""

    @property
    def num_unconfirmed(self) -> int: ...


class WeightSource(Protocol):
    def newest(self) -> int | None:
        """The newest complete version on offer (cheap: the loop asks every step)."""

    def load_newest(self, engine: WeightTarget, newer_than: int) -> int | None:
        """Load the newest version into `engine` (a rollout engine, or the LoRA merge in front
        of one) if it is newer than `newer_than`; its number."""


@dataclass
class RolloutIO:
    prompts: PromptSource
    partials: PartialSink
    buffer: ExperienceSink
    weights: WeightSource


# ---------------------------------------------------------------------------------------------
# In process


class LocalPrompts:
    def __init__(self, pool: PromptPool) -> None:
        self.pool = pool
        self.answer: list[PromptGroup] | None = None

    def request(self, owner: str, num_groups: int) -> None:
        self.answer = self.pool.lease(owner, num_groups)

    def poll(self) -> list[PromptGroup] | None:
        answer, self.answer = self.answer, None
        return answer

    def renew(self, owner: str) -> None:
        self.pool.renew(owner)

    def complete(self, group_ids: list[str]) -> None:
        self.pool.complete_many(group_ids)


class LocalPartials:
    def __init__(self, pool: PartialPool) -> None:
        self.pool = pool

    def register(self, owner: str, registrations: list[Registration]) -> None:
        self.pool.register_many(owner, registrations)

    def update(self, owner: str, updates: list[TokenDelta]) -> None:
        self.pool.update(owner, updates)

    def remove(self, traj_ids: list[str]) -> None:
        self.pool.remove(traj_ids)


class LocalBuffer:
    def __init__(self, buffer: ExperienceBuffer) -> None:
        self.buffer = buffer
        self.confirmed: list[tuple[list[str], list[str]]] = []

    def put(self, trajs: list[Trajectory]) -> None:
        self.confirmed.append(([t.traj_id for t in trajs], self.buffer.put_many(trajs)))

    def landed(self) -> list[tuple[list[str], list[str]]]:
        out, self.confirmed = self.confirmed, []
        return out

    def settle(self, timeout_s: float) -> None:
        pass  # every put is confirmed at once

    @property
    def num_unconfirmed(self) -> int:
        return 0


@dataclass
class WeightBoard:
    """The in-process stand-in for the relay tier: the trainer publishes a copy of its weights,
    rollouts in the same process load them."""

    version: int | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def publish(self, named: dict[str, torch.Tensor], version: int) -> None:
        self.tensors = {k: v.detach().clone() for k, v in named.items()}
        self.version = version


class BoardWeights:
    def __init__(self, board: WeightBoard) -> None:
        self.board = board

    def newest(self) -> int | None:
        return self.board.version

    def load_newest(self, engine: WeightTarget, newer_than: int) -> int | None:
        version = self.board.version
        if version is None or version <= newer_than:
            return None
        engine.load_weights(self.board.tensors, version)
        return version


class RelayWeights:
    """The relay on this rollout's node, read through shared memory (no RPC, no Ray).
    `newest` reads the relay's pointer file at most every `every_s` (the loop asks every step,
    hundreds of times a second; versions come seconds apart)."""

    def __init__(self, relay: dict[str, Any], cfg: Any, every_s: float = 0.02) -> None:
        self.puller = Puller(RelayInfo.from_dict(relay), cfg)
        self.every_s, self.read_at, self.last = every_s, float("-inf"), None

    def newest(self) -> int | None:
        now = time.monotonic()
        if now - self.read_at >= self.every_s:
            self.read_at, self.last = now, self.puller.newest_version()  # one small file read
        return self.last

    def load_newest(self, engine: WeightTarget, newer_than: int) -> int | None:
        return self.puller.pull_latest(engine, newer_than=newer_than)
