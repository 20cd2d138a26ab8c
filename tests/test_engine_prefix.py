"""Shared group prefixes in the native engine: a group's prompt is prefilled once, its KV is
counted once, and outputs are the same tokens as without sharing — for samples admitted
together (followers), admitted later next to a running sibling (forks), and moved away and back
(abort/resume). Tiny model, CPU."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest

from laminar.engine import Engine
from laminar.models import BOS_ID, PAD_ID, build_preset
from laminar.types import GenerationRequest, SamplingParams
from harness import sharpen

pytestmark = pytest.mark.usefixtures("one_thread")

NO_EOS = 10_000


@pytest.fixture(scope="module")
def model():
    return sharpen(build_preset("tiny", seed=3))


def group(prompt: list[int], n: int, params: SamplingParams, lengths: list[int] | None = None
          ) -> list[GenerationRequest]:
    """n samples of one prompt, each with its own seed (and budget, if `lengths`)."""
    out = []
    for i in range(n):
        p = dataclasses.replace(params, seed=100 + i, max_new_tokens=(
            lengths[i] if lengths else params.max_new_tokens))
        out.append(GenerationRequest(f"g{i}", list(prompt), p))
    return out


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [BOS_ID] + [rng.randrange(3, 100) for _ in range(length - 1)]


def test_a_group_of_8_holds_one_prompt_of_kv_plus_its_responses(model):
    prompt = prompt_of(200)
    engine = Engine(model, NO_EOS, PAD_ID, max_batch_size=8)
    reqs = group(prompt, 8, SamplingParams(temperature=1.0, max_new_tokens=12))
    for req in reqs:
        engine.add(req)
    for _ in range(5):
        engine.step()
    # each sample has 5 tokens, 4 of them cached: one prompt's worth plus 8 x 4
    assert engine.stats().kv_used_tokens == 200 + 8 * 4
    assert engine.num_prefill_tokens == 200  # unshared: 8 x 200
    assert (engine.num_prefix_hits, engine.num_prefix_lookups) == (7, 8)
    unshared = Engine(model, NO_EOS, PAD_ID, max_batch_size=8, share_prefixes=False)
    for req in group(prompt, 8, SamplingParams(temperature=1.0, max_new_tokens=12)):
        unshared.add(req)
    for _ in range(5):
        unshared.step()
    assert unshared.stats().kv_used_tokens == 8 * (200 + 4)
    assert unshared.num_prefill_tokens == 8 * 200


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_equal_unshared_for_followers_and_later_forks(model, temperature):
    """max_batch 3 with budgets of different lengths: 3 admitted together (a leader, two
    followers), the other 5 forked from a running sibling as slots free up."""
    prompt = prompt_of(40, seed=1)
    lengths = [5, 9, 14, 7, 20, 3, 11, 16]
    params = SamplingParams(temperature=temperature, max_new_tokens=20)
    engine = Engine(model, NO_EOS, PAD_ID, max_batch_size=3)
    shared = engine.generate(group(prompt, 8, params, lengths))
    assert engine.num_prefix_hits == 7 and engine.num_prefill_tokens == 40 + 5  # 5 forks
    plain = Engine(model, NO_EOS, PAD_ID, max_batch_size=3, share_prefixes=False).generate(
        group(prompt, 8, params, lengths))
    for a, b in zip(shared, plain):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert [len(r.output_ids) for r in shared] == lengths


def test_capacity_admits_a_whole_group_that_fits_only_when_shared(model):
    prompt = prompt_of(100, seed=2)
    # 8 x 100 unshared would not fit; 100 + 8 x 11 does
    engine = Engine(model, NO_EOS, PAD_ID, max_batch_size=8, kv_capacity_tokens=200)
    engine.add(GenerationRequest("x", prompt, SamplingParams(max_new_tokens=10)))  # check_request
    engine.abort(["x"])
    for req in group(prompt, 8, SamplingParams(temperature=1.0, max_new_tokens=10)):
        engine.add(req)
    engine.step()
    assert engine.stats().num_running == 8
    while engine.has_unfinished():
        engine.step()
        assert engine.stats().kv_used_tokens <= 200
    assert engine.scheduler.num_preempted == 0


def test_a_moved_sample_keeps_its_output(model):
    """One sample of a running group is aborted (repack, failover), resumed on another engine
    and on the same one beside its siblings: every output equals the uninterrupted run's."""
    prompt = prompt_of(60, seed=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    whole = Engine(model, NO_EOS, PAD_ID).generate(group(prompt, 8, params))
    engine = Engine(model, NO_EOS, PAD_ID, max_batch_size=8)
    reqs = group(prompt, 8, params)
    for req in reqs:
        engine.add(req)
    for _ in range(6):
        engine.step()
    [moved] = engine.abort(["g3"])
    [back] = engine.abort(["g5"])
    assert engine.stats().kv_used_tokens == 60 + 6 * 5  # the six left still share one prompt
    elsewhere = Engine(copy.deepcopy(model), NO_EOS, PAD_ID, seed=7)
    elsewhere.generate([moved])
    engine.add(back)  # re-prefilled (it has tokens), next to siblings that share
    while engine.has_unfinished():
        engine.step()
    for got, want in zip(reqs, whole):
        assert got.output_ids == want.output_ids


def test_a_forced_weight_swap_does_not_share_keys_of_the_old_weights(model):
    prompt = prompt_of(30, seed=5)
    engine = Engine(copy.deepcopy(model), NO_EOS, PAD_ID, max_batch_size=8)
    engine.add(GenerationRequest("a", prompt, SamplingParams(max_new_tokens=20, seed=1)))
    engine.step()
    new_weights = build_preset("tiny", seed=9).state_dict()
    engine.load_weights(new_weights, version=1, force=True)
    late = GenerationRequest("b", prompt, SamplingParams(max_new_tokens=5, seed=2))
    engine.add(late)
    engine.step()
    assert engine.num_prefix_hits == 0 and engine.num_prefill_tokens == 60
    fresh = Engine(build_preset("tiny", seed=9), NO_EOS, PAD_ID).generate(
        [GenerationRequest("b", prompt, SamplingParams(max_new_tokens=5, seed=2))])
    while engine.has_unfinished():
        engine.step()
    assert late.output_ids == fresh[0].output_ids
