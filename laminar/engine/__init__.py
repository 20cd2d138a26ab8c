"""Rollout inference engines: the native continuous-batching `Engine` and the static-batch
`HFEngine` baseline on `transformers.generate`. Same `generate(requests)` call for both;
`build_engine` picks one as `rollout.engine` says."""

from laminar.config import EngineConfig
from laminar.engine.engine import Engine
from laminar.engine.hf import HFEngine


def build_engine(cfg: EngineConfig, model, eos_token_id: int, pad_token_id: int, version: int = 0,
                 seed: int = 0) -> Engine | HFEngine:
    if cfg.backend == "hf":
        return HFEngine(model, eos_token_id, pad_token_id, max_batch_size=cfg.max_batch_size,
                        version=version)
    return Engine(model, eos_token_id, pad_token_id, max_batch_size=cfg.max_batch_size,
                  kv_capacity_tokens=cfg.kv_capacity_tokens, version=version, seed=seed)


__all__ = ["Engine", "HFEngine", "build_engine"]
