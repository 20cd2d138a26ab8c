"""The idleness metric (§5.2: ramp-up, plateau, decline from two checks) and Algorithm 1
(Best-Fit Trajectory Consolidation) against hand-worked cases; the plan's invariants on
random fleets; the post-update trigger; the decode curve's knee (the batch bound B)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from laminar.engine.knee import cache_path, cpu_name, knee, step_clock
from laminar.manager.repack import (KvSample, RolloutLoad, idle_loads, is_candidate, is_post_update,
                                    kv_phase, plan_repack)
from laminar.types import RolloutCounters, RolloutSnapshot


def load(rid: str, used: int, reqs: int, *, prev: int | None = None, cap: int = 1000,
         version: int = 0) -> RolloutLoad:
    """A rollout in ramp-down by default (prev = used + 100)."""
    return RolloutLoad(rid, version, used, used + 100 if prev is None else prev, cap, reqs)


def test_smallest_sources_go_to_the_densest_bin_that_fits():
    # A(100) -> C: C would reach 600 > B's 400. B(300) -> C: 900 <= 990, 7 reqs <= 8.
    # C is then a destination and stays.
    rs = [load("A", 100, 2), load("B", 300, 3), load("C", 500, 2)]
    assert plan_repack(rs, c_max=0.99, batch_bound=8) == [("A", "C"), ("B", "C")]


def test_candidates_need_ramp_down_few_requests_and_room():
    ok = load("ok", 500, 3)
    assert is_candidate(ok, 0.99, 8)
    assert not is_candidate(load("rising", 500, 3, prev=400), 0.99, 8)  # ramp-up
    assert not is_candidate(load("flat", 500, 3, prev=500), 0.99, 8)  # plateau
    assert not is_candidate(load("full", 995, 3, prev=999), 0.99, 8)  # above C_max
    assert not is_candidate(load("busy", 500, 8), 0.99, 8)  # N_reqs == B
    assert not is_candidate(load("empty", 0, 0, prev=100), 0.99, 8)  # nothing to move
    # A non-candidate is neither source nor destination: "rising" has room but is no bin.
    rs = [load("A", 100, 1), load("rising", 500, 1, prev=400)]
    assert plan_repack(rs, 0.99, 8) == []


def test_request_bound_limits_a_bin():
    # B = 4: A(2 reqs) fills C (2 reqs) to 4; B (3 reqs) fits nowhere and stays.
    rs = [load("A", 100, 2), load("B", 300, 3), load("C", 500, 2)]
    assert plan_repack(rs, c_max=0.99, batch_bound=4) == [("A", "C")]


def test_kv_bound_uses_c_max_times_capacity():
    # 600 + 400 = 1000 > 0.99 * 1000: no fit; with c_max = 1.0 it fits exactly.
    rs = [load("A", 400, 1), load("B", 600, 1)]
    assert plan_repack(rs, c_max=0.99, batch_bound=8) == []
    assert plan_repack(rs, c_max=1.0, batch_bound=8) == [("A", "B")]


def test_an_emptied_source_is_never_a_destination():
    # A -> C (900, densest). B(200) would fit in A (300) but A is being emptied; C would
    # overflow (1100). So B stays.
    rs = [load("A", 100, 1), load("B", 200, 1), load("C", 800, 1)]
    assert plan_repack(rs, c_max=0.99, batch_bound=8) == [("A", "C")]


def test_a_destination_is_never_emptied_later():
    """The printed loop would next move C (200 tokens, 1 req) into D, carrying only C's own
    KV and stranding A's trajectories that were promised to C. C must stay."""
    rs = [load("A", 100, 5), load("C", 200, 1), load("D", 600, 4)]
    # A -> D fails on requests (9 > 8), so A -> C.
    assert plan_repack(rs, c_max=0.99, batch_bound=8) == [("A", "C")]


def test_chained_packing_accumulates_load_until_the_bin_is_full():
    # Sources of 150 each; D starts at 500 and takes three of them (650, 800, 950). The fourth
    # would bring D to 1100 > 990, and every other candidate is already emptied: it stays.
    rs = [load(f"s{i}", 150, 1) for i in range(4)] + [load("D", 500, 1)]
    assert plan_repack(rs, c_max=0.99, batch_bound=8) == [("s0", "D"), ("s1", "D"), ("s2", "D")]
    # A denser second bin E(700): s0 tops it up to 850; s1 no longer fits there (1000) and
    # goes to D (650), then s2 (800) and s3 (950) follow it: all four move.
    rs.append(load("E", 700, 1))
    assert plan_repack(rs, c_max=0.99, batch_bound=8) == [
        ("s0", "E"), ("s1", "D"), ("s2", "D"), ("s3", "D")]


