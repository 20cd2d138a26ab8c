"""Models and tokenizer: presets, Hugging Face save/load round trips."""

from __future__ import annotations

import string

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from laminar.config import ConfigError, ModelConfig
from laminar.models import (BOS_ID, EOS_ID, PAD_ID, build_char_tokenizer, build_preset,
                            encode_prompt, load_policy, load_pretrained, num_parameters,
                            save_pretrained)


def test_presets_have_the_documented_sizes():
    assert 0.4e6 < num_parameters(build_preset("tiny")) < 0.6e6
    assert 3.5e6 < num_parameters(build_preset("small")) < 4.5e6
    with pytest.raises(ConfigError, match="model.preset='huge'"):
        build_preset("huge")


def test_tokenizer_round_trip_is_exact(tmp_path):
    tok = build_char_tokenizer()
    text = string.printable + "  double  spaces\nand\ttabs"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert encode_prompt(tok, "ab=")[0] == BOS_ID
    tok.save_pretrained(tmp_path)
    again = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert again.encode(text, add_special_tokens=False) == ids
    assert again.decode(ids) == text
    assert tok.decode([BOS_ID, *ids, EOS_ID], skip_special_tokens=True) == text


def test_save_then_from_pretrained_gives_identical_logits(tmp_path):
    model, tok = load_policy(ModelConfig(preset="tiny", seed=3))
    save_pretrained(model, tok, tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)  # plain transformers, no laminar code
    ours, tok2 = load_pretrained(tmp_path)
    x = torch.tensor([encode_prompt(tok, "hello world=")])
    with torch.no_grad():
        ref = model(x).logits
        assert torch.equal(ref, plain(x).logits)
        assert torch.equal(ref, ours(x).logits)
    assert tok2.decode(tok2.encode("abc", add_special_tokens=False)) == "abc"


def test_load_pretrained_rejects_a_non_model_directory(tmp_path):
    with pytest.raises(ConfigError, match="not a Hugging Face model directory"):
        load_pretrained(tmp_path)
