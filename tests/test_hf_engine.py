"""The static-batch HF backend: log-probs under the sampling distribution, finish reasons."""

from __future__ import annotations

import torch

from laminar.engine.hf import HFEngine
from laminar.models import EOS_ID, PAD_ID, build_char_tokenizer, build_preset, encode_prompt
from laminar.trainer.loss import token_logprobs
from laminar.types import GenerationRequest, SamplingParams


def _requests(tok, params, n=6):
    return [GenerationRequest(f"r{i}", encode_prompt(tok, "xy" * (i + 1) + "="), params) for i in range(n)]


def _teacher_forced(model, req, temperature=1.0):
    ids = torch.tensor([req.prompt_ids + req.output_ids])
    with torch.no_grad():
        lp = token_logprobs(model(ids).logits[:, :-1], ids[:, 1:], temperature)[0]
    return lp[len(req.prompt_ids) - 1:]


def test_logprobs_match_a_teacher_forced_pass_in_a_padded_batch():
    torch.manual_seed(0)
    model, tok = build_preset("tiny", seed=1), build_char_tokenizer()
    engine = HFEngine(model, EOS_ID, PAD_ID, max_batch_size=4)
    reqs = engine.generate(_requests(tok, SamplingParams(temperature=0.7, max_new_tokens=12)))
    for req in reqs:
        assert len(req.logprobs) == len(req.output_ids) > 0
        assert req.version == 0
        expected = _teacher_forced(model, req, temperature=0.7)
        assert torch.allclose(torch.tensor(req.logprobs), expected, atol=1e-4)


def test_greedy_matches_single_sequence_generate_and_finish_reasons():
    model, tok = build_preset("tiny", seed=2), build_char_tokenizer()
    engine = HFEngine(model, EOS_ID, PAD_ID, max_batch_size=8)
    reqs = engine.generate(_requests(tok, SamplingParams(temperature=0.0, max_new_tokens=7)))
    for req in reqs:
        out = model.generate(torch.tensor([req.prompt_ids]), max_new_tokens=7, do_sample=False,
                             eos_token_id=EOS_ID, pad_token_id=PAD_ID)
        alone = out[0, len(req.prompt_ids):].tolist()
        assert req.output_ids == alone[:len(req.output_ids)]
        assert req.finish_reason == ("eos" if req.output_ids[-1] == EOS_ID else "length")
        assert len(req.output_ids) <= 7


def test_stop_tokens_per_request_budget_and_resume():
    model, tok = build_preset("tiny", seed=2), build_char_tokenizer()
    engine = HFEngine(model, EOS_ID, PAD_ID)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    (full,) = engine.generate([GenerationRequest("a", encode_prompt(tok, "abc="), greedy)])
    stop_at = full.output_ids[2]
    params = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(stop_at,))
    (stopped,) = engine.generate([GenerationRequest("b", encode_prompt(tok, "abc="), params)])
    assert stopped.output_ids == full.output_ids[:full.output_ids.index(stop_at) + 1]
    assert stopped.finish_reason in ("stop", "eos")
    resumed = GenerationRequest("c", full.prompt_ids, greedy, output_ids=full.output_ids[:2],
                                logprobs=full.logprobs[:2], token_versions=[0, 0], version=0)
    engine.generate([resumed])
    assert resumed.output_ids == full.output_ids
    assert torch.allclose(torch.tensor(resumed.logprobs), torch.tensor(full.logprobs), atol=1e-5)


def test_load_weights_changes_outputs_and_stamps_version():
    model, tok = build_preset("tiny", seed=1), build_char_tokenizer()
    engine = HFEngine(model, EOS_ID, PAD_ID)
    other = build_preset("tiny", seed=7)
    engine.load_weights(dict(other.named_parameters()), version=5)
    assert torch.equal(model.model.embed_tokens.weight, other.model.embed_tokens.weight)
    (req,) = engine.generate([GenerationRequest("a", encode_prompt(tok, "ab="),
                                                SamplingParams(temperature=0.0, max_new_tokens=3))])
    assert req.version == 5
