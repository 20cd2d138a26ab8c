"""Chain plans: who forwards weights to whom. Pure functions, no I/O.

    plan = build_chain([RelayInfo("r0", "10.0.0.1", 7000), ...], master="r0")
    plan.successor("r1")          # whom r1 forwards to
    plan = repair(plan, "r2")      # r2 died: its predecessor now feeds its successor
    plan = repair(plan, plan.master)   # the master died: its successor becomes master
    plan = join(plan, RelayInfo("r9", ...))   # a late joiner goes to the tail
    to_cut(plan.order, gone=["r2"], silent=["r4"])   # which relays a health check cuts out

A plan is an ordered chain of relays, master first, plus an epoch that grows with every change
so a relay can tell a newer plan from an older one. `repair` changes exactly one link (the dead
relay's predecessor now points at its successor); every other relay keeps its upstream and
downstream, which is what makes recovery O(1) in messages and reconnections. `links` exposes the
(from, to) pairs so callers and tests can check that.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class RelayInfo:
    """Where one relay listens and where its shared-memory segments live."""

    id: str  # unique within the job, e.g. "node3"
    host: str  # listening address (loopback by default)
    port: int
    node: str = ""  # machine identity (boot id); equal nodes share /dev/shm
    shm_prefix: str = ""  # file-name prefix of this relay's segments in the shm directory

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "host": self.host, "port": self.port, "node": self.node,
                "shm_prefix": self.shm_prefix}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RelayInfo":
        return cls(str(d["id"]), str(d["host"]), int(d["port"]), str(d.get("node", "")),
                   str(d.get("shm_prefix", "")))


@dataclass(frozen=True, slots=True)
class ChainPlan:
    order: tuple[str, ...]  # relay ids, master first
    relays: Mapping[str, RelayInfo] = field(default_factory=dict)  # id -> info, for every id in order
    epoch: int = 0  # grows with every change

    def __post_init__(self) -> None:
        if len(set(self.order)) != len(self.order):
            raise ValueError(f"chain order has duplicate relay ids: {list(self.order)}")
        missing = [r for r in self.order if r not in self.relays]
        if missing:
            raise ValueError(f"chain order names relays without an address: {missing}")

    @property
    def master(self) -> str | None:
        return self.order[0] if self.order else None

    def __contains__(self, relay_id: object) -> bool:
        return relay_id in self.relays and relay_id in self.order

    def __len__(self) -> int:
        return len(self.order)

    def position(self, relay_id: str) -> int:
        try:
            return self.order.index(relay_id)
        except ValueError:
            raise KeyError(f"relay '{relay_id}' is not in the chain {list(self.order)}") from None

    def successor(self, relay_id: str) -> str | None:
        i = self.position(relay_id)
        return self.order[i + 1] if i + 1 < len(self.order) else None

    def predecessor(self, relay_id: str) -> str | None:
        i = self.position(relay_id)
        return self.order[i - 1] if i > 0 else None

    def links(self) -> set[tuple[str, str]]:
        return set(zip(self.order, self.order[1:]))

    def to_dict(self) -> dict[str, Any]:
        return {"order": list(self.order), "epoch": self.epoch,
                "relays": [self.relays[r].to_dict() for r in self.order]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ChainPlan":
        infos = [RelayInfo.from_dict(x) for x in d["relays"]]
        return cls(tuple(d["order"]), {i.id: i for i in infos}, int(d["epoch"]))


def build_chain(relays: Iterable[RelayInfo], master: str | None = None, epoch: int = 0) -> ChainPlan:
    """Chain the live relays: `master` first (default: the first given), the rest in the order
    given. The caller orders relays so that neighbours are close (same rack first)."""
    infos = list(relays)
    ids = [r.id for r in infos]
    if master is not None:
        if master not in ids:
            raise ValueError(f"master '{master}' is not among the relays {ids}")
        ids.remove(master)
        ids.insert(0, master)
    return ChainPlan(tuple(ids), {r.id: r for r in infos}, epoch)


def repair(plan: ChainPlan, dead: str) -> ChainPlan:
    """Cut `dead` out: its predecessor now feeds its successor (one link changes). When the
    master dies, its successor becomes master: it is the relay that already holds the most of
    the newest version, and the rest of the chain stays as it is."""
    if dead not in plan:
        return plan
    order = tuple(r for r in plan.order if r != dead)
    relays = {r: plan.relays[r] for r in order}
    return ChainPlan(order, relays, plan.epoch + 1)


def choose_master(plan: ChainPlan, dead: Iterable[str] = ()) -> str | None:
    """The relay a trainer should push to when the relays in `dead` are gone: the first live
    relay of the chain (the old master's successor when the master died)."""
    gone = set(dead)
    return next((r for r in plan.order if r not in gone), None)


def join(plan: ChainPlan, relay: RelayInfo) -> ChainPlan:
    """Append a late joiner at the tail; it catches up from its predecessor, the old tail."""
    if relay.id in plan.relays:
        raise ValueError(f"relay '{relay.id}' is already in the chain {list(plan.order)}")
    return ChainPlan(plan.order + (relay.id,), {**plan.relays, relay.id: relay}, plan.epoch + 1)


def to_cut(order: Iterable[str], gone: Iterable[str], silent: Iterable[str]) -> list[str]:
    """Which relays to cut out of the chain: every relay whose process is `gone`, and those that
    went `silent` (answered no heartbeat for a while) unless cutting them would leave no relay
    at all. A silent relay may only be slow (a loaded machine); its versions still reach its
    rollouts through shared memory. An empty chain reaches nobody: the trainer has no master to
    push to and every rollout keeps its last version for good. So the last relays standing
    stay, silent or not, in chain order."""
    order, gone = list(order), set(gone)
    silent = [r for r in order if r in set(silent) and r not in gone]
    if all(r in gone or r in silent for r in order):
        return [r for r in order if r in gone]
    return [r for r in order if r in gone or r in silent]
