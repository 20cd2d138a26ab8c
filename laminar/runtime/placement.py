"""Placement, pure: on which node each relay runs and which relay each rollout pulls from.

One machine: `cluster.virtual_nodes: K` splits the rollouts into K groups, each with its own
relay process. A real cluster (`ray_nodes` given): the trainer, the pools and the manager stay on
the driver's node (`head`), and so does the master relay, so the trainer's push is a local
memory write; rollouts go round-robin over the other nodes (the head too when it is the only
one, or when `rollouts_on_head`); every node that hosts rollouts gets one relay, and the chain
runs in that order: master first, then the rollout nodes as the cluster lists them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Placement:
    relay_ids: list[str]  # chain order, master first
    worker_relay: dict[str, str]  # rollout id -> the relay on its (virtual) node
    relay_node: dict[str, str | None]  # relay id -> Ray node id (None: anywhere, one machine)


def place(num_workers: int, virtual_nodes: int, ray_nodes: list[str] | None = None,
          head: str | None = None, rollouts_on_head: bool = False) -> Placement:
    """Rollouts round-robin over nodes, one relay per node that hosts rollouts (plus the
    master's on the head). `ray_nodes`: the live Ray node ids of a real cluster; None = one
    machine split into `virtual_nodes`."""
    if not ray_nodes:
        relay_ids = [f"node{k}" for k in range(virtual_nodes)]
        workers = {f"rollout{i}": relay_ids[i % len(relay_ids)] for i in range(num_workers)}
        return Placement(relay_ids, workers, {r: None for r in relay_ids})
    head = head if head in ray_nodes else ray_nodes[0]
    others = [n for n in ray_nodes if n != head]
    hosts = ([head] if rollouts_on_head or not others else []) + others
    used = [hosts[i % len(hosts)] for i in range(num_workers)]
    nodes = [head] + [n for n in dict.fromkeys(used) if n != head]  # chain order, master first
    relay_of = {n: f"node{k}" for k, n in enumerate(nodes)}
    workers = {f"rollout{i}": relay_of[n] for i, n in enumerate(used)}
    return Placement([relay_of[n] for n in nodes], workers, {relay_of[n]: n for n in nodes})
