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


def _seq(prompt_len: int, generated: int = 0, holds: bool = False):
    from laminar.engine.sequence import Sequence
    from laminar.types import GenerationRequest

    request = GenerationRequest("r", list(range(prompt_len)), output_ids=[7] * generated)
    seq = Sequence(request, seed=0, eos_token_id=1, share_prefix=True)
    if holds:
        seq.prefix = (seq.prompt_key, 0)
    return seq


def test_a_shared_prompt_is_charged_to_its_first_holder_only():
    from laminar.engine.scheduler import running_costs, waiting_costs

    a, b, c = _seq(10, 3, holds=True), _seq(10, 5, holds=True), _seq(4, 2)
    assert running_costs([a, b, c]) == [13, 5, 6]
    # fresh samples of the held prompt cost nothing (plan_step adds their next token); a fresh
    # new prompt is charged once, to the first in the queue; a resumed sample pays its context
    assert waiting_costs([a, b], [_seq(10), _seq(6), _seq(6), _seq(10, 2)], version=0) == \
        [0, 6, 0, 12]
    assert waiting_costs([a], [_seq(10)], version=1) == [10]  # keys of other weights
