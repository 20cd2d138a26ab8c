"""The rollout manager's pure decisions about failures: who is dead, who continues the dead
one's work, which relay a rollout pulls from once its own died, where and under which id a dead
rollout is started again.

    overdue(last_seen, now, limit_s)                  -> rollouts silent for too long
    assign_unfinished(moved, versions, mixes)         -> {destination: [Unfinished]}, restarted
    repoint(rollout_relay, dead_relays, live_relays)  -> {rollout: new relay}
    recreate_on(relay, live_relays, failed)           -> the relay a re-created rollout pulls from
    incarnation(slot, n)                              -> "rollout0.2": the id of a slot's n-th re-creation

No I/O and no clocks of their own; the manager (manager.py) gathers the inputs and applies
the answers.
"""

from __future__ import annotations

from laminar.types import GenerationRequest, Unfinished


def overdue(last_seen: dict[str, float], now: float, limit_s: float) -> list[str]:
    """Rollouts whose last answer to a health check is older than `limit_s` (hung or gone)."""
    return sorted(r for r, t in last_seen.items() if now - t > limit_s)


def assign_unfinished(moved: list[Unfinished], versions: dict[str, int],
                      mixes_versions: bool) -> tuple[dict[str, list[Unfinished]], int]:
    """Which live rollout continues each unfinished trajectory (`versions`: live rollout ->
    the version it holds). A trajectory goes to a rollout holding its version; if none does,
    it restarts from scratch on any of them (its tokens dropped, so it never mixes versions),
    unless the schedule mixes versions anyway (`mixes_versions`, partial rollout), when any
    rollout continues it as it is. Destinations take turns, so the work is spread. Returns the
    assignment and how many trajectories restart."""
    if not versions:
        return {}, 0
    live = sorted(versions)
    by_version: dict[int, list[str]] = {}
    for r in live:
        by_version.setdefault(versions[r], []).append(r)
    turn: dict[int | None, int] = {}
    plan: dict[str, list[Unfinished]] = {}
    restarted = 0
    for m in moved:
        req = m.request
        same = by_version.get(req.version) if req.version is not None else None
        if same:
            candidates, key = same, req.version
        else:
            candidates, key = live, None
            if req.version is not None and not mixes_versions:
                req = GenerationRequest(req.request_id, list(req.prompt_ids), req.params)
                restarted += 1
        k = turn.get(key, 0)
        turn[key] = k + 1
        plan.setdefault(candidates[k % len(candidates)], []).append(
            Unfinished(req, m.group, started_at=m.started_at))
    return plan, restarted


def repoint(rollout_relay: dict[str, str], dead: list[str], live: list[str]) -> dict[str, str]:
    """Rollouts whose relay died, each with a live relay to pull from instead (taking turns
    over the live ones). On one machine every relay's shared memory is local; across hosts the
    caller offers only relays of the rollout's own node."""
    if not live:
        return {}
    orphans = sorted(r for r, relay in rollout_relay.items() if relay in dead)
    return {r: live[k % len(live)] for k, r in enumerate(orphans)}


def recreate_on(relay: str, live: list[str], failed: frozenset[str] = frozenset()) -> str | None:
    """Where a dead rollout that pulled from `relay` is started again: on that relay's node
    while the relay lives, else beside the first live relay of the chain; relays where a start
    just `failed` only when no other lives. None when no relay lives."""
    usable = [r for r in live if r not in failed] or live
    return relay if relay in usable else (usable[0] if usable else None)


def incarnation(slot: str, n: int) -> str:
    """The id of the `n`-th re-creation of rollout `slot` (0: the slot's first process). Every
    incarnation has its own id, so nothing keyed by rollout id mixes two processes: the pools'
    ownership (a late update from the dead process never applies to work of the new one), the
    driver's per-rollout counters (a new process counts from zero) and the list of the dead."""
    return slot if n == 0 else f"{slot}.{n}"
