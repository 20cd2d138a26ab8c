"""The benchmark's yardstick: static vs ideal continuous-batching step counts; the prefix-sharing
variants of `bench engine --spec` do the same work."""

from __future__ import annotations

import pytest

from laminar.bench.engine import build_workload, step_counts


def test_step_counts_static_pays_each_batch_longest_ideal_is_bounded_by_longest():
    # batches of 2: [1, 9] -> 9 steps, [2, 2] -> 2 steps; ideal: 14 tokens / 2 rows = 7, but
    # the longest request alone needs 9
    assert step_counts([1, 9, 2, 2], max_batch=2) == (11, 9)
    assert step_counts([3, 3, 3, 3], max_batch=2) == (6, 6)


def test_workload_has_the_reverse_task_long_tail():
    lengths = sorted(num_new for _, num_new in build_workload(256))
    assert lengths[-1] >= 5 * lengths[len(lengths) // 2]  # p100 well above the median
    static, ideal = step_counts([n for _, n in build_workload(256)], max_batch=64)
    assert static / ideal > 2.5


@pytest.mark.usefixtures("one_thread")
def test_spec_bench_prefix_variants_do_the_same_work():
    from laminar.bench.engine_spec import GROUP_SIZE, group_workload, run_groups
    from laminar.models import build_preset

    model = build_preset("tiny", seed=0).eval()
    groups = group_workload(prompt_len=24, num_new=5, num_groups=3)
    shared, plain = (run_groups(model, groups, share, max_batch=16) for share in (True, False))
    assert shared["tokens"] == plain["tokens"] == 3 * GROUP_SIZE * 5
    assert plain["prefill_tokens"] == 3 * GROUP_SIZE * 24
    assert shared["prefill_tokens"] == 3 * 24  # the batch fits: every group's samples follow