def test_versions_are_planned_apart():
    # Across versions A would fit into B; within each version there is only one rollout.
    rs = [load("A", 100, 1, version=3), load("B", 500, 1, version=4)]
    assert plan_repack(rs, 0.99, 8) == []
    # Each version packs its own pair; lowest version first in the plan.
    rs += [load("A2", 50, 1, version=4), load("B2", 400, 1, version=3)]
    assert plan_repack(rs, 0.99, 8) == [("A", "B2"), ("A2", "B")]


def test_density_is_utilisation_so_small_bins_fill_first():
    # Same tokens after the move, but D1 (capacity 500) ends at 0.8, D2 (capacity 2000) at 0.2.
    rs = [load("S", 100, 1), load("D1", 300, 1, cap=500), load("D2", 300, 1, cap=2000)]
    assert plan_repack(rs, 0.99, 8) == [("S", "D1")]


def test_plan_does_not_depend_on_input_order():
    rng = random.Random(0)
    rs = [load(f"r{i}", rng.randrange(10, 600), rng.randrange(1, 6)) for i in range(30)]
    expected = plan_repack(rs, 0.99, 16)
    assert expected  # the case is non-trivial
    for _ in range(5):
        rng.shuffle(rs)
        assert plan_repack(rs, 0.99, 16) == expected
    sources = [s for s, _ in expected]
    dests = {d for _, d in expected}
    assert len(sources) == len(set(sources))  # each source moves once
    assert not dests & set(sources)  # no rollout is both


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="c_max"):
        plan_repack([], c_max=1.5, batch_bound=8)
    with pytest.raises(ValueError, match="batch_bound"):
        plan_repack([], c_max=0.9, batch_bound=0)
    with pytest.raises(ValueError, match="appears twice"):
        plan_repack([load("A", 1, 1), load("A", 2, 1)], 0.9, 8)
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        plan_repack([load("A", 1, 1, cap=0)], 0.9, 8)


# ------------------------------------------------------------------------- idleness (§5.2)


def snap(rid: str = "r", kv: int = 300, *, version: int = 0, n: int = 3, waiting: int = 0,
         draining: bool = True, held: bool = False, newest: int | None = None) -> RolloutSnapshot:
    return RolloutSnapshot(rid, version, n, 0, n - waiting, waiting, kv, 1000, held, draining,
                           RolloutCounters(), newest)


def test_the_lifecycle_of_fig_9_from_two_checks():
    prev = KvSample(version=0, kv_used_tokens=400)
    assert kv_phase(None, snap(), 0.99) == "ramp_up"  # first sight: filling
    assert kv_phase(KvSample(1, 900), snap(), 0.99) == "ramp_up"  # new weights: a fresh fill
    assert kv_phase(prev, snap(kv=500, draining=False), 0.99) == "ramp_up"  # filling
    assert kv_phase(prev, snap(kv=500, waiting=1), 0.99) == "ramp_up"  # from the engine's queue
    assert kv_phase(prev, snap(kv=500), 0.99) == "plateau"  # admits nothing; its tails grow
    assert kv_phase(prev, snap(kv=400), 0.99) == "plateau"  # flat
    # KV fell, but what finished is refilled: from the engine's queue, or by a schedule still
    # admitting (a rollout topping up saws below its cap)
    assert kv_phase(prev, snap(waiting=1), 0.99) == "plateau"
    assert kv_phase(prev, snap(draining=False), 0.99) == "plateau"
    assert kv_phase(KvSample(0, 999), snap(kv=995), 0.99) == "plateau"  # still full (>= C_max)
    assert kv_phase(prev, snap(), 0.99) == "decline"  # fell, nothing left to admit: idle


