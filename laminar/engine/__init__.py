"""Rollout inference engines: the native continuous-batching `Engine`, `VLLMEngine` (vLLM's
engine behind the same protocol) and the static-batch `HFEngine` baseline on
`transformers.generate`. Same `generate(requests)` call for all; `build_engine` picks one as
`rollout.engine` says.

The engines (torch) are imported when first used, not with the package, so that importing
`laminar.engine.knee` for its cache reader (the rollout manager calls it) costs no torch."""

from __future__ import annotations

from typing import Any

from laminar.config import EngineConfig
from laminar.engine.protocol import RolloutEngine


def build_engine(cfg: EngineConfig, model, eos_token_id: int, pad_token_id: int, version: int = 0,
                 seed: int = 0, step_cost_ms: dict[int, float] | None = None) -> RolloutEngine:
    """`step_cost_ms`: the native engine's decode curve {tokens: ms} (knee.py's `curve_ms`),
    on which speculation decides when to draft; None: an affine default (speculation.py)."""
    if cfg.backend == "vllm":
        return _engine_class("VLLMEngine")(
            model, eos_token_id, pad_token_id, max_batch_size=cfg.max_batch_size,
            kv_capacity_tokens=cfg.kv_capacity_tokens, version=version, seed=seed,
            block_size=cfg.vllm_block_size, enforce_eager=cfg.vllm_enforce_eager,
            speculation=cfg.speculation)
    if cfg.backend == "hf":
        return _engine_class("HFEngine")(model, eos_token_id, pad_token_id,
                                         max_batch_size=cfg.max_batch_size, version=version)
    return _engine_class("Engine")(model, eos_token_id, pad_token_id,
                                   max_batch_size=cfg.max_batch_size,
                                   kv_capacity_tokens=cfg.kv_capacity_tokens, version=version,
                                   seed=seed, speculation=cfg.speculation,
                                   step_cost_ms=step_cost_ms)


def _engine_class(name: str) -> Any:
    """An engine class, imported now: the package's `__getattr__` too, so that
    `from laminar.engine import Engine` imports the engine only then."""
    if name == "Engine":
        from laminar.engine.engine import Engine  # torch

        return Engine
    if name == "HFEngine":
        from laminar.engine.hf import HFEngine  # torch, transformers

        return HFEngine
    if name == "VLLMEngine":
        from laminar.engine.vllm_engine import VLLMEngine  # vllm (a ConfigError when missing)

        return VLLMEngine
    raise AttributeError(f"module 'laminar.engine' has no attribute {name!r}")


__getattr__ = _engine_class


__all__ = ["Engine", "HFEngine", "VLLMEngine", "build_engine"]
