"""`event` rows from what changed in the manager's stats between two polls: repacks,
failures, rollouts recreated, joined or retired, nodes joined, the relay chain rebuilt."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ManagerEvents:
    def __init__(self, first: Mapping[str, Any]) -> None:
        self.last = first  # the manager's stats as of the previous poll
        self.chain: list[str] = first["chain"]

    def update(self, manager: Mapping[str, Any]) -> list[tuple[str, str]]:
        """(what, detail) of every change since the previous call."""
        events = changes(self.last, manager) if self.last else []
        if manager["chain"] != self.chain:
            events.append(("chain", f"the relay chain is now {manager['chain']} (was {self.chain})"))
        self.chain = manager["chain"]
        self.last = manager
        return events


def changes(last: Mapping[str, Any], manager: Mapping[str, Any]) -> list[tuple[str, str]]:
    events = []
    if manager["repacks"] > last["repacks"]:
        events.append(("repack", f"{manager['repacks'] - last['repacks']} repack(s), "
                       f"{manager['moved_trajectories'] - last['moved_trajectories']} "
                       "trajectories moved to a same-version peer"))
    for dead in manager["dead"][len(last["dead"]):]:
        events.append(("failure", f"rollout {dead} died; its unfinished trajectories "
                       "continue on live rollouts"))
    recreated = manager.get("recreated", [])  # the local backend has no manager
    for dead, new in recreated[len(last.get("recreated", [])):]:
        events.append(("recreated", f"rollout {new} started in place of {dead}"))
    before, now = set(last["workers"]), set(manager["workers"])
    for wid in sorted(now - before - {new for _, new in recreated}):
        events.append(("join", f"rollout {wid} joined the job"))
    for j in manager.get("nodes_joined", [])[len(last.get("nodes_joined", [])):]:
        events.append(("node", f"node {j['node']} joined the cluster: relay {j['relay']} "
                       f"at the chain's tail, rollouts {', '.join(j['rollouts'])}"))
    for wid in sorted(before - now - set(manager["dead"])):
        events.append(("leave", f"rollout {wid} left the job (its work moved to peers)"))
    return events