def test_idle_loads_carry_the_measured_c_prev_and_leave_out_held_rollouts():
    previous = {"a": KvSample(0, 400), "b": KvSample(0, 700), "c": KvSample(0, 100),
                "h": KvSample(0, 900)}
    snaps = [snap("a", 300), snap("b", 650, n=5), snap("c", 200), snap("h", 100, held=True),
             snap("new", 50)]
    assert idle_loads(snaps, previous, 0.99) == [RolloutLoad("a", 0, 300, 400, 1000, 3),
                                                 RolloutLoad("b", 0, 650, 700, 1000, 5)]
    # those loads are exactly Algorithm 1's candidates: a -> b (950 <= 990, 8 reqs <= B)
    assert plan_repack(idle_loads(snaps, previous, 0.99), 0.99, 8) == [("a", "b")]


def test_post_update_means_a_newer_version_reached_a_rollout_since_the_last_check():
    assert not is_post_update(3, [snap(newest=3), snap(newest=None)])
    assert is_post_update(3, [snap(newest=3), snap(newest=4)])
    assert is_post_update(None, [snap(newest=0)])
    assert not is_post_update(None, [snap(newest=None)])


@pytest.mark.parametrize("seed", range(20))
def test_a_plan_never_crosses_versions_nor_overfills_c_max_or_b(seed):
    """Random fleets of three versions and mixed capacities: every move stays within its
    version; every destination ends at or under C_max x capacity and B trajectories; no
    rollout is both a source and a destination, none is emptied twice."""
    rng = random.Random(seed)
    rs = []
    for i in range(rng.randrange(2, 24)):
        cap = rng.choice([500, 1000, 4096])
        used = rng.randrange(1, cap)
        rs.append(RolloutLoad(f"r{i}", rng.randrange(3), used, max(0, used + rng.randrange(-50, 200)),
                              cap, rng.randrange(0, 20)))
    c_max, bound = rng.choice([0.5, 0.9, 0.99, 1.0]), rng.randrange(2, 24)
    plan = plan_repack(rs, c_max, bound)
    by_id = {r.rollout_id: r for r in rs}
    sources = [s for s, _ in plan]
    assert len(sources) == len(set(sources)) and not set(sources) & {d for _, d in plan}
    for s, d in plan:
        assert by_id[s].version == by_id[d].version
        assert is_candidate(by_id[s], c_max, bound) and is_candidate(by_id[d], c_max, bound)
    for d in {d for _, d in plan}:
        moved = [by_id[s] for s, dd in plan if dd == d]
        dest = by_id[d]
        assert dest.kv_used_tokens + sum(m.kv_used_tokens for m in moved) <= c_max * dest.kv_capacity_tokens
        assert dest.num_reqs + sum(m.num_reqs for m in moved) <= bound


# ------------------------------------------------------------------------- the batch bound B


def test_the_knee_is_where_a_step_costs_twice_a_batch_1_step():
    # a roofline a + c*b, a = 1 ms, c = 0.05 ms: 2 x (a + c) = a + c*b at b = a/c + 2 = 22,
    # between the measured 16 (1.8 ms) and 32 (2.6 ms), found by linear interpolation
    line = {b: 1.0 + 0.05 * b for b in (1, 2, 4, 8, 16, 32, 64)}
    assert knee(line) == 22
    assert knee({1: 1.0, 8: 1.5, 16: 2.0}) == 16  # reached exactly at a measured batch
    assert knee({1: 1.0, 64: 1.2, 256: 1.9}) == 256  # never compute-bound: the largest measured
    assert knee({"1": 1.0, "2": 3.0}) == 1  # JSON keys; a curve that doubles at once
    with pytest.raises(ValueError, match="batch 1"):
        knee({8: 1.0, 16: 2.0})


def test_a_gpus_curve_is_cached_apart_from_the_cpus_and_timed_by_the_wall_clock():
    cpu = cache_path("tiny", None, 1, Path("c"))
    assert cpu.name.startswith("engine-knee-tiny-") and cpu_name() and "gpu-" not in cpu.name
    gpu = cache_path("tiny", None, 1, Path("c"), "cuda:0", name="NVIDIA H100 80GB HBM3")
    assert gpu.name == "engine-knee-tiny-gpu-nvidia-h100-80gb-hbm3-1t.json"
    assert step_clock("cpu") is time.process_time  # CPU time: other jobs slow it little
    assert step_clock("cuda:0") is not time.process_time  # (a synchronized wall clock)
