"""Speculative decoding in the native engine is lossless: the same tokens as without it (greedy
and seeded sampling, stop strings, EOS, budgets, abort/resume, preemption), the target's own
log-probs, and at temperature 1 a sample distribution a chi-square test cannot tell from the
model's — a test that does catch a broken acceptance rule. Plus the drafter's pure parts."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from laminar.engine import Engine
from laminar.engine import speculation
from laminar.engine.speculation import Drafter, PromptIndex, StepCost, accept, plan_drafts
from laminar.models import BOS_ID, PAD_ID, build_preset
from laminar.types import GenerationRequest, SamplingParams
from harness import sharpen

pytestmark = pytest.mark.usefixtures("one_thread")

NO_EOS = 10_000


@pytest.fixture(scope="module")
def model():
    return sharpen(build_preset("tiny", seed=3))


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[BOS_ID] + [rng.randrange(4, 60) for _ in range(rng.randrange(4, 20))]
            for _ in range(n)]


def groups(prompt_list: list[list[int]], size: int, params: SamplingParams, tag: str = ""
           ) -> list[GenerationRequest]:
    """`size` samples per prompt, seeds 0.. within each group (as a rollout gives them)."""
    return [GenerationRequest(f"{tag}p{j}s{i}", list(p), dataclasses.replace(params, seed=i))
            for j, p in enumerate(prompt_list) for i in range(size)]


def two_epochs(engine: Engine, prompt_list, params) -> list[GenerationRequest]:
    """The same prompts twice (the second epoch drafts from the first); returns both."""
    first = engine.generate(groups(prompt_list, 4, params, "e0"))
    return first + engine.generate(groups(prompt_list, 4, params, "e1"))


# -- the drafter's pure parts --------------------------------------------------------------------


def test_accept_keeps_the_confirmed_prefix():
    assert accept([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accept([5, 6], [5, 6, 8]) == 2
    assert accept([5], [4, 0]) == 0
    assert accept([], [3]) == 0


def test_index_drafts_from_siblings_history_and_the_prompt():
    prompt = [1, 10, 11, 12, 13, 10, 11]
    index = PromptIndex(prompt)
    # the prompt's own n-grams: ... 10 11 was followed by 12 13
    assert index.lookup([], 2) == [12, 13]
    sibling = [20, 21, 22, 23]
    index.add_stream(sibling)
    index.catch_up()
    assert index.lookup([], 3) == [20, 21, 22]  # the most recent continuation wins
    assert index.lookup([20, 21], 5) == [22, 23]
    sibling.append(24)  # a running sibling grows in place
    index.catch_up()
    assert index.lookup([20, 21], 5) == [22, 23, 24]
    assert index.lookup([99, 98], 5) == []


def test_adaptive_k_grows_on_success_shrinks_on_rejection_and_backs_off():
    drafter = Drafter(max_draft=6)

    class Seq:
        request = GenerationRequest("x", [1, 2, 3, 2, 3], SamplingParams())

    seq = Seq()
    drafter.register(seq)
    assert seq.spec.k == 3
    drafter.feedback(seq, 3, 3)
    assert seq.spec.k == 4
    drafter.feedback(seq, 4, 1)
    assert seq.spec.k == 2
    for _ in range(6):
        drafter.feedback(seq, 2, 0)
    assert seq.spec.acceptance < speculation.MIN_ACCEPTANCE
    proposals = [drafter.propose(seq, 4) for _ in range(2 * speculation.PROBE_EVERY + 2)]
    assert sum(1 for p in proposals if p) == 2  # a probe every PROBE_EVERY + 1 steps


def test_step_cost_interpolates_the_measured_curve_and_extends_its_last_segment():
    cost = StepCost({1: 1.0, 8: 1.7, 64: 4.5})
    assert cost(1) == 1.0 and cost(8) == pytest.approx(1.7) and cost(4) == pytest.approx(1.3)
    assert cost(120) == pytest.approx(4.5 + 56 * 0.05)  # past the last point: its slope
    default = StepCost()  # affine, a step of DEFAULT_KNEE tokens costs twice a 1-token step
    knee = speculation.DEFAULT_KNEE
    assert default(knee) / default(0) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="2\\+ points"):
        StepCost({1: 1.0})


def test_build_engine_hands_the_measured_curve_to_the_engine(model):
    from laminar.config import EngineConfig
    from laminar.engine import build_engine

    engine = build_engine(EngineConfig(speculation=2), model, NO_EOS, PAD_ID,
                          step_cost_ms={"1": 0.7, "64": 2.1})
    assert engine.step_cost(64) == pytest.approx(2.1) and engine.drafter.max_draft == 2


def test_a_flat_curve_lets_a_full_batch_draft_and_a_cpus_keeps_64_tokens(model):
    cpu = {1: 0.48, 8: 0.64, 16: 0.77, 32: 1.13, 64: 1.80, 128: 3.49, 256: 6.46}  # knee 24
    gpu = {1: 3.0, 8: 3.0, 64: 3.1, 128: 3.2, 256: 3.6}  # never twice a 1-row step: knee 256
    assert Engine(model, NO_EOS, PAD_ID, speculation=4, step_cost_ms=cpu).speculation_tokens == 64
    flat = Engine(model, NO_EOS, PAD_ID, speculation=4, step_cost_ms=gpu)
    assert flat.speculation_tokens == 512
    # on that curve 64 rows with 4 drafts each at p = 0.6 cost little more than 64 rows alone
    assert plan_drafts(64, [(4, 0.6)] * 64, flat.step_cost) == [4] * 64
    assert Engine(model, NO_EOS, PAD_ID, speculation=4).speculation_tokens == 64  # no curve
    assert Engine(model, NO_EOS, PAD_ID, speculation=4, step_cost_ms=gpu,
                  speculation_tokens=100).speculation_tokens == 100


def test_plan_drafts_pays_in_the_tail_not_in_a_full_batch():
    cost = StepCost()  # a + c*t with a / c = 32
    # one row in the tail: its tokens are nearly free, four drafts at p = 0.6 pay
    assert plan_drafts(1, [(4, 0.6)], cost) == [4]
    # a full batch: a draft token at p pays only above n / (32 + n) = 0.67 for n = 64
    assert plan_drafts(64, [(4, 0.6)] * 64, cost) == [0] * 64
    assert sum(plan_drafts(64, [(1, 0.95)] * 64, cost)) == 64
    # rows with better acceptance are served first, each row's tokens in order
    lengths = plan_drafts(16, [(4, 0.9)] * 8 + [(4, 0.3)] * 8, cost)
    assert lengths[:8] == [4] * 8 and sum(lengths[8:]) < 8 * 4
    assert plan_drafts(4, [(4, 0.0), (0, 0.9)], cost) == [0, 0]  # nothing worth drafting
    # a verifying step's own overhead: paid back by four likely drafts, not by one unlikely one
    overhead = speculation.VERIFY_OVERHEAD * cost(1)
    assert plan_drafts(1, [(4, 0.9)], cost, overhead) == [4]
    assert plan_drafts(1, [(1, 0.3)], cost, overhead) == [0]
    assert speculation.may_pay(1, 4, 0.9, cost, overhead)
    assert not speculation.may_pay(64, 256, 0.6, cost, overhead)


# -- lossless ------------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_new_tokens=30),
    SamplingParams(temperature=0.0, max_new_tokens=30, stop_sequences=((102, 41),),
                   stop_token_ids=(127,)),
    SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=30),
], ids=["greedy", "greedy-stops", "seeded-sampling"])
def test_outputs_equal_no_speculation_token_for_token(model, params):
    prompt_list = prompts(6, seed=1)
    plain = two_epochs(Engine(model, NO_EOS, PAD_ID, max_batch_size=8), prompt_list, params)
    engine = Engine(model, NO_EOS, PAD_ID, max_batch_size=8, speculation=4)
    spec = two_epochs(engine, prompt_list, params)
    assert engine.num_accepted_tokens > 0 and engine.num_spec_steps > 0
    for a, b in zip(spec, plain):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        assert len(a.logprobs) == len(a.output_ids) == len(a.token_versions)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    if params.stop_sequences:
        assert {r.finish_reason for r in spec} >= {"stop", "length"}


def test_eos_preemption_and_abort_resume_with_speculation(model):
    """A real EOS id, a KV capacity that preempts, and one sample aborted mid-draft and resumed
    on another speculating engine: still the plain engine's tokens."""
    params = SamplingParams(temperature=1.0, max_new_tokens=40)
    prompt_list = prompts(4, seed=2)
    eos = 7
    plain = two_epochs(Engine(model, eos, PAD_ID, max_batch_size=8), prompt_list, params)
    engine = Engine(model, eos, PAD_ID, max_batch_size=8, kv_capacity_tokens=180, speculation=4)
    first = engine.generate(groups(prompt_list, 4, params, "e0"))
    second = groups(prompt_list, 4, params, "e1")
    for req in second:
        engine.add(req)
    for _ in range(3):
        engine.step()
    running = [seq.request for seq in engine.scheduler.running if seq.request.output_ids]
    [moved] = engine.abort([running[0].request_id])
    other = Engine(copy.deepcopy(model), eos, PAD_ID, speculation=4)
    other.generate([moved])
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_preempted > 0 and engine.num_accepted_tokens > 0
    for a, b in zip(first + second, plain):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason


