"""Versions in the serving dtype: trainer.publish_dtype casts the fp32 master weights, `auto`
follows rollout.engine.dtype, and a bf16 native engine takes such a version and generates."""

from __future__ import annotations

import pytest
import torch

from laminar.config import ConfigError, TrainerConfig, load_config
from laminar.engine import Engine
from laminar.models import EOS_ID, PAD_ID, build_preset
from laminar.trainer.trainer import Trainer

from harness import GREEDY, make_prompts, requests


def test_auto_publishes_in_the_engines_dtype_and_nonsense_names_the_key():
    assert load_config(None, []).trainer.publish_dtype == "fp32"
    assert load_config(None, ["rollout.engine.dtype=bf16"]).trainer.publish_dtype == "bf16"
    assert load_config(None, ["rollout.engine.dtype=bf16",
                              "trainer.publish_dtype=fp32"]).trainer.publish_dtype == "fp32"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.publish_dtype=half"])
    assert "'trainer.publish_dtype' = 'half'" in str(e.value) and "'bf16'" in str(e.value)
    with pytest.raises(ConfigError, match="rollout.engine.dtype"):
        load_config(None, ["rollout.engine.dtype=int8"])


def test_bf16_versions_are_the_cast_of_fp32_masters_and_a_bf16_engine_serves_them():
    trainer = Trainer(build_preset("tiny", seed=0), TrainerConfig(publish_dtype="bf16"), PAD_ID)
    named = trainer.named_weights()
    for name, p in trainer.module.named_parameters():
        assert p.dtype == torch.float32  # the masters stay fp32
        assert named[name].dtype == torch.bfloat16
        assert torch.equal(named[name], p.detach().to(torch.bfloat16))
    engine = Engine(build_preset("tiny", seed=1).to(torch.bfloat16).eval(), EOS_ID, PAD_ID)
    engine.load_weights(named, 1)
    out = engine.generate(requests(make_prompts(3)))
    assert all(r.output_ids for r in out) and engine.version == 1
    state = engine.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in named.items())  # bit-for-bit what was published
