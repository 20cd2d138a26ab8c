"""Rollout inference engines: the native continuous-batching `Engine` and the static-batch
`HFEngine` baseline on `transformers.generate`. Same `generate(requests)` call for both."""

from laminar.engine.engine import Engine
from laminar.engine.hf import HFEngine

__all__ = ["Engine", "HFEngine"]
