"""Tasks: a prompt source plus a reward, or plus an environment.

`build_task(cfg, sandbox)` returns a `Task` with training prompts, held-out evaluation prompts
and either a scoring function (one turn: `reverse`, `dataset`) or an environment factory (many
turns, laminar/envs: the built-in agentic `calc` (its environment in tasks/calc.py), any `task.env` with the task's prompts, or
a `task.agent` written against the OpenAI client).
Your own data: `dataset` (JSONL/Parquet) with any reward given as a dotted path or a file (see
`laminar.tasks.rewards`). From the field (the `tasks` extra): `reasoning_gym` (its generators,
scored by their own `score_answer`) and `humaneval` (completions run against the problems' tests
in the sandbox), both one-turn environments (docs/tasks.md says why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from laminar.config import SandboxConfig, TaskConfig
from laminar.envs.base import make_env, resolve_env
from laminar.tasks import calc, humaneval, reasoning_gym, reverse
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
    make_env: Callable[[], Any] | None = None  # a fresh laminar.envs.Env per episode; None: one
    # turn scored by reward_fn
    stop: tuple[str, ...] = ()  # the environment's stop strings (ends of a model turn)
    demonstrate: Callable[[PromptItem], list[tuple[str, bool]]] | None = None  # an SFT
    # demonstration of one prompt as text segments after the prompt (trained?) for multi-turn
    # tasks; None: the answer

    @property
    def multi_turn(self) -> bool:
        return self.make_env is not None

    def score(self, item: PromptItem, response: str) -> Scored:
        value, error = score(self.reward_fn, item.prompt, response, item.answer)
        return Scored(value, exact_match(response, item.answer), error)


def build_task(cfg: TaskConfig, sandbox: SandboxConfig | None = None,
               prompts: bool = True) -> Task:
    """The task of `cfg`; `prompts=False` skips generating or loading its prompts (a rollout
    gets its prompts from the prompt pool and needs only the reward and the environment)."""
    reward_fn = resolve_reward(cfg.reward)
    train: list[PromptItem] = []
    held_out: list[PromptItem] = []
    report = None
    if cfg.name == "reverse" and prompts:
        train = reverse.make_prompts(cfg.reverse, cfg.reverse.num_prompts, seed=cfg.seed)
        held_out = reverse.make_prompts(cfg.reverse, cfg.eval_prompts, seed=cfg.seed + 10_007)
    elif cfg.name == "calc" and prompts:
        train = calc.make_questions(cfg.calc, cfg.calc.num_prompts, seed=cfg.seed)
        held_out = calc.make_questions(cfg.calc, cfg.eval_prompts, seed=cfg.seed + 10_007)
    elif cfg.name == "dataset" and prompts:
        train, report = load_dataset(cfg.dataset)
        rng = np.random.default_rng(cfg.seed)
        picks = rng.choice(len(train), size=min(cfg.eval_prompts, len(train)), replace=False)
        held_out = [train[i] for i in sorted(picks)]
    elif cfg.name == "reasoning_gym" and prompts:
        train, held_out = reasoning_gym.make_prompts(cfg.reasoning_gym, cfg.eval_prompts)
    elif cfg.name == "humaneval" and prompts:
        train, held_out = humaneval.make_prompts(cfg.humaneval, cfg.eval_prompts, seed=cfg.seed)
    task = Task(cfg.name, train, held_out, reward_fn, report)
    if cfg.agent is not None:  # an OpenAI-client agent on the task's prompts
        from laminar.envs.openai_agent import AgentEnv, resolve_agent  # transformers (the tokenizer)

        agent = resolve_agent(cfg.agent)
        task.make_env, task.stop = (lambda: AgentEnv(agent, cfg.agent)), ()
    elif cfg.env is not None:  # the user's environment on the task's prompts
        cls, args = resolve_env(cfg.env), dict(cfg.env_args)
        make_env(cls, args)  # a bad env_args fails here, where the config is read
        task.make_env, task.stop = (lambda: make_env(cls, args)), tuple(cls.stop)
    elif cfg.name == "calc":
        box = sandbox or SandboxConfig()
        task.make_env, task.stop = (lambda: calc.CalcEnv(box)), tuple(calc.CalcEnv.stop)
        task.demonstrate = calc.demonstration
    elif cfg.name == "reasoning_gym":
        reasoning_gym.load()  # the missing extra is named here, also where prompts are not made
        rg = cfg.reasoning_gym
        task.make_env = lambda: reasoning_gym.ReasoningGymEnv(rg)
        task.demonstrate = reasoning_gym.demonstration
    elif cfg.name == "humaneval":
        humaneval.load()
        he, box = cfg.humaneval, sandbox or SandboxConfig()
        task.make_env = lambda: humaneval.HumanEvalEnv(he, box)
        task.stop = humaneval.stop_strings(he)
        task.demonstrate = humaneval.demonstration
    return task


__all__ = ["Task", "Scored", "build_task", "LoadReport"]
