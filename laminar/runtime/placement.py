"""Placement, pure: which relay each rollout pulls from, and on which node each relay runs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Placement:
    relay_ids: list[str]  # chain order, master first
    worker_relay: dict[str, str]  # rollout id -> the relay on its (virtual) node
    relay_node: dict[str, str | None]  # relay id -> Ray node id (None: anywhere, one machine)


def place(num_workers: int, virtual_nodes: int, ray_nodes: list[str] | None = None) -> Placement:
    """Rollouts round-robin over nodes, one relay per node. `ray_nodes`: the live Ray node ids
    of a real cluster (one relay on each); None = one machine split into `virtual_nodes`."""
    if ray_nodes:
        relay_ids = [f"node{k}" for k in range(len(ray_nodes))]
        relay_node: dict[str, str | None] = dict(zip(relay_ids, ray_nodes))
    else:
        relay_ids = [f"node{k}" for k in range(virtual_nodes)]
        relay_node = {r: None for r in relay_ids}
    workers = {f"rollout{i}": relay_ids[i % len(relay_ids)] for i in range(num_workers)}
    return Placement(relay_ids, workers, relay_node)
