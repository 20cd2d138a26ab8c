"""The experience buffer: finished trajectories in, complete GRPO groups out.

- `put` is idempotent on the trajectory id: a retried put (after a timeout, a restart) never
  duplicates a sample.
- A group is released only when all of its samples are in (its advantages need all of them).
- `sample` takes complete groups by a pluggable policy, FIFO by completion by default.
- Groups released to the trainer are `taken` with the trainer's version at the time (the
  update they go into is the next one). They stay held until a checkpoint holds them
  (`ack(version)`); if the trainer dies, `rewind(version)` of the checkpoint it restarts from
  gives back exactly the groups taken at that version or later, so no group is lost and none is
  trained twice in the model's lineage.
- Nothing is ever dropped for being stale: staleness is bounded by pacing the rollouts
  (admission control at the prompt pool), since dropping biases training toward short
  responses.
- Durability (laminar/pools/store.py): every stored sample (`trajectories`) and every
  complete group's state (`groups`: ready | taken at version v | trained) is written through; a
  put commits before it is confirmed and a sample before it is returned, so what a rollout
  dropped from the partial pool, or the trainer trained, is on disk first. Samples of trained
  groups are deleted once checkpointed (the group's row stays: the lineage).
Pure; the runtime hosts it in a Ray actor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from laminar.pools.store import Store, decode_trajectory, encode_trajectory, open_store
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
    def __init__(self, group_size: int, policy: SamplingPolicy = fifo, store: Store | str | None = None,
                 restore: bool = False) -> None:
        self.group_size = group_size
        self.policy = policy
        self.seen: set[str] = set()  # every trajectory id put (and not yet trained and forgotten)
        self.trained: set[str] = set()  # groups in a checkpoint: a late put of theirs is a duplicate
        self.filling: dict[str, list[Trajectory]] = {}  # group id -> samples so far
        self.complete: list[list[Trajectory]] = []  # in completion order
        self.taken: dict[str, tuple[list[Trajectory], int]] = {}  # released, not yet checkpointed:
        # group id -> (samples, trainer version when taken), in release order
        self.seq: dict[str, int] = {}  # group id -> completion order (kept across restarts)
        self.next_seq = 0
        self.stats = BufferStats()
        self.store = open_store(store)
        if restore:
            self._restore()

    def _restore(self) -> None:
        groups = self.store.load("groups")
        by_group: dict[str, list[Trajectory]] = {}
        for value in self.store.load("trajectories").values():
            t = decode_trajectory(value)
            by_group.setdefault(t.group_id, []).append(t)
            self.seen.add(t.traj_id)
        for gid, row in sorted(groups.items(), key=lambda kv: kv[1]["seq"]):
            self.seq[gid] = row["seq"]
            self.next_seq = max(self.next_seq, row["seq"] + 1)
            samples = sorted(by_group.pop(gid, []), key=lambda t: t.traj_id)
            if row["state"] == "trained":
                self.trained.add(gid)
            elif row["state"] == "taken":
                self.taken[gid] = (samples, row["step"])
            else:
                self.complete.append(samples)
        self.filling = by_group

    def put(self, traj: Trajectory) -> bool:
        """Store one finished sample. Returns True when this put completed its group."""
        if traj.traj_id in self.seen or traj.group_id in self.trained:
            self.stats.duplicates += 1
            return False
        self.seen.add(traj.traj_id)
        self.stats.puts += 1
        self.store.put("trajectories", traj.traj_id, encode_trajectory(traj))
        samples = self.filling.setdefault(traj.group_id, [])
        samples.append(traj)
        if len(samples) < self.group_size:
            return False
        self.complete.append(sorted(self.filling.pop(traj.group_id), key=lambda t: t.traj_id))
        self.seq[traj.group_id] = self.next_seq
        self.next_seq += 1
        self._group_row(traj.group_id, "ready")
        return True

    def put_many(self, trajs: list[Trajectory]) -> list[str]:
        """Store several samples; returns the ids of the groups they completed. Durable when
        it returns (the rollout then drops them from the partial pool)."""
        completed = [t.group_id for t in trajs if self.put(t)]
        self.store.commit()
        return completed

    def _group_row(self, gid: str, state: str, step: int | None = None) -> None:
        self.store.put("groups", gid, {"state": state, "seq": self.seq[gid], "step": step})

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
        for group in taken:
            gid = group[0].group_id
            self.taken[gid] = (group, trainer_version)
            self._group_row(gid, "taken", trainer_version)
        self.store.commit()  # a durable point: what the trainer trains on is on record first
        return taken

    def ack(self, version: int | None = None) -> int:
        """A checkpoint at `version` holds every group taken before it (None: everything taken
        so far): forget their samples, keep the groups' rows as the lineage."""
        done = [gid for gid, (_, step) in self.taken.items() if version is None or step < version]
        for gid in done:
            group, _ = self.taken.pop(gid)
            self.trained.add(gid)
            self.seen.difference_update(t.traj_id for t in group)
            self.store.delete("trajectories", [t.traj_id for t in group])
            self._group_row(gid, "trained")
        self.store.maybe_commit()
        return len(done)

    def rewind(self, version: int | None) -> int:
        """The trainer restarts from its checkpoint at `version` (None: from no checkpoint, so
        nothing taken is in the model): groups taken at that version or later go back to the
        front, in completion order, to be trained again; those taken before are in the
        checkpoint and count as trained. Returns how many went back."""
        if version is not None:
            self.ack(version)
        back = sorted(self.taken, key=self.seq.__getitem__)
        self.complete[:0] = [self.taken[gid][0] for gid in back]
        for gid in back:
            self._group_row(gid, "ready")
        self.taken.clear()
        self.stats.groups_released -= len(back)
        self.store.commit()
        return len(back)

    def flush(self) -> None:
        self.store.commit()

    def group_ids(self) -> set[str]:
        return set(self.filling) | {g[0].group_id for g in self.complete}

    def counts(self) -> dict[str, int]:
        return {"ready_groups": len(self.complete), "filling_groups": len(self.filling),
                "taken_groups": len(self.taken), **self.stats.__dict__}
