"""The vectorised sampler: its filtering equals transformers' warpers, its draws follow the
distribution, and a row's draw depends only on (seed, token index)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from laminar.engine.sampler import SamplingRows, gumbel_noise, process_logits, sample
from laminar.types import SamplingParams

SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=5),
            SamplingParams(temperature=1.5, top_p=0.7), SamplingParams(temperature=0.8, top_k=10,
                                                                       top_p=0.5),
            SamplingParams(temperature=0.0, top_k=3), SamplingParams(temperature=1.0, top_k=500)]


def rows_for(params, seeds=None, counters=None):
    n = len(params)
    return SamplingRows.build(params, seeds or [7] * n, counters or [0] * n)


def hf_processed(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    if p.is_greedy:
        return logits
    out = TemperatureLogitsWarper(p.temperature)(None, logits[None])
    if p.top_k > 0:
        out = TopKLogitsWarper(min(p.top_k, logits.shape[-1]))(None, out)
    if p.top_p < 1.0:
        out = TopPLogitsWarper(p.top_p)(None, out)
    return out[0]


def test_filtering_matches_transformers_warpers():
    torch.manual_seed(0)
    logits = torch.randn(len(SETTINGS), 64) * 3
    ours = process_logits(logits, rows_for(SETTINGS))
    for row, p in enumerate(SETTINGS):
        expected = hf_processed(logits[row], p)
        assert torch.equal(torch.isinf(ours[row]), torch.isinf(expected)), p
        kept = ~torch.isinf(expected)
        assert torch.allclose(ours[row][kept], expected[kept]), p


def test_greedy_rows_take_the_argmax_with_the_model_logprob():
    torch.manual_seed(1)
    logits = torch.randn(3, 64)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0),
              SamplingParams(temperature=0.0, top_p=0.1)]
    tokens, logprobs = sample(logits, rows_for(params))
    for row in (0, 2):
        assert tokens[row] == logits[row].argmax()
        assert logprobs[row] == pytest.approx(logits[row].log_softmax(-1).max().item(), abs=1e-6)


def test_draws_follow_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.2, 1.5]]).repeat(20_000, 1)
    rows = SamplingRows.build([SamplingParams(temperature=1.0)] * 20_000, [123] * 20_000,
                              list(range(20_000)))
    tokens, logprobs = sample(logits, rows)
    freq = torch.bincount(tokens, minlength=8).float() / 20_000
    probs = logits[0].softmax(-1)
    assert (freq - probs).abs().sum() / 2 < 0.015  # total variation distance
    assert torch.allclose(logprobs, probs.log()[tokens])


def test_draws_stay_inside_top_k_and_top_p():
    torch.manual_seed(2)
    logits = torch.randn(1, 64).repeat(2000, 1)
    params = [SamplingParams(temperature=1.0, top_k=4)] * 1000 + \
             [SamplingParams(temperature=1.0, top_p=0.3)] * 1000
    tokens, logprobs = sample(logits, SamplingRows.build(params, [5] * 2000, list(range(2000))))
    top4 = set(logits[0].topk(4).indices.tolist())
    assert set(tokens[:1000].tolist()) <= top4 and len(set(tokens[:1000].tolist())) == 4
    allowed = ~torch.isinf(hf_processed(logits[0], params[-1]))
    assert allowed[tokens[1000:]].all() and torch.isfinite(logprobs).all()


def test_a_rows_draw_depends_only_on_seed_and_counter():
    seeds = torch.tensor([1, 2, 1, 1 << 40])
    counters = torch.tensor([5, 5, 6, 5])
    noise = gumbel_noise(seeds, counters, 32)
    alone = gumbel_noise(seeds[:1], counters[:1], 32)
    assert torch.equal(noise[0], alone[0])  # batch composition does not matter
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert not torch.equal(noise[0], noise[3])  # high seed bits count too
    assert torch.isfinite(noise).all()
