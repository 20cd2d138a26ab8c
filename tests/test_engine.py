"""The native engine against transformers: same greedy tokens, log-probs equal to a teacher-
forced forward, finishing rules, preemption under a small KV capacity, abort/resume across
engine instances, and weight swaps. Real tiny models (random init, CPU), no fakes."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from laminar.engine import Engine, HFEngine
from laminar.models import BOS_ID, EOS_ID, PAD_ID, build_preset, load_pretrained, save_pretrained
from laminar.models.tokenizer import build_char_tokenizer
from laminar.types import GenerationRequest, SamplingParams
from harness import GREEDY, make_prompts, requests, sharpen

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return sharpen(build_preset("tiny", seed=3))


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int = EOS_ID) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids),
                         generation_config=GenerationConfig(
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=PAD_ID))
    return out[0, len(prompt):].tolist()


def teacher_forced_logprobs(model, req: GenerationRequest) -> list[float]:
    """Log-probs of req.output_ids under the sampling distribution, from one plain forward."""
    ids = torch.tensor([req.prompt_ids + req.output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(req.prompt_ids) - 1:-1].float()
    p = req.params
    if not p.is_greedy:
        warpers = [TemperatureLogitsWarper(p.temperature)]
        if p.top_k > 0:
            warpers.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1.0:
            warpers.append(TopPLogitsWarper(p.top_p))
        for warp in warpers:
            logits = warp(ids, logits)
    logprobs = logits.log_softmax(-1)
    return logprobs.gather(-1, torch.tensor(req.output_ids)[:, None]).squeeze(-1).tolist()


# -- equality with transformers ------------------------------------------------------------------


def test_greedy_matches_transformers_generate_batched_mixed_lengths(model):
    prompts = make_prompts(12, seed=1)
    engine = Engine(model, EOS_ID, PAD_ID, max_batch_size=8)  # 12 requests, 8 slots: waves
    out = engine.generate(requests(prompts))
    for req, prompt in zip(out, prompts):
        assert req.output_ids == hf_greedy(model, prompt, GREEDY.max_new_tokens)
        assert req.version == 0 and req.finish_reason in ("eos", "length")
    # and the static HF backend (left-padded batches) agrees token for token
    static = HFEngine(model, EOS_ID, PAD_ID, max_batch_size=8).generate(requests(prompts))
    assert [r.output_ids for r in static] == [r.output_ids for r in out]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_matches_generate_other_families(family):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    torch.manual_seed(0)
    if family == "llama":
        m = LlamaForCausalLM(LlamaConfig(**common, attention_bias=True, tie_word_embeddings=False))
    else:
        m = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, tie_word_embeddings=True))
    sharpen(m)
    prompts = make_prompts(6, seed=2)
    out = Engine(m, EOS_ID, PAD_ID).generate(requests(prompts))
    for req, prompt in zip(out, prompts):
        assert req.output_ids == hf_greedy(m, prompt, GREEDY.max_new_tokens)


def test_local_model_directory(model, tmp_path):
    save_pretrained(model, build_char_tokenizer(), tmp_path / "m")
    loaded, _ = load_pretrained(tmp_path / "m")
    prompts = make_prompts(3, seed=4)
    a = Engine(loaded, EOS_ID, PAD_ID).generate(requests(prompts))
    b = Engine(model, EOS_ID, PAD_ID).generate(requests(prompts))
    assert [r.output_ids for r in a] == [r.output_ids for r in b]


def test_logprobs_equal_teacher_forced_forward(model):
    prompts = make_prompts(8, seed=5)
    settings = [SamplingParams(temperature=1.0, max_new_tokens=20, seed=1),
                SamplingParams(temperature=0.7, top_k=20, max_new_tokens=20, seed=2),
                SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=20, seed=3),
                SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_new_tokens=20),
                SamplingParams(temperature=0.0, max_new_tokens=20)]
    reqs = [GenerationRequest(f"r{i}", p, settings[i % len(settings)])
            for i, p in enumerate(prompts)]
    Engine(model, EOS_ID, PAD_ID, max_batch_size=4).generate(reqs)
    for req in reqs:
        assert len(req.logprobs) == len(req.output_ids) > 0
        expected = teacher_forced_logprobs(model, req)
        assert max(abs(a - b) for a, b in zip(req.logprobs, expected)) < 1e-4, req.params


# -- finishing rules and preemption --------------------------------------------------------------


def test_eos_stop_token_and_length(model):
    prompt = make_prompts(1, seed=6)[0]
    sampled = SamplingParams(temperature=1.0, max_new_tokens=12, seed=4)
    reference = Engine(model, 10_000, PAD_ID).generate(requests([prompt], sampled))[0].output_ids
    fresh = [i for i in range(1, 12) if reference[i] not in reference[:i]]  # first occurrences
    i, j = fresh[0], fresh[1]
    by_eos = Engine(model, reference[i], PAD_ID).generate(requests([prompt], sampled))[0]
    assert by_eos.output_ids == reference[:i + 1] and by_eos.finish_reason == "eos"
    stopping = SamplingParams(temperature=1.0, max_new_tokens=12, seed=4,
                              stop_token_ids=(reference[j],))
    by_stop = Engine(model, 10_000, PAD_ID).generate(requests([prompt], stopping))[0]
    assert by_stop.output_ids == reference[:j + 1] and by_stop.finish_reason == "stop"
    short = SamplingParams(temperature=1.0, max_new_tokens=7, seed=4)
    by_len = Engine(model, 10_000, PAD_ID).generate(requests([prompt], short))[0]
    assert by_len.output_ids == reference[:7] and by_len.finish_reason == "length"


def test_small_kv_capacity_preempts_and_completes_everything(model):
    prompts = make_prompts(10, seed=7, lo=8, hi=16)
    params = SamplingParams(temperature=0.0, max_new_tokens=30)
    roomy = Engine(model, 10_000, PAD_ID).generate(requests(prompts, params))
    engine = Engine(model, 10_000, PAD_ID, kv_capacity_tokens=120)  # ~3 sequences at full length
    reqs = requests(prompts, params)
    for req in reqs:
        engine.add(req)
    peak = 0
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats()
        peak = max(peak, stats.kv_used_tokens)
        assert stats.kv_used_tokens <= stats.kv_capacity_tokens
        assert stats.kv_used_tokens == sum(s.num_tokens - 1 for s in engine.scheduler.running)
    assert engine.scheduler.num_preempted > 0 and peak > 100
    assert all(r.finish_reason == "length" for r in reqs)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in roomy]  # re-prefill is lossless


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tightest_capacity_finishes_without_hanging(model, seed):
    """Regression: a capacity of exactly prompt + max_new_tokens for the longest request must
    still let a preempted request back in (admission reserves one token beyond its context)."""
    rng = random.Random(seed)
    prompts = make_prompts(8, seed=seed, lo=3, hi=12)
    reqs = [GenerationRequest(f"r{i}", p, SamplingParams(temperature=1.0, seed=i,
                                                         max_new_tokens=rng.randrange(5, 25)))
            for i, p in enumerate(prompts)]
    capacity = max(len(r.prompt_ids) + r.params.max_new_tokens for r in reqs)
    longest = next(r for r in reqs if len(r.prompt_ids) + r.params.max_new_tokens == capacity)
    with pytest.raises(ValueError, match="KV tokens"):  # one less could strand it in the queue
        Engine(model, 10_000, PAD_ID, kv_capacity_tokens=capacity - 1).add(copy.deepcopy(longest))
    engine = Engine(model, 10_000, PAD_ID, max_batch_size=4, kv_capacity_tokens=capacity)
    for req in reqs:
        engine.add(req)
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
        assert engine.stats().kv_used_tokens <= capacity
    assert all(len(r.output_ids) == r.params.max_new_tokens for r in reqs)
    assert engine.scheduler.num_preempted > 0


def test_stats_count_real_tokens(model):
    engine = Engine(model, 10_000, PAD_ID, max_batch_size=2)
    prompts = [[BOS_ID, 10, 11], [BOS_ID, 12], [BOS_ID, 13, 14, 15, 16]]
    for req in requests(prompts, SamplingParams(temperature=0.0, max_new_tokens=5)):
        engine.add(req)
    assert (engine.stats().num_running, engine.stats().num_waiting) == (0, 3)
    engine.step()  # prefill the first two: 3 + 2 prompt tokens cached, one token sampled each
    s = engine.stats()
    assert (s.num_running, s.num_waiting, s.kv_used_tokens, s.num_generated_tokens) == (2, 1, 5, 2)
    engine.step()
    s = engine.stats()
    assert (s.kv_used_tokens, s.num_generated_tokens) == (7, 4)


# -- abort and resume ----------------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_new_tokens=30),
    SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=30, seed=11),
], ids=["greedy", "seeded-sampling"])
def test_abort_resume_on_another_engine_equals_uninterrupted(model, params):
    prompts = make_prompts(6, seed=8)
    whole = Engine(model, 10_000, PAD_ID).generate(requests(prompts, params))

    first = Engine(model, 10_000, PAD_ID, max_batch_size=4)
    for req in requests(prompts, params):
        first.add(req)
    for _ in range(9):
        first.step()
    ids = [f"r{i}" for i in range(6)]
    states = first.abort(ids)
    assert not first.has_unfinished() and first.stats().kv_used_tokens == 0
    assert sorted(s.request_id for s in states) == ids
    assert all(s.finish_reason is None for s in states)
    assert any(len(s.output_ids) == 9 for s in states) and any(s.output_ids == [] for s in states)

    second = Engine(copy.deepcopy(model), 10_000, PAD_ID, max_batch_size=3, seed=99)
    resumed = second.generate(states)
    by_id = {r.request_id: r for r in resumed}
    for req in whole:
        got = by_id[req.request_id]
        assert got.output_ids == req.output_ids and got.finish_reason == req.finish_reason
        assert max(abs(a - b) for a, b in zip(got.logprobs, req.logprobs)) < 1e-4


def test_abort_some_while_others_continue(model):
    prompts = make_prompts(5, seed=9)
    whole = Engine(model, 10_000, PAD_ID).generate(requests(prompts))
    engine = Engine(model, 10_000, PAD_ID, max_batch_size=3)
    reqs = requests(prompts)
    for req in reqs:
        engine.add(req)
    engine.step()
    engine.step()
    [aborted] = engine.abort(["r1"])  # a running row from the middle of the batch
    assert aborted is reqs[1] and len(aborted.output_ids) == 2
    assert engine.abort(["nope"]) == []
    engine.add(aborted)
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in reqs] == [r.output_ids for r in whole]


def test_resume_with_no_budget_left_finishes_at_once(model):
    req = GenerationRequest("done", [BOS_ID, 5], SamplingParams(max_new_tokens=2),
                            output_ids=[7, 8], logprobs=[-1.0, -2.0], token_versions=[0, 0],
                            version=0)
    engine = Engine(model, EOS_ID, PAD_ID)
    engine.add(req)
    [delta] = engine.step()
    assert delta.finish_reason == "length" and delta.token_ids == [] and req.output_ids == [7, 8]
    assert not engine.has_unfinished()
    ended = GenerationRequest("ended", [BOS_ID, 5], SamplingParams(max_new_tokens=9),
                              output_ids=[7, EOS_ID], logprobs=[-1.0, -2.0],
                              token_versions=[0, 0], version=0)
    engine.add(ended)  # a state whose last token is EOS (aborted right after it) is done
    assert [d.finish_reason for d in engine.step()] == ["eos"] and ended.output_ids == [7, EOS_ID]


def test_bad_requests_fail_with_clear_errors(model):
    engine = Engine(model, EOS_ID, PAD_ID, kv_capacity_tokens=64)
    small = SamplingParams(max_new_tokens=10)
    engine.add(GenerationRequest("a", [BOS_ID, 5], small))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add(GenerationRequest("a", [BOS_ID, 5], small))
    with pytest.raises(ValueError, match="empty prompt_ids"):
        engine.add(GenerationRequest("b", [], small))
    with pytest.raises(ValueError, match="kv_capacity_tokens=64"):
        engine.add(GenerationRequest("c", [BOS_ID] * 10, SamplingParams(max_new_tokens=100)))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Engine(model, EOS_ID, PAD_ID).add(
            GenerationRequest("d", [BOS_ID] * 10, SamplingParams(max_new_tokens=5000)))


# -- weights -------------------------------------------------------------------------------------


def test_load_weights_refuses_mid_flight_then_swaps_and_stamps_version(model):
    other = sharpen(build_preset("tiny", seed=123))
    engine = Engine(copy.deepcopy(model), 10_000, PAD_ID, version=0)
    running = GenerationRequest("old", [BOS_ID, 9, 9],
                                SamplingParams(temperature=0.0, max_new_tokens=8))
    engine.add(running)
    engine.step()
    with pytest.raises(RuntimeError, match="refused: 1 request"):
        engine.load_weights(other.state_dict(), version=1)
    engine.generate([])  # drain
    assert running.version == 0 and running.finish_reason == "length"

    queued = GenerationRequest("queued", [BOS_ID, 9], SamplingParams(max_new_tokens=3))
    engine.add(queued)  # not started yet: does not block the swap, and gets the new version
    engine.load_weights(other.state_dict(), version=1)
    assert engine.version == 1 and engine.stats().version == 1
    engine.generate([])
    assert queued.version == 1
    prompts = make_prompts(3, seed=10)
    swapped = engine.generate(requests(prompts))
    fresh = Engine(other, 10_000, PAD_ID).generate(requests(prompts))
    assert [r.output_ids for r in swapped] == [r.output_ids for r in fresh]
    assert all(r.version == 1 for r in swapped)

    with pytest.raises(KeyError, match="not a tensor of this model"):
        engine.load_weights({"no.such.weight": torch.zeros(1)}, version=2)


def test_forced_load_weights_continues_in_flight_requests(model):
    engine = Engine(copy.deepcopy(model), 10_000, PAD_ID)
    req = GenerationRequest("x", [BOS_ID, 9, 9], SamplingParams(temperature=0.0, max_new_tokens=8))
    engine.add(req)
    engine.step()
    engine.load_weights(build_preset("tiny", seed=5).named_parameters(), version=1, force=True)
    engine.generate([])
    assert len(req.output_ids) == 8 and req.version == 0 and engine.version == 1
    assert req.token_versions == [0] + [1] * 7 and req.mixes_versions  # each token's own version


def test_kv_capacity_from_a_memory_budget(model):
    from laminar.engine.kv_cache import kv_capacity_from_memory

    # tiny preset: 2 layers x (K and V) x 2 KV heads x 32 dims x 4 bytes = 1 KiB per token
    assert kv_capacity_from_memory(model.config, 1 << 20, torch.float32) == 1024
    assert kv_capacity_from_memory(model.config, 1 << 20, torch.bfloat16) == 2048


def test_the_native_engine_is_a_rollout_engine_and_hf_a_baseline_outside_it(model):
    """What the rollout loop, evaluator and relay client may rely on (engine/protocol.py)."""
    from laminar.engine.protocol import RolloutEngine

    engine = Engine(copy.deepcopy(model), EOS_ID, PAD_ID, max_batch_size=4)
    assert isinstance(engine, RolloutEngine) and engine.backend == "native"
    hf = HFEngine(model, EOS_ID, PAD_ID)  # generate() only: no add/step/abort/stats
    assert not isinstance(hf, RolloutEngine) and hf.backend == "hf"
    engine.close()