def teacher_forced(model, req: GenerationRequest) -> list[float]:
    ids = torch.tensor([req.prompt_ids + req.output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(req.prompt_ids) - 1:-1].float()
    logprobs = (logits / req.params.temperature).log_softmax(-1)
    return logprobs.gather(-1, torch.tensor(req.output_ids)[:, None]).squeeze(-1).tolist()


def test_recorded_logprobs_are_the_targets(model):
    params = SamplingParams(temperature=0.8, max_new_tokens=24)
    engine = Engine(model, NO_EOS, PAD_ID, max_batch_size=8, speculation=4)
    spec = two_epochs(engine, prompts(3, seed=3), params)
    assert engine.num_accepted_tokens > 0
    for req in spec:
        assert max(abs(a - b) for a, b in zip(req.logprobs, teacher_forced(model, req))) < 1e-5


# -- the distribution at temperature 1 -----------------------------------------------------------


def chi_square_p(a: list[list[int]], b: list[list[int]]) -> float:
    """Two-sample chi-square homogeneity test of the per-position token counts of `a` and `b`
    (sequences of equal length), positions pooled into one statistic; the p-value."""
    stat, dof = 0.0, 0
    for pos in range(len(a[0])):
        tokens = sorted({s[pos] for s in a} | {s[pos] for s in b})
        counts = torch.tensor([[sum(1 for s in arm if s[pos] == t) for t in tokens]
                               for arm in (a, b)], dtype=torch.float64)
        expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
        stat += float(((counts - expected) ** 2 / expected).sum())
        dof += len(tokens) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def sample_outputs(target, history_model, n: int, speculate: bool, seed0: int) -> list[list[int]]:
    """n samples (top-k 3 at temperature 1: three tokens a position) of one prompt from
    `target`, decoded together. With speculation the engine first saw 64 outputs of
    `history_model` for the same prompt, so the drafts come from another model's distribution
    (the n samples move in lockstep: none is ahead of another to draft from)."""
    prompt = [BOS_ID, 30, 31, 32, 33, 34]
    params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=6)
    engine = Engine(copy.deepcopy(history_model), NO_EOS, PAD_ID, max_batch_size=n,
                    speculation=4 if speculate else 0, speculation_tokens=5 * n)
    engine.speculation_min_drafts = 0.0  # verify whatever is drafted: the rule under test
    engine.generate([GenerationRequest(f"h{i}", prompt, dataclasses.replace(params, seed=10**6 + i))
                     for i in range(64)])
    engine.load_weights(target.state_dict(), version=1)
    reqs = [GenerationRequest(f"s{i}", prompt, dataclasses.replace(params, seed=seed0 + i))
            for i in range(n)]
    engine.generate(reqs)
    if speculate:
        assert engine.num_drafted_tokens > 0
    return [r.output_ids for r in reqs]


