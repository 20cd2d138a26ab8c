"""The rollout manager as a Ray actor: `RolloutManager` with Ray-backed doors.

`RayFleet` calls the rollout actors, `RayManagerPools` the pool actors, `RayRelays` the relay
group (and tells the trainer when the chain changes). The runtime makes it a threaded actor:
`run` occupies one thread until `stop`, while `stats`, `add_rollout` and `retire` are served
by others.
"""

from __future__ import annotations

import threading
from typing import Any

import ray

from laminar.config import Config
from laminar.manager.manager import RolloutManager
from laminar.pools.partials import PartialEntry
from laminar.runtime.relays import RelayGroup
from laminar.types import GenerationRequest, RolloutSnapshot, Unfinished


class RayFleet:
    def __init__(self, handles: dict[str, Any], relay_infos: dict[str, dict[str, Any]],
                 timeout_s: float) -> None:
        self.handles, self.relay_infos, self.timeout_s = dict(handles), relay_infos, timeout_s

    def snapshots(self, ids: list[str], timeout_s: float) -> tuple[dict[str, RolloutSnapshot], list[str]]:
        refs = {r: self.handles[r].snapshot.remote() for r in ids if r in self.handles}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        done = set(ready)
        snaps, gone = {}, []
        for r, ref in refs.items():
            if ref in done:
                try:
                    snaps[r] = ray.get(ref)
                except ray.exceptions.RayActorError:
                    gone.append(r)
        return snaps, gone

    def export(self, rollout_id: str) -> list[Unfinished]:
        return ray.get(self.handles[rollout_id].export.remote(), timeout=self.timeout_s)

    def adopt(self, rollout_id: str, moved: list[Unfinished]) -> bool:
        return ray.get(self.handles[rollout_id].adopt.remote(moved), timeout=self.timeout_s)

    def release(self, rollout_id: str) -> None:
        ray.get(self.handles[rollout_id].release.remote(), timeout=self.timeout_s)

    def stop(self, rollout_id: str) -> None:
        ray.get(self.handles[rollout_id].stop.remote(), timeout=self.timeout_s)

    def drop(self, rollout_id: str) -> None:
        handle = self.handles.pop(rollout_id)
        try:
            ray.kill(handle, no_restart=True)
        except Exception:
            pass  # already gone

    def set_relay(self, rollout_id: str, relay_id: str) -> None:
        self.handles[rollout_id].set_relay.remote(self.relay_infos[relay_id])


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

    def check(self) -> list[str]:
        dead = self.group.check()
        if dead:
            ray.get_actor(self.trainer_name).set_plan.remote(self.group.plan.to_dict())
        return dead

    @property
    def order(self) -> list[str]:
        return list(self.group.plan.order)

    @property
    def latest(self) -> dict[str, int | None]:
        return {r: self.group.latest.get(r) for r in self.group.plan.order}


class ManagerActor(RolloutManager):
    def __init__(self, cfg: Config, rollouts: dict[str, Any], rollout_relay: dict[str, str],
                 pools: dict[str, Any], relays: RelayGroup, trainer_name: str, repack: bool,
                 mixes_versions: bool) -> None:
        timeout = cfg.cluster.wait_timeout_s
        infos = {r: info.to_dict() for r, info in relays.infos.items()}
        super().__init__(cfg, RayFleet(rollouts, infos, timeout), RayManagerPools(pools, timeout),
                         RayRelays(relays, trainer_name), rollout_relay, repack, mixes_versions)
        self.stop_event = threading.Event()

    def run_loop(self) -> dict[str, Any]:
        self.stop_event.clear()
        return self.run(self.stop_event)

    def stop(self) -> None:
        self.stop_event.set()

    def add_rollout(self, rollout_id: str, handle: Any, relay_id: str) -> None:
        self.fleet.handles[rollout_id] = handle
        self.add(rollout_id, relay_id)
