"""The scheduler's pure decisions: FIFO admission against KV capacity and batch slots,
preemption of the newest, and dense slot compaction."""

from __future__ import annotations

from laminar.engine.scheduler import compact, plan_step


def test_admits_fifo_while_slots_and_capacity_last():
    assert plan_step([], [10, 10, 10], capacity=100, max_batch=2) == (0, 2)
    # each admitted context also reserves its first decode token: 5 + 11 + 11 = 27 > 26
    assert plan_step([5], [10, 10, 10], capacity=27, max_batch=8) == (0, 2)
    assert plan_step([5], [10, 10, 10], capacity=26, max_batch=8) == (0, 1)


def test_head_of_queue_blocks_smaller_requests_behind_it():
    assert plan_step([20], [80, 1], capacity=100, max_batch=8) == (0, 0)


def test_decode_growth_preempts_the_newest_and_admits_nobody():
    # running need 40 + 35 + 30 = 105 > 100: the newest (30) goes back to waiting
    assert plan_step([40, 35, 30], [1], capacity=100, max_batch=8) == (1, 0)
    assert plan_step([40, 30, 20], [], capacity=50, max_batch=8) == (2, 0)


def test_exactly_full_is_not_overfull():
    assert plan_step([50, 50], [1], capacity=100, max_batch=8) == (0, 0)


def test_compact_fills_holes_from_the_end():
    assert compact(6, [1, 4]) == [(1, 5)]
    assert compact(5, [0, 1]) == [(0, 3), (1, 4)]
    assert compact(3, [2]) == []
    assert compact(4, [0, 1, 2, 3]) == []