def test_temperature_1_distribution_is_the_models_and_the_test_has_power(model, monkeypatch):
    history = build_preset("tiny", seed=11)
    target = build_preset("tiny", seed=12)
    n = 300
    plain = sample_outputs(target, history, n, speculate=False, seed0=0)
    spec = sample_outputs(target, history, n, speculate=True, seed0=50_000)  # independent draws
    assert chi_square_p(plain, spec) > 0.01
    # always accepting copies the other model's tokens: the same test must see it
    monkeypatch.setattr(speculation, "accept", lambda draft, drawn: len(draft))
    broken = sample_outputs(target, history, n, speculate=True, seed0=50_000)
    assert chi_square_p(plain, broken) < 1e-6


# -- metrics -------------------------------------------------------------------------------------


def test_stats_reach_step_rows_as_rates(model):
    """engine.stats() -> the rollout's counters (snapshot) -> a step row's rates since the
    previous row (observe/activity.py)."""
    from laminar.observe.activity import RolloutActivity
    from laminar.types import RolloutCounters, RolloutSnapshot

    engine = Engine(model, NO_EOS, PAD_ID, max_batch_size=8, speculation=4)
    two_epochs(engine, prompts(2, seed=6), SamplingParams(temperature=0.0, max_new_tokens=16))
    s = engine.stats()
    assert (s.num_drafted_tokens, s.num_accepted_tokens, s.num_spec_steps) == (
        engine.num_drafted_tokens, engine.num_accepted_tokens, engine.num_spec_steps)
    assert s.num_prefix_hits == 2 * 2 * 3 and s.num_prefix_lookups == 2 * 2 * 4  # 3 of 4 share

    def snap(c: RolloutCounters) -> RolloutSnapshot:
        return RolloutSnapshot("r0", 0, 0, 0, 0, 0, 0, 100, False, False, c)

    activity = RolloutActivity()
    activity.row_fields({"r0": snap(RolloutCounters())}, {"repacks": 0, "moved_trajectories": 0})
    later = RolloutCounters(spec_drafted_tokens=s.num_drafted_tokens,
                            spec_accepted_tokens=s.num_accepted_tokens, spec_steps=s.num_spec_steps,
                            prefix_lookups=s.num_prefix_lookups, prefix_hits=s.num_prefix_hits)
    row = activity.row_fields({"r0": snap(later)}, {"repacks": 0, "moved_trajectories": 0})
    assert row["spec_acceptance_rate"] == s.num_accepted_tokens / s.num_drafted_tokens
    assert row["spec_accepted_per_step"] == s.num_accepted_tokens / s.num_spec_steps
    assert row["prefix_hit_rate"] == 0.75


def test_multi_turn_episodes_equal_no_speculation(model):
    """Three turns of four episodes: each turn's prompt is the last one's transcript plus a
    tool reply, so the prompt's own n-grams (the earlier turns) feed the drafts."""
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_sequences=((102, 41),))

    def episodes(engine: Engine) -> list[list[int]]:
        contexts = [list(p) for p in prompts(4, seed=7)]
        for turn in range(3):
            reqs = [GenerationRequest(f"t{turn}e{i}", ctx, dataclasses.replace(params, seed=i))
                    for i, ctx in enumerate(contexts)]
            engine.generate(reqs)
            contexts = [r.prompt_ids + r.output_ids + [50, 51, 52] for r in reqs]
        return contexts

    engine = Engine(model, NO_EOS, PAD_ID, max_batch_size=8, speculation=4)
    assert episodes(engine) == episodes(Engine(model, NO_EOS, PAD_ID, max_batch_size=8))
    assert engine.num_drafted_tokens > 0
