"""The relays of one job as Ray actors: started, chained, heartbeated, repaired.

    group = RelayGroup(["node0", "node1"], job, secret, cfg.relay, options)   # starts them
    dead = group.find_dead()   # heartbeat every relay in the plan: the dead and the hung
    group.cut(dead)            # re-plan without them; returns once the live relays hold the plan
    dead = group.check()       # both
    group.shutdown()           # stop them and remove their shared memory

The runtime starts the group and shuts it down; the rollout manager (laminar/manager/) calls
`find_dead()` and `cut()` as part of its health loop, so one component owns the health of
rollouts and relays. Relays also repair their own link when their successor dies
(laminar/relay/relay.py), so `cut()` only has to make the plans agree; a dead master's
successor becomes master (`plan.repair`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import ray

from laminar.actor import start_failure
from laminar.config import ConfigError, RelayConfig
from laminar.relay.plan import ChainPlan, RelayInfo, join, repair, to_cut
from laminar.relay.relay import Relay, segment_prefix
from laminar.relay.store import cleanup

log = logging.getLogger("laminar.relay")


def cut_links(plan: ChainPlan, successors: Mapping[str, str | None]) -> list[tuple[str, str]]:
    """(relay, its successor in `plan`) for each relay whose own plan (`successors`: relay ->
    the successor it feeds, from the heartbeats that answered) skips a successor that answered
    too: a link that the relay cut, between two live relays."""
    return [(i, plan.successor(i)) for i, feeds in successors.items()
            if plan.successor(i) is not None and feeds != plan.successor(i)
            and plan.successor(i) in successors]


def links_due(cut_off: list[tuple[str, str]], retries: Mapping[tuple[str, str], tuple[float, float]],
              now: float, first: float = 10.0, most: float = 300.0
              ) -> tuple[list[tuple[str, str]], dict[tuple[str, str], tuple[float, float]]]:
    """Which cut links to try again now, and the new schedule (link -> (next try, delay)): a
    newly cut link at once, then after `first` seconds, doubling up to `most`; a link no
    longer cut leaves the schedule."""
    schedule = {link: r for link, r in retries.items() if link in cut_off}
    due = [link for link in cut_off if now >= schedule.get(link, (0.0, 0.0))[0]]
    for link in due:
        delay = min(2 * schedule[link][1], most) if link in schedule else first
        schedule[link] = (now + delay, delay)
    return due, schedule


def relay_actor_name(job: str, relay_id: str) -> str:
    """Relays are named actors, so `laminar cluster status` finds a running job's relays."""
    return f"laminar-{job}-relay-{relay_id}"


def start_relay_actor(relay_id: str, job: str, secret: bytes, cfg: RelayConfig | None = None,
                      node_ip: str | None = None, **options: Any) -> Any:
    """One relay actor (pass e.g. scheduling_strategy to pin it to a node; `node_ip`: that
    node's cluster address, which relay.host resolves against). The actor is threaded so
    heartbeats are answered while a publish is running."""
    opts = {"num_cpus": 0, "max_concurrency": 8, "name": relay_actor_name(job, relay_id),
            "namespace": "laminar", **options}
    return ray.remote(Relay).options(**opts).remote(relay_id, job, secret, cfg, node_ip=node_ip)


