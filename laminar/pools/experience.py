"""The experience buffer: finished trajectories in, complete GRPO groups out.

- `put` is idempotent on the trajectory id: a retried put (after a timeout, a restart) never
  duplicates a sample.
- A group is released only when all of its samples are in (its advantages need all of them).
- `sample` takes complete groups by a pluggable policy, FIFO by completion by default.
- Groups released to the trainer stay held until it acknowledges a checkpoint (`ack`); if it
  dies, `requeue_unacked` gives them back, so a trainer crash loses no data.
- Nothing is ever dropped for being stale: staleness is bounded by pacing the rollouts
  (admission control at the prompt pool), since dropping biases training toward short
  responses.
Pure; the runtime hosts it in a Ray actor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from laminar.types import Trajectory

# policy(complete groups in completion order, how many, trainer version) -> indices to take
SamplingPolicy = Callable[[list[list[Trajectory]], int, int], list[int]]


def fifo(groups: list[list[Trajectory]], n: int, trainer_version: int) -> list[int]:
    return list(range(min(n, len(groups))))


@dataclass
class BufferStats:
    puts: int = 0
    duplicates: int = 0  # retried puts ignored
    groups_released: int = 0


class ExperienceBuffer:
    def __init__(self, group_size: int, policy: SamplingPolicy = fifo) -> None:
        self.group_size = group_size
        self.policy = policy
        self.seen: set[str] = set()  # every trajectory id ever put
        self.filling: dict[str, list[Trajectory]] = {}  # group id -> samples so far
        self.complete: list[list[Trajectory]] = []  # in completion order
        self.unacked: list[list[Trajectory]] = []  # released to the trainer, not yet checkpointed
        self.stats = BufferStats()

    def put(self, traj: Trajectory) -> bool:
        """Store one finished sample. Returns True when this put completed its group."""
        if traj.traj_id in self.seen:
            self.stats.duplicates += 1
            return False
        self.seen.add(traj.traj_id)
        self.stats.puts += 1
        samples = self.filling.setdefault(traj.group_id, [])
        samples.append(traj)
        if len(samples) < self.group_size:
            return False
        self.complete.append(sorted(self.filling.pop(traj.group_id), key=lambda t: t.traj_id))
        return True

    def put_many(self, trajs: list[Trajectory]) -> list[str]:
        """Store several samples; returns the ids of the groups they completed."""
        return [t.group_id for t in trajs if self.put(t)]

    def num_ready(self) -> int:
        return len(self.complete)

    def sample(self, num_groups: int, trainer_version: int) -> list[list[Trajectory]] | None:
        """`num_groups` complete groups, or None (nothing taken) if fewer are ready."""
        if len(self.complete) < num_groups:
            return None
        picks = sorted(self.policy(self.complete, num_groups, trainer_version))
        if len(picks) != num_groups or len(set(picks)) != num_groups:
            raise ValueError(f"sampling policy returned {picks} for {num_groups} groups")
        taken = [self.complete[i] for i in picks]
        for i in reversed(picks):
            del self.complete[i]
        self.stats.groups_released += len(taken)
        self.unacked.extend(taken)
        return taken

    def ack(self) -> int:
        """The trainer checkpointed everything it took so far: forget it."""
        n, self.unacked = len(self.unacked), []
        return n

    def requeue_unacked(self) -> int:
        """The trainer died and restarts from its last checkpoint: what it took since then goes
        back to the front, to be trained again (at-least-once delivery; nothing is lost)."""
        n = len(self.unacked)
        self.complete[:0] = self.unacked
        self.stats.groups_released -= n
        self.unacked = []
        return n

    def group_ids(self) -> set[str]:
        return set(self.filling) | {g[0].group_id for g in self.complete}

    def counts(self) -> dict[str, int]:
        return {"ready_groups": len(self.complete), "filling_groups": len(self.filling),
                **self.stats.__dict__}
