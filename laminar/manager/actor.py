"""The rollout manager as a Ray actor: `RolloutManager` with Ray-backed doors.

`RayFleet` calls the rollout actors and starts new ones in place of dead ones; `RolloutSpec`
is how a rollout actor starts, which the runtime uses for the first ones and hands to the
manager, so a re-created rollout starts as they did (a child of this actor, it ends with it).
`RayManagerPools` calls the pool actors; `RayRelays` the relay group (and tells the trainer
when the chain changes). The runtime makes it a threaded actor: `run` occupies one thread
until `stop`, while `stats`, `rollouts`, `add_rollout` and `retire` are served by others.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray

from laminar.actor import alive_nodes, pin
from laminar.config import Config
from laminar.manager.manager import RolloutManager
from laminar.pools.partials import PartialEntry
from laminar.relay.actor import RelayGroup
from laminar.types import GenerationRequest, RolloutSnapshot, Unfinished

log = logging.getLogger("laminar.manager")


@dataclass(frozen=True)
class RolloutSpec:
    """What starting a rollout actor takes: the runtime's start, `add_worker` and the manager's
    re-creation of a dead rollout all start them alike."""

    cfg: Config
    model_dir: Any  # the starting weights: a path, or an actor.ShippedDir on a cluster
    version: int  # their version (a rollout pulls the newest from its relay before generating)
    relays: dict[str, dict[str, Any]]  # relay id -> its RelayInfo as a dict
    options: dict[str, dict[str, Any]]  # relay id -> Ray options of a rollout on its node (pin)
    pools: dict[str, Any]  # the pool actors
    policy: Any  # the schedule's Policy in Ray's object store (`ray.put`): Ray hands the object
    # to each rollout, and the manager never unpickles it (a schedule's module imports torch)

    def start(self, rollout_id: str, relay_id: str) -> Any:
        from laminar.rollout.actor import RolloutActor  # torch: only where a rollout starts

        return ray.remote(RolloutActor).options(**self.options[relay_id]).remote(
            rollout_id, self.cfg, self.model_dir, self.relays[relay_id], self.pools, self.policy,
            self.version)


class RayFleet:
    """A rollout may die at any moment: a call to one that died answers as a refusal (adopt)
    or nothing (export); the next health check fails it over."""

    def __init__(self, handles: dict[str, Any], spec: RolloutSpec, timeout_s: float) -> None:
        self.handles, self.spec, self.timeout_s = dict(handles), spec, timeout_s
        self.starting: dict[str, tuple[Any, Any, float]] = {}  # id -> (handle, first snapshot, since)
        self.asking: dict[str, Any] = {}  # id -> its snapshot call not answered yet

    def snapshots(self, ids: list[str], timeout_s: float) -> tuple[dict[str, RolloutSnapshot], list[str]]:
        """The rollouts' answers within `timeout_s`, and the rollouts whose process is gone. A
        call still unanswered then is kept, not dropped: the next check waits on the same call,
        so a rollout that answers late (a busy machine) is seen when its answer comes, and only
        one that answers nothing for the manager's limit counts as hung."""
        refs = {r: self.asking.get(r) or self.handles[r].snapshot.remote() for r in ids if r in self.handles}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        done = set(ready)
        snaps, gone = {}, []
        for r, ref in refs.items():
            if ref not in done:
                self.asking[r] = ref
                continue
            self.asking.pop(r, None)
            try:
                snaps[r] = ray.get(ref)
            except ray.exceptions.RayActorError:
                gone.append(r)
        return snaps, gone

    def export(self, rollout_id: str) -> list[Unfinished]:
        try:
            return ray.get(self.handles[rollout_id].export.remote(), timeout=self.timeout_s)
        except ray.exceptions.RayActorError:
            return []

    def adopt(self, rollout_id: str, moved: list[Unfinished]) -> bool:
        try:
            return ray.get(self.handles[rollout_id].adopt.remote(moved), timeout=self.timeout_s)
        except ray.exceptions.RayActorError:
            return False

    def release(self, rollout_id: str) -> None:
        try:
            ray.get(self.handles[rollout_id].release.remote(), timeout=self.timeout_s)
        except ray.exceptions.RayActorError:
            pass

    def stop(self, rollout_id: str) -> None:
        ray.get(self.handles[rollout_id].stop.remote(), timeout=self.timeout_s)

    def drop(self, rollout_id: str) -> None:
        handle = self.handles.pop(rollout_id)
        self.asking.pop(rollout_id, None)
        try:
            ray.kill(handle, no_restart=True)
        except Exception:
            pass  # already gone

    def set_relay(self, rollout_id: str, relay_id: str) -> None:
        self.handles[rollout_id].set_relay.remote(self.spec.relays[relay_id])

    def spawn(self, rollout_id: str, relay_id: str) -> None:
        handle = self.spec.start(rollout_id, relay_id)
        self.starting[rollout_id] = (handle, handle.snapshot.remote(), time.monotonic())

    def spawned(self) -> tuple[list[str], dict[str, str]]:
        """Started rollouts whose first snapshot came back get their loop started; those whose
        constructor failed or that did not answer within cluster.wait_timeout_s are killed."""
        if not self.starting:
            return [], {}
        refs = [ref for _, ref, _ in self.starting.values()]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        started, failed = [], {}
        for rid, (handle, ref, since) in list(self.starting.items()):
            if ref not in ready and time.monotonic() - since < self.timeout_s:
                continue
            del self.starting[rid]
            try:
                if ref not in ready:
                    raise TimeoutError(f"no answer within cluster.wait_timeout_s={self.timeout_s:.0f}s")
                ray.get(ref)
                ray.get(handle.start.remote(), timeout=self.timeout_s)
            except Exception as e:  # its constructor raised, its node is gone, it hangs
                failed[rid] = f"{type(e).__name__}: {e}"
                ray.kill(handle, no_restart=True)
                continue
            self.handles[rid] = handle
            started.append(rid)
        return started, failed


