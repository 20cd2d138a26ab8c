"""The rollout manager's decision loop without Ray: hand-built snapshots, a fleet and pools
that record what they are asked. Repack, refused moves, failover (same version, restart from
scratch), re-creation of a dead rollout, deadlines, expired leases, relay death (the master's
too) and the fault records; and the pure health functions."""

from __future__ import annotations

import time

from laminar.config import load_config
from laminar.manager.health import assign_unfinished, incarnation, overdue, recreate_on, repoint
from laminar.manager.manager import RolloutManager
from laminar.pools.partials import PartialEntry
from laminar.types import (GenerationRequest, PromptGroup, PromptItem, RolloutCounters,
                           RolloutSnapshot, Unfinished)
from waiting import until

CFG = load_config(None, ["cluster.heartbeat_s=0.5", "manager.batch_bound=8"])
GROUP = PromptGroup("g0", PromptItem(0, "ab=", "ba"), [1, 5, 6], 2)


def snap(rid: str, version: int = 0, kv: int = 100, n: int = 1, draining: bool = True,
         held: bool = False, waiting: int = 0) -> RolloutSnapshot:
    return RolloutSnapshot(rid, version, n, 0, n, waiting, kv, 1000, held, draining, RolloutCounters())


def unfinished(rid: str, version: int | None = 0, tokens: int = 3) -> Unfinished:
    return Unfinished(GenerationRequest(rid, [1, 5, 6], output_ids=[7] * tokens, logprobs=[-0.5] * tokens,
                                        token_versions=[version] * tokens, version=version), GROUP)


class Fleet:
    def __init__(self, snaps: dict[str, RolloutSnapshot], refuse: set[str] = frozenset()) -> None:
        self.snaps, self.refuse, self.gone = snaps, set(refuse), set()
        self.silent: set[str] = set()
        self.calls: list[tuple] = []
        self.held: dict[str, list[Unfinished]] = {r: [unfinished(f"{r}-t")] for r in snaps}
        self.starting: dict[str, str] = {}  # spawned, not running yet: id -> relay
        self.fail_start: set[str] = set()  # spawned ids whose start fails

    def snapshots(self, ids, timeout_s):
        live = {r: self.snaps[r] for r in ids if r in self.snaps and r not in self.gone | self.silent}
        return live, [r for r in ids if r in self.gone]

    def export(self, rid):
        self.calls.append(("export", rid))
        return self.held.pop(rid, [])

    def adopt(self, rid, moved):
        self.calls.append(("adopt", rid, [m.request.request_id for m in moved]))
        return rid not in self.refuse

    def release(self, rid):
        self.calls.append(("release", rid))

    def stop(self, rid):
        self.calls.append(("stop", rid))

    def drop(self, rid):
        self.calls.append(("drop", rid))

    def set_relay(self, rid, relay):
        self.calls.append(("set_relay", rid, relay))

    def spawn(self, rid, relay):
        self.calls.append(("spawn", rid, relay))
        self.starting[rid] = relay

    def spawned(self):
        started = sorted(r for r in self.starting if r not in self.fail_start)
        failed = {r: "it raised" for r in self.starting if r in self.fail_start}
        for r in started:
            self.snaps[r] = snap(r, version=5, draining=False)
        self.starting = {}
        return started, failed


class Pools:
    def __init__(self, owned: dict[str, list[PartialEntry]] | None = None) -> None:
        self.owned, self.expired = owned or {}, set()
        self.reassigned: list[tuple] = []
        self.released: list[str] = []

    def owned_by(self, owner):
        return self.owned.get(owner, [])

    def reassign(self, ids, owner, states):
        self.reassigned.append((ids, owner, [s.output_ids for s in states]))

    def live_groups(self):
        return {"g0"}

    def release_owner(self, owner, keep):
        self.released.append(owner)
        return ["g9"]

    def expired_owners(self):
        return set(self.expired)


class Relays:
    def __init__(self) -> None:
        self.dead: list[str] = []
        self.chain = ["node0", "node1"]

    def find_dead(self):
        dead, self.dead = self.dead, []
        return dead

    def cut(self, dead):
        self.chain = [r for r in self.chain if r not in dead]

    @property
    def order(self):
        return self.chain

    @property
    def latest(self):
        return {r: 3 for r in self.chain}


