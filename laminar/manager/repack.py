"""Dynamic repack: the paper's idleness metric (§5.2) and Algorithm 1 (Best-Fit Trajectory
Consolidation), as pure functions.

    phase = kv_phase(prev, snapshot, c_max)                 # ramp_up | plateau | decline
    loads = idle_loads(snapshots, previous_samples, c_max)  # the rollouts in decline
    plan = plan_repack(loads, c_max=0.99, batch_bound=32)   # -> [(source_id, destination_id), ...]

Parts:
- `KvSample`: what the rollout manager remembers of a rollout from its previous check (weights
  version, KV tokens): C_prev.
- `kv_phase`: where a rollout is in Fig. 9's lifecycle, from two consecutive checks.
  **ramp-up**: no earlier sample with these weights (a fresh fill), or its KV rose while it
  admits. **plateau**: its KV did not fall (also a drained rollout whose tails still grow), or
  it is full (at C_max), or what finishes is refilled: trajectories wait in its engine, or its
  schedule still admits (a rollout topping up refills a group at a time, so its KV saws up and
  down below its cap; that is its plateau).
  **decline**: its KV fell since the previous check, below C_max, with nothing waiting and
  nothing more admitted (§5.2: usage falls "only when no waiting trajectories are left and
  the running ones complete"; from then on the rollout is idle).
- `idle_loads`: the rollouts in decline, as Algorithm 1's inputs with C_prev measured.
- `is_candidate`: Algorithm 1, line 3: KV use fell below min(C_max, C_prev), 0 < n < B.
- `plan_repack`: groups rollouts by weight version (a trajectory never changes version), then
  runs Best-Fit within each group: sources smallest KV first; each goes to the candidate whose
  resulting KV utilisation is highest, if its tokens and trajectories fit (`CanFit`).
- `is_post_update`: a newer version was published since the previous check (the paper's
  second trigger; the manager checks again soon after it, laminar/manager/manager.py).

Two readings of the printed algorithm, made explicit here:
- A rollout already emptied (planned as a source) is never a destination (line 9).
- A rollout chosen as a destination is never emptied afterwards. The printed loop could pick it
  as a later source and move only its own KV, stranding what it was promised; keeping it
  also avoids re-prefilling the same trajectories twice.
Ties are broken by rollout id so that the plan is deterministic.

The real rollout manager (an actor) and the simulator (`laminar.sim`) both call `plan_repack`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from laminar.types import RolloutSnapshot

Phase = Literal["ramp_up", "plateau", "decline"]


@dataclass(frozen=True, slots=True)
class KvSample:
    """A rollout at the manager's previous check."""

    version: int  # weights it held then
    kv_used_tokens: int  # C_prev, in tokens


@dataclass(frozen=True, slots=True)
class RolloutLoad:
    """What Algorithm 1 knows about one rollout at a check (KV in tokens)."""

    rollout_id: str
    version: int  # weight version the rollout generates with
    kv_used_tokens: int  # real tokens in its KV cache now
    kv_prev_tokens: int  # at the previous check (ramp-down detection: used < prev)
    kv_capacity_tokens: int
    num_reqs: int  # unfinished trajectories on it

    @property
    def utilization(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens


def kv_phase(prev: KvSample | None, s: RolloutSnapshot, c_max: float) -> Phase:
    """Where `s` is in its lifecycle (Fig. 9), given the previous check's sample."""
    refilled = s.num_waiting > 0 or not s.draining
    if prev is None or prev.version != s.version:
        return "ramp_up"  # a fresh fill with these weights
    if s.kv_used_tokens > prev.kv_used_tokens and refilled:
        return "ramp_up"
    if s.kv_used_tokens >= prev.kv_used_tokens or s.kv_utilization >= c_max or refilled:
        return "plateau"
    return "decline"


def idle_loads(snapshots: Iterable[RolloutSnapshot], previous: Mapping[str, KvSample],
               c_max: float) -> list[RolloutLoad]:
    """Algorithm 1's inputs: the rollouts in decline (not held: a held rollout is a source
    being emptied or a rollout leaving), C_prev their KV at the previous check."""
    return [RolloutLoad(s.rollout_id, s.version, s.kv_used_tokens,
                        previous[s.rollout_id].kv_used_tokens, s.kv_capacity_tokens, s.num_in_flight)
            for s in snapshots
            if not s.held and kv_phase(previous.get(s.rollout_id), s, c_max) == "decline"]


def is_post_update(newest_before: int | None, snapshots: Iterable[RolloutSnapshot]) -> bool:
    """A version newer than `newest_before` (the newest seen at the previous check) has reached
    a rollout's weight source: the trainer published an update since then."""
    newest = max((s.newest for s in snapshots if s.newest is not None), default=None)
    return newest is not None and (newest_before is None or newest > newest_before)


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
