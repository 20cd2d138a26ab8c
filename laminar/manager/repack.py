"""Dynamic repack: the paper's Algorithm 1 (Best-Fit Trajectory Consolidation), as a pure function.

    plan = plan_repack(loads, c_max=0.99, batch_bound=128)   # -> [(source_id, destination_id), ...]

Parts:
- `RolloutLoad`: what the rollout manager knows about one rollout at a check (KV in tokens);
  `ramp_down_loads` builds them from the rollouts' snapshots.
- `is_candidate`: the idleness metric (§5.2): the rollout is in its ramp-down phase (KV use fell
  since the previous check and is below C_max) and holds a few (0 < n < B) trajectories.
- `plan_repack`: groups rollouts by weight version (a trajectory never changes version), then
  runs Best-Fit within each group: sources smallest KV first; each goes to the candidate whose
  resulting KV utilisation is highest, if its tokens and trajectories fit (`CanFit`).

Two readings of the printed algorithm, made explicit here:
- A rollout already emptied (planned as a source) is never a destination (line 9).
- A rollout chosen as a destination is never emptied afterwards. The printed loop could pick it
  as a later source and move only its own KV, stranding what it was promised; keeping it
  also avoids re-prefilling the same trajectories twice.
Ties are broken by rollout id so that the plan is deterministic.

The real rollout manager (an actor) and the simulator (`laminar.sim`) both call `plan_repack`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from laminar.types import RolloutSnapshot


@dataclass(frozen=True, slots=True)
class RolloutLoad:
    rollout_id: str
    version: int  # weight version the rollout generates with
    kv_used_tokens: int  # real tokens in its KV cache now
    kv_prev_tokens: int  # at the previous check (ramp-down detection: used < prev)
    kv_capacity_tokens: int
    num_reqs: int  # unfinished trajectories on it

    @property
    def utilization(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens


def ramp_down_loads(snapshots: Iterable[RolloutSnapshot]) -> list[RolloutLoad]:
    """The rollouts in their ramp-down, as Algorithm 1's inputs. Only a rollout that stopped
    admitting (draining, not held, nothing waiting in its engine) is in ramp-down (Fig. 9).
    Line 3's C_used < C_prev asks exactly that: a draining rollout admits nothing, so its KV
    only falls (its few tails may still grow a little), and its capacity stands in for C_prev."""
    return [RolloutLoad(s.rollout_id, s.version, s.kv_used_tokens, s.kv_capacity_tokens,
                        s.kv_capacity_tokens, s.num_in_flight)
            for s in snapshots if s.draining and not s.held and not s.num_waiting]


def is_candidate(r: RolloutLoad, c_max: float, batch_bound: int) -> bool:
    """Algorithm 1, line 3: C_used < min(C_max, C_prev) and 0 < N_reqs < B."""
    cap = r.kv_capacity_tokens
    return (r.kv_used_tokens / cap < min(c_max, r.kv_prev_tokens / cap)
            and 0 < r.num_reqs < batch_bound)


def plan_repack(rollouts: Sequence[RolloutLoad], c_max: float,
                batch_bound: int) -> list[tuple[str, str]]:
    """(source_id, destination_id) pairs: every unfinished trajectory of a source moves to its
    destination. Version groups are planned independently, lowest version first."""
    _check_inputs(rollouts, c_max, batch_bound)
    by_version: dict[int, list[RolloutLoad]] = {}
    for r in rollouts:
        by_version.setdefault(r.version, []).append(r)
    plan: list[tuple[str, str]] = []
    for version in sorted(by_version):
        plan += _best_fit(by_version[version], c_max, batch_bound)
    return plan


def _best_fit(group: list[RolloutLoad], c_max: float, batch_bound: int) -> list[tuple[str, str]]:
    cands = sorted((r for r in group if is_candidate(r, c_max, batch_bound)),
                   key=lambda r: (r.kv_used_tokens, r.rollout_id))  # smallest KV first
    # Load planned onto each rollout so far: its own plus everything promised to it.
    load_tokens = {r.rollout_id: r.kv_used_tokens for r in cands}
    load_reqs = {r.rollout_id: r.num_reqs for r in cands}
    emptied: set[str] = set()
    destinations: set[str] = set()
    plan: list[tuple[str, str]] = []
    for s in cands:
        if s.rollout_id in emptied or s.rollout_id in destinations:
            continue
        best: RolloutLoad | None = None
        best_density = -1.0
        for d in cands:
            if d.rollout_id == s.rollout_id or d.rollout_id in emptied:
                continue
            tokens = load_tokens[d.rollout_id] + s.kv_used_tokens
            reqs = load_reqs[d.rollout_id] + s.num_reqs
            if tokens > c_max * d.kv_capacity_tokens or reqs > batch_bound:
                continue  # CanFit fails
            density = tokens / d.kv_capacity_tokens
            if density > best_density:  # strict: the first (lowest KV, then id) wins ties
                best, best_density = d, density
        if best is not None:
            plan.append((s.rollout_id, best.rollout_id))
            emptied.add(s.rollout_id)
            destinations.add(best.rollout_id)
            load_tokens[best.rollout_id] += s.kv_used_tokens
            load_reqs[best.rollout_id] += s.num_reqs
    return plan


def _check_inputs(rollouts: Sequence[RolloutLoad], c_max: float, batch_bound: int) -> None:
    if not 0.0 < c_max <= 1.0:
        raise ValueError(f"c_max={c_max!r}: must be a KV utilisation in (0, 1], e.g. 0.99")
    if batch_bound < 1:
        raise ValueError(f"batch_bound={batch_bound!r}: must be a positive trajectory count")
    seen: set[str] = set()
    for r in rollouts:
        if r.rollout_id in seen:
            raise ValueError(f"rollout_id {r.rollout_id!r} appears twice; ids must be unique")
        seen.add(r.rollout_id)
        if r.kv_capacity_tokens <= 0:
            raise ValueError(f"rollout {r.rollout_id!r}: kv_capacity_tokens="
                             f"{r.kv_capacity_tokens} must be positive")
        if min(r.kv_used_tokens, r.kv_prev_tokens, r.num_reqs) < 0:
            raise ValueError(f"rollout {r.rollout_id!r}: token and request counts must be >= 0")