def manager(fleet, pools, relays=None, repack=True, mixes=False, placement=None, cfg=CFG):
    placement = placement or {r: "node0" for r in fleet.snaps}
    return RolloutManager(cfg, fleet, pools, relays, placement, repack, mixes)


def declining(fleet, m, **later):
    """Two checks: the second sees each rollout's KV 50 tokens below the first (or `later`)."""
    m.check_once()
    for r, s in list(fleet.snaps.items()):
        fleet.snaps[r] = snap(r, s.version, later.get(r, s.kv_used_tokens - 50), s.num_in_flight,
                              s.draining, s.held, s.num_waiting)
    m.check_once()


def test_repack_moves_the_sparser_declining_rollout_to_the_denser_one():
    fleet = Fleet({"a": snap("a", kv=150), "b": snap("b", kv=350), "c": snap("c", draining=False)})
    pools = Pools()
    m = manager(fleet, pools)
    m.check_once()
    assert fleet.calls == []  # no earlier check: nothing is known to decline yet
    declining(fleet, m)
    assert fleet.calls == [("export", "a"), ("adopt", "b", ["a-t"]), ("release", "a")]
    assert pools.reassigned == [(["a-t"], "b", [[7, 7, 7]])]
    assert m.counters["repacks"] == 1 and m.counters["moved_trajectories"] == 1


def test_no_repack_across_versions_for_a_held_admitting_or_rising_rollout_or_when_off():
    for snaps in ({"a": snap("a", version=1), "b": snap("b", version=2)},
                  {"a": snap("a", held=True), "b": snap("b")},
                  {"a": snap("a", waiting=2), "b": snap("b")},
                  {"a": snap("a", draining=False), "b": snap("b")}):
        fleet = Fleet(snaps)
        declining(fleet, manager(fleet, Pools()))
        assert fleet.calls == []
    fleet = Fleet({"a": snap("a"), "b": snap("b", kv=300)})  # KV still rising: not idle yet
    declining(fleet, manager(fleet, Pools()), a=120, b=320)
    assert fleet.calls == []
    fleet = Fleet({"a": snap("a"), "b": snap("b", kv=300)})
    declining(fleet, manager(fleet, Pools(), repack=False))
    assert fleet.calls == []


def test_a_refused_move_goes_back_to_its_source():
    fleet = Fleet({"a": snap("a", kv=150), "b": snap("b", kv=350)}, refuse={"b"})
    pools = Pools()
    m = manager(fleet, pools)
    declining(fleet, m)
    assert fleet.calls == [("export", "a"), ("adopt", "b", ["a-t"]), ("adopt", "a", ["a-t"]),
                           ("release", "a")]
    assert pools.reassigned == [] and m.counters["refused_moves"] == 1


def test_a_dead_rollouts_work_continues_on_a_same_version_peer_or_restarts():
    fleet = Fleet({"a": snap("a", version=3, draining=False), "b": snap("b", version=4, draining=False),
                   "dead": snap("dead", version=3)})
    fleet.gone.add("dead")
    same, other = unfinished("t-same", version=3), unfinished("t-old", version=2)
    pools = Pools({"dead": [PartialEntry(same.request, GROUP, "dead"),
                            PartialEntry(other.request, GROUP, "dead")]})
    m = manager(fleet, pools)
    m.check_once()
    assert ("drop", "dead") in fleet.calls
    # t-same to the rollout holding version 3, as it is; nobody holds version 2: t-old starts
    # from scratch on the first live rollout
    assert pools.reassigned == [(["t-same", "t-old"], "a", [[7, 7, 7], []])]
    assert m.counters["dead_workers"] == 1 and m.counters["restarted_trajectories"] == 1
    assert pools.released == ["dead"] and m.dead == ["dead"] and "dead" not in m.stats()["workers"]