class RayManagerPools:
    def __init__(self, pools: dict[str, Any], timeout_s: float) -> None:
        self.prompts, self.partials, self.buffer = pools["prompts"], pools["partials"], pools["buffer"]
        self.timeout_s = timeout_s

    def _get(self, ref: Any) -> Any:
        return ray.get(ref, timeout=self.timeout_s)

    def owned_by(self, owner: str) -> list[PartialEntry]:
        return self._get(self.partials.owned_by.remote(owner))

    def reassign(self, traj_ids: list[str], owner: str, states: list[GenerationRequest]) -> None:
        self._get(self.partials.reassign.remote(traj_ids, owner, states))

    def live_groups(self) -> set[str]:
        return self._get(self.partials.group_ids.remote()) | self._get(self.buffer.group_ids.remote())

    def release_owner(self, owner: str, keep: set[str]) -> list[str]:
        return self._get(self.prompts.release_owner.remote(owner, keep))

    def expired_owners(self) -> set[str]:
        return self._get(self.prompts.expired_owners.remote())


class RayRelays:
    def __init__(self, group: RelayGroup, trainer_name: str) -> None:
        self.group, self.trainer_name = group, trainer_name

    def find_dead(self) -> list[str]:
        return self.group.find_dead()

    def cut(self, dead: list[str]) -> None:
        """The relays get the new plan, then the trainer (whose pushes go to its master). A
        trainer that is restarting misses it: its pusher skips a dead master on its own."""
        self.group.cut(dead)
        self.tell_trainer()

    def tell_trainer(self) -> None:
        try:
            trainer = ray.get_actor(self.trainer_name)
            ray.get(trainer.set_plan.remote(self.group.plan.to_dict()), timeout=self.group.cfg.timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ValueError) as e:
            log.warning("the trainer did not take the new relay plan (%s); its pusher finds the "
                        "new master by itself", e)

    @property
    def order(self) -> list[str]:
        return list(self.group.plan.order)

    @property
    def latest(self) -> dict[str, int | None]:
        return {r: self.group.latest.get(r) for r in self.group.plan.order}

    @property
    def joins(self) -> list[dict[str, Any]]:
        return list(self.group.joins)

    @property
    def addresses(self) -> dict[str, str]:
        return {r: "%s:%d" % self.group.infos[r].address for r in self.group.plan.order}


