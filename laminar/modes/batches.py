"""The global batch of the synchronous schedules, split over the rollout workers."""

from __future__ import annotations

from typing import Any

import ray

from laminar.runtime import Runtime


def generate(rt: Runtime, num_groups: int) -> list[Any]:
    """Start generating one global batch (its groups dealt out evenly); returns the refs."""
    workers = list(rt.workers.values())
    share = [num_groups // len(workers) + (i < num_groups % len(workers)) for i in range(len(workers))]
    return [w.generate_groups.remote(n) for w, n in zip(workers, share) if n]


def sync_weights(rt: Runtime, version: int) -> None:
    """Global weight sync: every rollout loads `version` before anyone goes on."""
    rt.wait({f"weight sync of {w}": h.pull_weights.remote(version) for w, h in rt.workers.items()})


def wait(rt: Runtime, refs: list[Any], what: str) -> None:
    rt.wait({f"{what} part {i}": ref for i, ref in enumerate(refs)})
    ray.get(refs)