def test_a_silent_rollout_is_dead_after_the_hang_timeout_and_expired_leases_are_read():
    fleet = Fleet({"a": snap("a", draining=False), "b": snap("b", draining=False)})
    pools = Pools()
    m = manager(fleet, pools)
    fleet.silent.add("b")
    m.check_once()
    assert m.dead == []  # one missed answer is not death
    m.last_seen["b"] = time.monotonic() - 3 * CFG.cluster.heartbeat_s - 0.1
    m.check_once()
    assert m.dead == []  # nor are three: a busy machine (cluster.hang_timeout_s)
    m.last_seen["b"] = time.monotonic() - CFG.cluster.hang_timeout_s - 0.1
    m.check_once()
    assert m.dead == ["b"]
    pools.expired = {"left-long-ago", "a"}  # a live rollout that stopped renewing: hung
    m.check_once()
    assert m.dead == ["b", "a"] and "left-long-ago" in pools.released


def test_rollouts_of_a_dead_relay_pull_from_a_live_one():
    fleet = Fleet({"a": snap("a", draining=False), "b": snap("b", draining=False)})
    relays = Relays()
    m = manager(fleet, Pools(), relays, placement={"a": "node0", "b": "node1"})
    relays.dead = ["node1"]
    assert m.check_relays() == ["node1"]
    assert fleet.calls == [("set_relay", "b", "node0")]
    assert m.stats()["chain"] == ["node0"] and m.counters["dead_relays"] == 1
    [fault] = m.stats()["faults"]
    assert (fault["kind"], fault["who"], fault["master"], fault["chain"]) == ("relay", "node1", False, ["node0"])


def test_a_dead_master_relay_is_recorded_and_its_rollouts_repointed():
    fleet = Fleet({"a": snap("a", draining=False), "b": snap("b", draining=False)})
    relays = Relays()
    m = manager(fleet, Pools(), relays, placement={"a": "node0", "b": "node1"})
    relays.dead = ["node0"]
    assert m.check_relays() == ["node0"] and m.check_relays() == []
    assert fleet.calls == [("set_relay", "a", "node1")]
    [fault] = m.stats()["faults"]
    assert fault["master"] and fault["chain"] == ["node1"]
    assert fault["detected_at"] <= fault["repaired_at"]


def test_a_dead_rollout_is_recreated_on_its_relay_under_a_new_incarnation():
    fleet = Fleet({"a": snap("a", version=3, draining=False), "b": snap("b", version=3, draining=False)})
    fleet.gone.add("b")
    moved = unfinished("t-b", version=3)
    pools = Pools({"b": [PartialEntry(moved.request, GROUP, "b")]})
    m = manager(fleet, pools, Relays(), placement={"a": "node0", "b": "node1"})
    m.check_once()
    assert ("spawn", "b.1", "node1") in fleet.calls  # beside its own relay, which lives
    assert m.stats()["spawning"] == ["b.1"] and m.stats()["workers"] == ["a"]
    m.check_once()  # it answered: it joins
    stats = m.stats()
    assert stats["workers"] == ["a", "b.1"] and stats["recreated"] == [["b", "b.1"]]
    assert m.rollout_relay["b.1"] == "node1" and stats["recreated_workers"] == 1
    [fault] = stats["faults"]
    assert (fault["kind"], fault["who"], fault["replacement"]) == ("rollout", "b", "b.1")
    assert fault["moved"] == {"t-b": 3}  # continued on "a" in its own version
    assert fault["detected_at"] <= fault["repaired_at"] <= fault["recreated_at"]
    # the new incarnation dies too: the slot's next one is b.2
    fleet.gone.add("b.1")
    m.check_once()
    assert ("spawn", "b.2", "node1") in fleet.calls and m.dead == ["b", "b.1"]


def test_recreation_is_bounded_off_when_asked_and_moves_on_after_a_failed_start():
    fleet = Fleet({"a": snap("a", draining=False), "b": snap("b", draining=False)})
    fleet.gone.add("b")
    off = load_config(None, ["manager.recreate=false"])
    m = manager(fleet, Pools(), cfg=off)
    m.check_once()
    assert not [c for c in fleet.calls if c[0] == "spawn"]

    fleet = Fleet({"a": snap("a", draining=False), "b": snap("b", draining=False)})
    fleet.gone.add("b")
    fleet.fail_start = {"b.1", "b.2"}
    relays = Relays()
    m = manager(fleet, Pools(), relays, placement={"a": "node0", "b": "node1"},
                cfg=load_config(None, ["manager.max_recreates=2"]))
    m.check_once()
    m.check_once()  # b.1 failed on node1: b.2 tries the other relay's node
    m.check_once()  # b.2 failed too: the slot's budget is spent
    spawns = [c for c in fleet.calls if c[0] == "spawn"]
    assert spawns == [("spawn", "b.1", "node1"), ("spawn", "b.2", "node0")]
    assert m.counters["recreate_failures"] == 2 and m.stats()["workers"] == ["a"]


