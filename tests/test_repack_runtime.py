"""Repack in the runtime: the manager's idleness check and post-update trigger over checks,
the batch bound B it uses, what a move costs (re-prefill tokens and seconds, counted by the
engine), and a move between two live Ray rollout actors."""

from __future__ import annotations

import copy
import json
import time

import pytest
import ray

from laminar.config import load_config
from laminar.engine import Engine
from laminar.engine.knee import cache_path, cached_knee
from laminar.manager.actor import RayFleet, RayManagerPools
from laminar.manager.manager import RolloutManager, batch_bound
from laminar.models import EOS_ID, PAD_ID, build_preset
from laminar.types import GenerationRequest, RolloutCounters, RolloutSnapshot, SamplingParams
from waiting import until


class Fleet:
    """Rollouts as the manager sees them: snapshots the test sets, calls it records."""

    def __init__(self, snaps: dict[str, RolloutSnapshot]) -> None:
        self.snaps, self.calls = snaps, []

    def snapshots(self, ids, timeout_s):
        return {r: self.snaps[r] for r in ids}, []

    def export(self, rid):
        self.calls.append(("export", rid))
        return []

    def adopt(self, rid, moved):
        self.calls.append(("adopt", rid))
        return True

    def release(self, rid):
        self.calls.append(("release", rid))

    def spawned(self):
        return [], {}


class Pools:
    def expired_owners(self):
        return set()


def snap(rid, kv, version=0, newest=None, draining=True):
    return RolloutSnapshot(rid, version, 2, 0, 2, 0, kv, 1000, False, draining, RolloutCounters(),
                           newest)


def test_a_check_after_an_update_comes_a_quarter_interval_later():
    cfg = load_config(None, ["manager.batch_bound=8", "manager.interval_s=0.4"])
    fleet = Fleet({"a": snap("a", 300, newest=0), "b": snap("b", 500, newest=0)})
    m = RolloutManager(cfg, fleet, Pools(), None, {"a": "n0", "b": "n0"}, True, False)
    m.check_once()  # the first check sees version 0 published
    assert m.next_check_s() == pytest.approx(0.1)
    m.check_once()
    assert m.next_check_s() == pytest.approx(0.4) and m.stats()["kv_phases"] == {"a": "plateau", "b": "plateau"}
    # the trainer publishes version 1; the rollouts see it and stop admitting (a drain)
    fleet.snaps = {"a": snap("a", 300, newest=1), "b": snap("b", 500, newest=1)}
    m.check_once()
    assert m.next_check_s() == pytest.approx(0.1) and fleet.calls == []
    # a quarter interval later their tails are finishing: both decline, a goes to b
    fleet.snaps = {"a": snap("a", 250, newest=1), "b": snap("b", 450, newest=1)}
    m.check_once()
    assert m.stats()["kv_phases"] == {"a": "decline", "b": "decline"}
    assert fleet.calls == [("export", "a"), ("release", "a")] and m.next_check_s() == pytest.approx(0.4)


def test_batch_bound_is_the_setting_or_the_cached_knee_under_the_engine_batch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert batch_bound(load_config(None, ["manager.batch_bound=12"])) == 12  # no cache read
    cfg = load_config(None, ["rollout.threads=1", "rollout.engine.max_batch_size=64"])
    file = cache_path("tiny", None, 1)
    file.parent.mkdir(parents=True)
    file.write_text(json.dumps({"knee": 29, "curve_ms": {"1": 1.0, "32": 2.1}}))
    assert batch_bound(cfg) == 29
    file.write_text(json.dumps({"knee": 200}))
    assert batch_bound(cfg) == 64  # never beyond the engine's decode batch
    assert batch_bound(load_config(None, ["manager.batch_bound=100"])) == 64