class ManagerActor(RolloutManager):
    def __init__(self, cfg: Config, rollouts: dict[str, Any], rollout_relay: dict[str, str],
                 pools: dict[str, Any], relays: RelayGroup, trainer_name: str, repack: bool,
                 mixes_versions: bool, spec: RolloutSpec) -> None:
        timeout = cfg.cluster.wait_timeout_s
        super().__init__(cfg, RayFleet(rollouts, spec, timeout), RayManagerPools(pools, timeout),
                         RayRelays(relays, trainer_name), rollout_relay, repack, mixes_versions)
        self.stop_event = threading.Event()
        self.known_nodes: set[str] | None = None  # Ray nodes seen so far (check_nodes)

    def run_loop(self) -> dict[str, Any]:
        self.stop_event.clear()
        return self.run(self.stop_event)

    def check_nodes(self) -> None:
        """A machine that joined the Ray cluster gets a relay (at the chain's tail; it catches
        up from the old tail) and cluster.rollouts_per_new_node rollouts beside it. A machine
        that left needs nothing here: its relay and rollouts fail the heartbeats above."""
        if not self.cfg.cluster.address or not self.cfg.cluster.rollouts_per_new_node:
            return
        alive = alive_nodes()
        if self.known_nodes is None:
            self.known_nodes = set(alive)
            return
        for node in sorted(set(alive) - self.known_nodes):
            self.known_nodes.add(node)
            self._join_node(node, alive[node])

    def replace_relays(self, dead: list[str]) -> dict[str, str]:
        if not self.cfg.cluster.address:
            return {}
        alive = alive_nodes()
        node_of = {ip: node for node, ip in alive.items()}
        out = {}
        for old in dead:
            node = node_of.get(self.relays.group.node_ips.get(old) or "")
            if node is not None:
                new = self._start_relay(node, alive[node])
                if new is not None:
                    out[old] = new
                    log.warning("relay %s died on live node %s: relay %s replaces it there", old,
                                alive[node], new)
        return out

    def scale_up(self, n: int, new_node: bool) -> list[str]:
        """`laminar scale`: n more rollouts, beside the relays with the fewest rollouts, or all
        on a new virtual node with a relay of its own that joins the chain and catches up
        first (one machine; on a cluster a new node is a machine joining Ray)."""
        if new_node and self.cfg.cluster.address:
            raise ValueError("on a cluster a new node is a machine joining Ray (`ray start "
                             "--address ...`, or `laminar cluster add`); the job gives it a relay "
                             "and cluster.rollouts_per_new_node rollouts by itself")
        if new_node:
            relay = self._start_relay(None, None)
            if relay is None:
                raise RuntimeError("the new virtual node's relay did not start (see the log)")
            relays = [relay]
        else:
            relays = list(self.relays.order)
        load = {r: 0 for r in relays}
        for r in [*self.rollout_relay.values(), *(v[2] for v in self.spawning.values())]:
            if r in load:
                load[r] += 1
        new = []
        for rid in self._new_ids(n):
            relay = min(relays, key=lambda r: (load[r], relays.index(r)))
            load[relay] += 1
            with self.lock:
                self.spawn_joining(rid, relay)
            new.append(rid)
        return new

    def _new_ids(self, n: int) -> list[str]:
        taken = {int(r.removeprefix("rollout").split(".")[0])
                 for r in [*self.rollout_relay, *self.spawning, *self.dead]}
        first = max(taken, default=-1) + 1
        return [f"rollout{first + k}" for k in range(n)]

    def _start_relay(self, node: str | None, ip: str | None) -> str | None:
        """A new relay on `node` (None: a new virtual node on this machine) at the chain's
        tail, caught up to the master's newest version; the trainer gets the new plan. None
        when it could not start (the job goes on without it)."""
        group, spec = self.relays.group, self.fleet.spec
        relay_id = f"node{max(int(r.removeprefix('node')) for r in group.actors) + 1}"
        here = pin(node)
        try:
            info = group.add(relay_id, ip, here, catch_up_s=self.cfg.cluster.wait_timeout_s)
        except Exception as e:
            log.warning("a relay on node %s did not start: %s", ip, e)
            return None
        spec.relays[relay_id] = info.to_dict()
        spec.options[relay_id] = {**next(iter(spec.options.values()), {}), **here}
        self.relays.tell_trainer()  # the new plan (the relays have it already)
        return relay_id

    def _join_node(self, node: str, ip: str) -> None:
        relay_id = self._start_relay(node, ip)
        if relay_id is None:
            return  # the job goes on without the node
        new = []
        for rid in self._new_ids(self.cfg.cluster.rollouts_per_new_node):
            with self.lock:
                self.spawn_joining(rid, relay_id)
            new.append(rid)
        self.nodes_joined.append({"node": ip, "relay": relay_id, "rollouts": new, "at": time.time()})
        log.warning("node %s joined: relay %s at the chain's tail, rollouts %s starting", ip, relay_id, new)

    def stop(self) -> None:
        self.stop_event.set()

    def add_rollout(self, rollout_id: str, handle: Any, relay_id: str) -> None:
        self.fleet.handles[rollout_id] = handle
        self.add(rollout_id, relay_id)

    def rollouts(self, ids: list[str]) -> dict[str, Any]:
        """Handles of live rollouts (the runtime asks for those this actor started)."""
        return {r: self.fleet.handles[r] for r in ids if r in self.fleet.handles}
