"""The trainer as a Ray actor: `TrainerService` with the pool actors and the relay pusher.

The runtime starts it with `max_restarts`: a trainer process that dies is started again by Ray
with the same arguments, finds the pools by name (a restarted actor must not hold other
actors' handles in its constructor arguments), and recovers from the run's newest checkpoint.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch

from laminar.config import Config
from laminar.relay.client import Pusher
from laminar.relay.plan import ChainPlan
from laminar.relay.version import VersionHeader
from laminar.trainer.service import TrainerService
from laminar.types import Trajectory


class RayTrainerData:
    def __init__(self, pool_names: dict[str, str], timeout_s: float) -> None:
        self.prompts = ray.get_actor(pool_names["prompts"])
        self.buffer = ray.get_actor(pool_names["buffer"])
        self.timeout_s = timeout_s

    def sample(self, num_groups: int, trainer_version: int) -> list[list[Trajectory]] | None:
        return ray.get(self.buffer.sample.remote(num_groups, trainer_version), timeout=self.timeout_s)

    def consumed(self, num_groups: int) -> None:
        self.prompts.mark_consumed.remote(num_groups)

    def ack(self, version: int) -> None:
        self.buffer.ack.remote(version)

    def rewind(self, version: int | None) -> int:
        return ray.get(self.buffer.rewind.remote(version), timeout=self.timeout_s)

    def counts(self) -> dict[str, int]:
        return ray.get(self.buffer.counts.remote(), timeout=self.timeout_s)

    def prompt_state(self) -> dict[str, Any]:
        return ray.get(self.prompts.state_dict.remote(), timeout=self.timeout_s)

    def load_prompt_state(self, state: dict[str, Any]) -> None:
        ray.get(self.prompts.load_state_dict.remote(state), timeout=self.timeout_s)


class RelayPush:
    def __init__(self, pusher: Pusher) -> None:
        self.pusher = pusher

    def push(self, named: dict[str, torch.Tensor], version: int) -> float:
        return self.pusher.push(named, version).seconds

    def push_parts(self, header: VersionHeader, fill: Callable[[memoryview, Path], None]) -> float:
        return self.pusher.push_parts(header, fill).seconds


class TrainerActor(TrainerService):
    def __init__(self, cfg: Config, model_dir: str, plan: dict[str, Any], secret: bytes,
                 pool_names: dict[str, str]) -> None:
        self.pusher = Pusher(ChainPlan.from_dict(plan), secret, cfg.relay)
        with warnings.catch_warnings():  # Ray's own property trips its deprecation warning
            warnings.simplefilter("ignore")
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        super().__init__(cfg, model_dir, RayTrainerData(pool_names, cfg.cluster.wait_timeout_s),
                         RelayPush(self.pusher), restarted)

    def pid(self) -> int:
        return os.getpid()

    def set_plan(self, plan: dict[str, Any]) -> None:
        """The relay chain changed (the manager repaired it)."""
        self.pusher.set_plan(ChainPlan.from_dict(plan))