def test_work_that_found_no_live_rollout_goes_to_the_recreated_one():
    fleet = Fleet({"only": snap("only", version=2, draining=False)})
    fleet.gone.add("only")
    pools = Pools({"only": [PartialEntry(unfinished("t", version=2).request, GROUP, "only")]})
    m = manager(fleet, pools)
    m.check_once()
    assert pools.reassigned == [] and m.orphaned == {"only"}  # nobody to take it yet
    m.check_once()  # only.1 joined (holding version 5): the work restarts there from scratch
    assert pools.reassigned == [(["t"], "only.1", [[]])] and m.orphaned == set()
    assert m.counters["restarted_trajectories"] == 1


def test_retire_moves_the_work_and_stops_the_rollout():
    fleet = Fleet({"a": snap("a", draining=False), "b": snap("b", draining=False)})
    pools = Pools()
    m = manager(fleet, pools)
    assert m.retire("a") == 1
    assert fleet.calls[:3] == [("export", "a"), ("stop", "a"), ("adopt", "b", ["a-t"])]
    assert m.stats()["workers"] == ["b"] and pools.released == ["a"]


# ------------------------------------------------------------------------- pure functions


def test_assign_unfinished_spreads_work_and_keeps_versions():
    moved = [unfinished(f"t{i}", version=1) for i in range(4)] + [unfinished("fresh", version=None)]
    plan, restarted = assign_unfinished(moved, {"a": 1, "b": 1, "c": 2}, mixes_versions=False)
    assert restarted == 0
    assert sorted(m.request.request_id for m in plan["a"]) == ["fresh", "t0", "t2"]
    assert sorted(m.request.request_id for m in plan["b"]) == ["t1", "t3"]
    mixed, restarted = assign_unfinished([unfinished("t", version=0)], {"c": 2}, mixes_versions=True)
    assert restarted == 0 and mixed["c"][0].request.output_ids == [7, 7, 7]  # continues as it is
    assert assign_unfinished(moved, {}, False) == ({}, 0)


def test_overdue_and_repoint():
    assert overdue({"a": 10.0, "b": 1.0}, now=11.0, limit_s=5.0) == ["b"]
    assert repoint({"r0": "n0", "r1": "n1", "r2": "n1"}, ["n1"], ["n0", "n2"]) == {"r1": "n0", "r2": "n2"}
    assert repoint({"r0": "n0"}, ["n0"], []) == {}


def test_recreate_on_its_own_node_first_and_incarnation_ids():
    assert recreate_on("n1", ["n0", "n1"]) == "n1"  # its relay lives: the same node
    assert recreate_on("n1", ["n0", "n2"]) == "n0"  # its relay died too: the first live one
    assert recreate_on("n1", ["n0", "n1"], failed=frozenset({"n1"})) == "n0"  # a start failed there
    assert recreate_on("n1", ["n1"], failed=frozenset({"n1"})) == "n1"  # nowhere else to go
    assert recreate_on("n1", []) is None
    assert [incarnation("rollout0", n) for n in range(3)] == ["rollout0", "rollout0.1", "rollout0.2"]


def test_the_health_loop_outlives_a_failing_check():
    import threading

    class Flaky(Fleet):
        def __init__(self, snaps):
            super().__init__(snaps)
            self.failures = 2

        def snapshots(self, ids, timeout_s):
            if self.failures:  # e.g. a pool call that timed out
                self.failures -= 1
                raise TimeoutError("the prompt pool did not answer")
            return super().snapshots(ids, timeout_s)

    cfg = load_config(None, ["manager.interval_s=0.01"])
    m = manager(Flaky({"r0": snap("r0")}), Pools(), repack=False, cfg=cfg)
    stop = threading.Event()
    loop = threading.Thread(target=m.run, args=(stop,))
    loop.start()
    until("three checks of the manager", lambda: m.counters["checks"] >= 3, poll_s=0.01)
    stop.set()
    loop.join()
    assert m.counters["check_errors"] == 2 and m.counters["checks"] >= 3