def test_another_backends_batch_bound_is_its_scheduler_limit_not_the_native_knee(monkeypatch):
    """The knee is a measurement of the native engine; a vLLM rollout decodes up to its own
    max_batch_size, so B is that (unless manager.batch_bound says otherwise)."""
    import laminar.engine.knee

    def no_knee(*_a, **_k):
        raise AssertionError("the native engine's knee was read for another backend")

    monkeypatch.setattr(laminar.engine.knee, "cached_knee", no_knee)
    cfg = load_config(None, ["rollout.engine.max_batch_size=48"])
    cfg.rollout.engine = cfg.rollout.engine.model_copy(update={"backend": "vllm"})
    assert batch_bound(cfg) == 48
    cfg.manager = cfg.manager.model_copy(update={"batch_bound": 12})
    assert batch_bound(cfg) == 12


@pytest.mark.slow
def test_a_missing_knee_is_measured_once_and_cached(tmp_path):
    first = cached_knee("tiny", None, 1, tmp_path)
    assert 1 <= first["knee"] <= 256 and set(first["curve_ms"]) == {str(2 ** k) for k in range(9)}
    assert cache_path("tiny", None, 1, tmp_path).is_file()
    assert cached_knee("tiny", None, 1, tmp_path) == first  # read back, not measured again


# ------------------------------------------------------------------------- what a move costs


@pytest.fixture(scope="module")
def model(one_thread):
    return build_preset("tiny", seed=0).eval()


def test_the_engine_counts_re_prefills_of_resumed_requests_only(model):
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    src = Engine(copy.deepcopy(model), EOS_ID, PAD_ID, max_batch_size=4, kv_capacity_tokens=64)
    reqs = [GenerationRequest(f"r{i}", [1, 10 + i, 11, 12], params) for i in range(3)]
    for r in reqs:
        src.add(r)
    for _ in range(4):
        src.step()
    assert src.num_reprefill_tokens == 0 and src.reprefill_s == 0.0  # fresh prompts are not
    moved = src.abort(["r0", "r1"])
    contexts = sum(r.num_tokens for r in moved)
    dst = Engine(copy.deepcopy(model), EOS_ID, PAD_ID, max_batch_size=4, kv_capacity_tokens=64)
    dst.add(GenerationRequest("fresh", [1, 20, 21], params))
    for r in moved:
        dst.add(r)
    dst.step()
    assert dst.num_reprefill_tokens == contexts  # prompt + the tokens generated at the source
    assert 0.0 < dst.reprefill_s
    while dst.has_unfinished():
        dst.step()
    assert dst.num_reprefill_tokens == contexts  # counted once, not again per step


def test_preemption_re_prefills_are_not_counted_as_moves(model):
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    engine = Engine(copy.deepcopy(model), EOS_ID, PAD_ID, max_batch_size=4, kv_capacity_tokens=48)
    for i in range(4):
        engine.add(GenerationRequest(f"p{i}", [1, 10 + i, 11], params))
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_preempted > 0 and engine.num_reprefill_tokens == 0


def test_a_moved_trajectory_keeps_its_start_so_its_latency_counts_the_time_before_the_move():
    from harness import World, step_until
    from test_rollout_loop import OVERRIDES

    from laminar.modes import schedule

    cfg = load_config(None, [*OVERRIDES, "rollout.max_new_tokens=40", "task.reverse.max_len=30"])
    w = World(cfg, "laminar")
    src, dst = w.loop("src"), w.loop("dst", schedule("sync").policy(cfg))  # dst admits nothing
    step_until(src, lambda: src.in_flight and all(r.output_ids for r, _ in src.in_flight.values()))
    time.sleep(0.3)  # the moved trajectories are at least this old
    moved = src.export()
    assert moved and all(m.started_at is not None for m in moved)
    contexts = sum(m.request.num_tokens for m in moved)  # prompt + tokens so far, at the move
    moment = time.time()
    assert dst.adopt(moved)
    step_until(dst, lambda: not dst.in_flight)
    c = dst.snapshot().counters
    assert c.traj_timed == len(moved) and c.traj_latency_max_s >= 0.3
    assert c.traj_latency_sum_s > len(moved) * (moment - max(m.started_at for m in moved))
    assert c.reprefill_tokens == contexts and c.reprefill_s > 0
    assert src.snapshot().counters.traj_timed == 0  # none ended there


