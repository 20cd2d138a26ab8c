"""What the rollout manager needs of its neighbours: three small doors. The Ray actor
(actor.py) supplies Ray-backed ones; the unit tests (tests/test_manager.py) recording fakes.

- `Fleet`: the rollouts (snapshots, move work out and in, stop, start a replacement);
- `ManagerPools`: the partial pool's owners and the prompt pool's leases;
- `Relays`: the relay chain's health and its repair.
"""

from __future__ import annotations

from typing import Protocol

from laminar.pools.partials import PartialEntry
from laminar.types import GenerationRequest, RolloutSnapshot, Unfinished


class Fleet(Protocol):
    def snapshots(self, ids: list[str], timeout_s: float) -> tuple[dict[str, RolloutSnapshot], list[str]]:
        """Answers within `timeout_s`, and the ids whose process is gone."""

    def export(self, rollout_id: str) -> list[Unfinished]: ...

    def adopt(self, rollout_id: str, moved: list[Unfinished]) -> bool: ...

    def release(self, rollout_id: str) -> None: ...

    def stop(self, rollout_id: str) -> None: ...

    def drop(self, rollout_id: str) -> None:
        """Forget a dead rollout and make sure its process is gone (a hung one must not write
        results later)."""

    def set_relay(self, rollout_id: str, relay_id: str) -> None: ...

    def spawn(self, rollout_id: str, relay_id: str) -> None:
        """Start a new rollout process that pulls from `relay_id` (on its node); returns at once."""

    def spawned(self) -> tuple[list[str], dict[str, str]]:
        """Spawned rollouts that now run (started and answering), and those whose start
        failed, with why."""


class ManagerPools(Protocol):
    def owned_by(self, owner: str) -> list[PartialEntry]: ...

    def reassign(self, traj_ids: list[str], owner: str, states: list[GenerationRequest]) -> None: ...

    def live_groups(self) -> set[str]: ...  # groups with samples in the partial pool or buffer

    def release_owner(self, owner: str, keep: set[str]) -> list[str]: ...

    def expired_owners(self) -> set[str]: ...


class Relays(Protocol):
    def find_dead(self) -> list[str]: ...  # heartbeat every relay of the chain: the dead or hung

    def cut(self, dead: list[str]) -> None:
        """Re-plan the chain without `dead` (a dead master's successor becomes master); returns
        once the live relays and the trainer hold the new plan."""

    @property
    def order(self) -> list[str]: ...  # the chain now, master first

    @property
    def latest(self) -> dict[str, int | None]: ...  # the newest version each relay held at the last check
