"""Algorithm 1 (Best-Fit Trajectory Consolidation) against hand-worked cases."""

from __future__ import annotations

import random

import pytest

from laminar.manager.repack import RolloutLoad, is_candidate, plan_repack


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
