"""Tasks: a prompt source plus a reward.

`build_task(cfg)` returns a `Task` with training prompts, held-out evaluation prompts and a
scoring function. Built in: `reverse`. Your own data: `dataset` (JSONL/Parquet) with any reward
given as a dotted path (see `laminar.tasks.rewards`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from laminar.config import TaskConfig
from laminar.tasks import reverse
from laminar.tasks.dataset import LoadReport, load_dataset
from laminar.tasks.rewards import RewardFn, exact_match, resolve_reward, score
from laminar.types import PromptItem


@dataclass
class Scored:
    reward: float
    exact_match: bool
    error: str | None  # set when the reward function failed on this response


@dataclass
class Task:
    name: str
    train: list[PromptItem]
    eval: list[PromptItem]
    reward_fn: RewardFn
    load_report: LoadReport | None = None

    def score(self, item: PromptItem, response: str) -> Scored:
        value, error = score(self.reward_fn, item.prompt, response, item.answer)
        return Scored(value, exact_match(response, item.answer), error)


def build_task(cfg: TaskConfig) -> Task:
    reward_fn = resolve_reward(cfg.reward)
    if cfg.name == "reverse":
        train = reverse.make_prompts(cfg.reverse, cfg.reverse.num_prompts, seed=cfg.seed)
        held_out = reverse.make_prompts(cfg.reverse, cfg.eval_prompts, seed=cfg.seed + 10_007)
        return Task("reverse", train, held_out, reward_fn)
    items, report = load_dataset(cfg.dataset)
    rng = np.random.default_rng(cfg.seed)
    picks = rng.choice(len(items), size=min(cfg.eval_prompts, len(items)), replace=False)
    return Task("dataset", items, [items[i] for i in sorted(picks)], reward_fn, report)


__all__ = ["Task", "Scored", "build_task", "LoadReport"]
