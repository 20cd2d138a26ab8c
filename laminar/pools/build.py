"""The three pools of a job, assembled the same way by both runtimes and by tests.

    specs = pool_specs(cfg, task.train, encode, policy.max_outstanding, db)
    prompts = specs["prompts"].build()                      # in this process (local runtime)
    ray.remote(spec.cls).options(...).remote(*spec.args, **spec.kwargs)   # one actor each (Ray)

`db`: RUN_DIR/pools.db (laminar/pools/resume.py `prepare_pools`), or None for pools in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from laminar.config import Config
from laminar.pools.experience import ExperienceBuffer
from laminar.pools.partials import PartialPool
from laminar.pools.prompts import PromptPool, PromptSampler
from laminar.types import PromptItem

POOLS = ("prompts", "partials", "buffer")


@dataclass(frozen=True)
class PoolSpec:
    """A pool's class and its constructor's arguments (a Ray actor is made from them as is)."""

    cls: type
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self) -> Any:
        return self.cls(*self.args, **self.kwargs)


def pool_specs(cfg: Config, train: list[PromptItem], encode: Callable[[str], list[int]],
               max_outstanding: int | None, db: str | None) -> dict[str, PoolSpec]:
    """The prompt pool over the task's training prompts (`encode`: a prompt's token ids; a
    lease lasts twice `cluster.wait_timeout_s`), the partial pool and the experience buffer,
    all restored from `db` when the job resumes."""
    sampler = PromptSampler(train, encode, cfg.rollout.group_size, seed=cfg.task.seed)
    return {
        "prompts": PoolSpec(PromptPool, (sampler, 2 * cfg.cluster.wait_timeout_s, max_outstanding,
                                         db, cfg.resume)),
        "partials": PoolSpec(PartialPool, (db, cfg.resume)),
        "buffer": PoolSpec(ExperienceBuffer, (cfg.rollout.group_size,),
                           {"store": db, "restore": cfg.resume}),
    }