# ------------------------------------------------------------------------- live actors

LIVE = ["sft.enabled=false", "mode=laminar", "rollout.num_workers=2", "cluster.virtual_nodes=1",
        "rollout.group_size=2", "rollout.batch_groups=2", "rollout.max_new_tokens=400",
        "task.reverse.max_len=12", "rollout.engine.max_batch_size=8", "trainer.prompts_per_step=4",
        "rollout.max_outstanding_batches=2", "trainer.threads=1", "manager.repack=false",
        "cluster.wait_timeout_s=120", "cluster.heartbeat_s=2", "rollout.stream_interval_s=0.05",
        "rollout.stream_every=4"]


class RecordingFleet(RayFleet):
    """The real Ray fleet, keeping what each export handed over."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.exported = []

    def export(self, rollout_id):
        moved = super().export(rollout_id)
        self.exported += [(m.request.request_id, list(m.request.output_ids), m.request.version)
                          for m in moved]
        return moved


def test_move_between_two_live_rollout_actors(tmp_path, ray_cluster):
    """Export from a decoding rollout, adopt on its same-version peer, reassign in the partial
    pool, release: the trajectories finish on the peer, once each, with their tokens and
    version, and the peer counts what it re-prefilled."""
    from laminar.modes import schedule
    from laminar.modes.common import start_weights
    from laminar.runtime.cluster import ClusterRuntime

    cfg = load_config(None, LIVE + [f"run_dir={tmp_path}"])
    model_dir, _ = start_weights(cfg)
    with ClusterRuntime(cfg, model_dir, 0, schedule("laminar").policy(cfg)) as rt:
        fleet = RecordingFleet(rt.workers, rt.rollout_spec, 60.0)
        m = RolloutManager(cfg, fleet, RayManagerPools(rt.pools, 60.0), None,
                           dict(rt.placement.worker_relay), False, False)

        def moved_once():  # an export may find the source between trajectories
            snaps, _ = fleet.snapshots(["rollout0", "rollout1"], 60.0)
            if len(snaps) == 2 and snaps["rollout0"].num_in_flight \
                    and snaps["rollout0"].version == snaps["rollout1"].version:
                m._move("rollout0", "rollout1")
            return fleet.exported

        until("rollout0 to have trajectories in flight to move", moved_once, poll_s=0.02)
        moved = {rid: (tokens, version) for rid, tokens, version in fleet.exported}
        assert m.counters["repacks"] == 1 and m.counters["moved_trajectories"] == len(moved)
        owned = {e.request.request_id for e in ray.get(rt.pools["partials"].owned_by.remote("rollout1"))}
        done = set()

        def all_finished():  # the trainer's part: take complete groups, check them
            groups = ray.get(rt.pools["buffer"].sample.remote(1, 0)) or []
            for traj in (t for g in groups for t in g if t.traj_id in moved):
                tokens, version = moved[traj.traj_id]
                assert traj.traj_id not in done  # once
                assert traj.version == version == 0 and traj.token_versions is None
                assert traj.response_ids[:len(tokens)] == tokens  # it went on from where it was
                done.add(traj.traj_id)
            return len(done) == len(moved)

        until("the moved trajectories to finish", all_finished, seen=lambda: set(moved) - done)
        src, dst = (ray.get(rt.workers[r].snapshot.remote()) for r in ("rollout0", "rollout1"))
    assert set(moved) <= owned | done  # reassigned to the peer (or already finished there)
    assert not src.held and src.counters.exported == len(moved) and dst.counters.adopted == len(moved)
    contexts = sum(len(t) for t, _ in moved.values())  # + prompts: re-prefilled at least these
    assert dst.counters.reprefill_tokens > contexts and dst.counters.reprefill_s > 0
    assert src.counters.reprefill_tokens == 0
    assert dst.counters.traj_timed >= len(moved)  # the moved ones' latencies end there