class RelayGroup:
    def __init__(self, ids: list[str], job: str, secret: bytes, cfg: RelayConfig | None = None,
                 options: Mapping[str, Mapping[str, Any]] | None = None,
                 node_ips: Mapping[str, str | None] | None = None, timeout_s: float = 60.0) -> None:
        self.job, self.cfg, self.secret = job, cfg or RelayConfig(), secret
        self.node_ips = dict(node_ips or {})
        self.misses: dict[str, int] = {}  # heartbeats in a row a relay did not answer in time
        self.retries: dict[tuple[str, str], tuple[float, float]] = {}  # cut link -> (next try, delay)
        self.joins: list[dict[str, Any]] = []  # relays added at runtime: how they caught up
        self.actors = {i: start_relay_actor(i, job, secret, self.cfg, self.node_ips.get(i),
                                            **dict((options or {}).get(i, {})))
                       for i in ids}
        infos = self._first_heartbeats(ids, timeout_s)
        self.infos = {h["id"]: RelayInfo.from_dict(h["info"]) for h in infos}
        self.pids = {h["id"]: h["pid"] for h in infos}
        self.latest: dict[str, int | None] = {h["id"]: h["latest"] for h in infos}  # at the last check
        self.plan = ChainPlan(tuple(ids), dict(self.infos), 1)
        order = self.plan.order
        self._check_links([(a, b, self.infos[b]) for a, b in zip(order, order[1:])])
        self._broadcast_plan()

    def add(self, relay_id: str, node_ip: str | None, options: Mapping[str, Any],
            catch_up_s: float = 60.0) -> RelayInfo:
        """A relay joins the running chain at its tail (a node joined the cluster): started,
        its link from the old tail tried, then every relay gets the new plan. The old tail
        forwards it the newest version at once, so it catches up within one broadcast."""
        self.node_ips[relay_id] = node_ip
        self.actors[relay_id] = start_relay_actor(relay_id, self.job, self.secret, self.cfg,
                                                  node_ip, **dict(options))
        [beat] = self._first_heartbeats([relay_id], self.cfg.timeout_s * 6)
        info = RelayInfo.from_dict(beat["info"])
        if self.plan.order:
            try:
                self._check_links([(self.plan.order[-1], relay_id, info)])  # from the old tail
            except ConfigError:
                ray.kill(self.actors.pop(relay_id))
                raise
        master = self.plan.master
        target = ray.get(self.actors[master].heartbeat.remote(), timeout=self.cfg.timeout_s)["latest"] \
            if master is not None else None
        t0 = time.monotonic()
        self.plan = join(self.plan, info)
        self.infos[relay_id], self.pids[relay_id], self.latest[relay_id] = info, beat["pid"], None
        self._broadcast_plan()
        caught_up = self._catch_up(relay_id, target, catch_up_s)
        self.joins.append({"relay": relay_id, "master_version": target, "version": caught_up,
                           "seconds": round(time.monotonic() - t0, 3), "at": time.time()})
        return info

    def _catch_up(self, relay_id: str, target: int | None, timeout_s: float) -> int | None:
        """Wait until the new relay holds the version the master held when it joined (the old
        tail forwards it its newest at once); its rollouts start after, on current weights."""
        end = time.monotonic() + timeout_s
        latest = None
        while True:
            latest = ray.get(self.actors[relay_id].heartbeat.remote(), timeout=self.cfg.timeout_s)["latest"]
            if target is None or (latest is not None and latest >= target) or time.monotonic() > end:
                break
            time.sleep(0.05)
        self.latest[relay_id] = latest
        if target is not None and (latest is None or latest < target):
            log.warning("relay %s holds version %s, not yet the master's %s after %.0fs; its "
                        "rollouts start anyway and pull when it arrives", relay_id, latest, target, timeout_s)
        return latest

    def _where(self, relay_id: str) -> str:
        ip = self.node_ips.get(relay_id)
        return f"relay {relay_id} (node {ip})" if ip else f"relay {relay_id}"

    def _first_heartbeats(self, ids: list[str], timeout_s: float) -> list[dict[str, Any]]:
        """Every relay's first heartbeat; a relay that failed to start (an address it cannot
        bind, a node it cannot run on) is an error naming it and its node."""
        refs = {i: self.actors[i].heartbeat.remote() for i in ids}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        out = []
        for i, ref in refs.items():
            if ref not in ready:
                raise RuntimeError(f"{self._where(i)} did not start within {timeout_s:.0f}s; is "
                                   "its node alive and does it have the resources?")
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError as e:
                kind, message = start_failure(e)
                error = ConfigError if kind == "AddressError" else RuntimeError  # user setup: one line
                raise error(f"{self._where(i)} failed to start: {message}") from None
        return out

    def _check_links(self, links: list[tuple[str, str, RelayInfo]]) -> None:
        """Links (from relay, to relay, its info), tried before any weights travel on them: the
        predecessor connects to its successor's advertised address and proves the secret. A
        blocked port or a wrong address fails here, naming both ends, instead of as a cut-out
        relay later."""
        refs = [self.actors[a].probe.remote(*info.address) for a, _, info in links]
        for (a, b, info), err in zip(links, ray.get(refs, timeout=3 * self.cfg.timeout_s + 30)):
            if err is not None:
                host, port = info.address
                raise ConfigError(
                    f"{self._where(a)} cannot reach {self._where(b)} at {host}:{port}: {err}. The "
                    "relays' TCP ports must be open between nodes on the weight network (pin them "
                    "with relay.port_range and open that range), and relay.host must name that "
                    "network (an interface or a CIDR)")

    @property
    def master(self) -> str | None:
        return self.plan.master

    def check(self) -> list[str]:
        """Heartbeat every relay in the plan; returns the ids found dead (and cuts them out)."""
        dead = self.find_dead()
        if dead:
            self.cut(dead)
        return dead

    def find_dead(self) -> list[str]:
        """Heartbeat every relay in the plan: those whose process is gone, and those that did
        not answer within relay.timeout_s twice in a row (one late answer on a loaded machine, or
        while Ray notices a lost node, is not a death: cutting a live master out would cost the
        trainer its push target) unless no relay would be left (`plan.to_cut`)."""
        ids = list(self.plan.order)
        refs = [self.actors[i].heartbeat.remote() for i in ids]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.timeout_s)
        gone, silent, successors = [], [], {}
        for i, ref in zip(ids, refs):
            if ref not in ready:
                self.misses[i] = self.misses.get(i, 0) + 1
                if self.misses[i] >= 2:
                    silent.append(i)
                continue
            try:
                beat = ray.get(ref)
                self.latest[i], successors[i] = beat["latest"], beat["successor"]
                self.misses[i] = 0
            except Exception:  # the actor (its process or its node) is gone
                gone.append(i)
        dead = to_cut(ids, gone, silent)
        if kept := sorted(set(silent) - set(dead)):
            log.warning("relays %s answered no heartbeat within %.0fs %d times in a row; kept in "
                        "the chain: no other relay is left to take over", kept, self.cfg.timeout_s,
                        min(self.misses[i] for i in kept))
        if not dead:
            self._retry_cut_links(cut_links(self.plan, successors))
        return dead

    def _retry_cut_links(self, cut_off: list[tuple[str, str]]) -> None:
        """A relay cut its successor out (a link that failed: a connect or handshake that timed
        out) while the successor still answers: the link, not the relay, failed. Without a
        retry the successor would hold its last version for good, and so would its rollouts;
        so the group's plan goes back to the relays and the link is tried again, at once the
        first time, then after 10 s, 20 s, ... up to 5 minutes while it keeps failing (each try
        holds the cutting relay up to relay.timeout_s, its other successors waiting)."""
        due, self.retries = links_due(cut_off, self.retries, time.monotonic())
        if not due:
            return
        log.warning("relay links %s were cut while both ends answer; trying them again",
                    ", ".join(f"{a} -> {b}" for a, b in due))
        self._broadcast_plan()

    def cut(self, dead: list[str]) -> None:
        """Re-plan the chain without `dead` (one link changes per relay; a dead master's
        successor becomes master) and tell the live relays; returns once they acknowledged
        or relay.timeout_s passed."""
        for i in dead:
            self.plan = repair(self.plan, i)
        log.warning("relays %s are gone; chain is now %s", dead, list(self.plan.order))
        self._broadcast_plan()

    def shutdown(self) -> None:
        """Stop every relay of the job: those this group started and those another copy of it
        started later (the manager's, for a node that joined), found by name."""
        actors = dict(self.actors)
        prefix = relay_actor_name(self.job, "")
        try:
            for a in ray.util.list_named_actors(all_namespaces=True):
                if a.get("namespace") == "laminar" and a["name"].startswith(prefix):
                    rid = a["name"].removeprefix(prefix)
                    if rid not in actors:
                        actors[rid] = ray.get_actor(a["name"], namespace="laminar")
        except Exception as e:  # the listing is a courtesy: never fail a shutdown on it
            log.warning("could not list the job's relays: %s", e)
        for i, actor in actors.items():
            try:
                ray.get(actor.stop.remote(), timeout=self.cfg.timeout_s)
            except Exception:
                pass  # already dead: its files are removed below
            ray.kill(actor)
            cleanup(self.cfg.shm_dir, segment_prefix(self.job, i))

    def _broadcast_plan(self) -> None:
        refs = [self.actors[i].set_plan.remote(self.plan.to_dict()) for i in self.plan.order]
        ray.wait(refs, num_returns=len(refs), timeout=self.cfg.timeout_s)
