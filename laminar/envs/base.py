"""The environment API: what a multi-turn task implements.

    class Calculator(Env):
        stop = ("</py>",)                       # besides EOS, text that ends a model turn

        async def reset(self, sample: PromptItem) -> str:
            self.answer = sample.answer
            return sample.prompt                # the first observation: what the model sees first

        async def step(self, text: str) -> StepResult:
            if text.endswith("</py>"):          # a tool call: run it, show the output
                out = await run_somewhere(text)
                return StepResult(f"<out>{out}</out>", 0.0, False, {})
            right = text.strip() == self.answer
            return StepResult("", float(right), True, {"exact_match": right})

The framework owns the token loop (laminar/envs/episode.py): it generates a model turn until EOS,
a `stop` string or the token budget, hands the turn's text to `step`, appends the observation's
tokens (the chat template's tool turn when the tokenizer has one, else the text as is) with a
loss mask of 0, and generates again, up to `task.max_turns` turns and `rollout.max_new_tokens`
tokens in all (model and observation tokens together). The reward of the step that says `done`
is the trajectory's reward; `info["exact_match"]` (default: reward >= 1) is what held-out
evaluation counts. Reaching `max_turns` or the budget ends the episode with the reward of the
last step.

Every episode gets a fresh instance, built with `task.env_args` as keyword arguments. The
methods are coroutines and run on the rollout's environment thread (one asyncio loop per
rollout), so many episodes wait on their tools at once while the engine keeps decoding: await
anything slow (`await asyncio.to_thread(...)`, `await sandbox.arun(...)`), never block. A call
that raises fails its trajectory (reason `env_error`); one that outlives `task.env_timeout_s`
fails it with reason `env_timeout`; either is counted and the rollout goes on.

A trajectory mid-episode moves with its environment object when repack or a retiring rollout
hands it to another rollout (the object is pickled), so keep environment state picklable
(plain data; reach processes and sandboxes through module-level pools such as
`laminar.sandbox.shared_sandbox`). One whose environment cannot be pickled stays where it is.

An environment that works in token ids subclasses `TokenEnv`: it renders its own prompt and
observations with the rollout's template and sees each turn's ids, log-probs and finish reason
(`Turn`). The OpenAI-compatible endpoint's agent episodes are one (laminar/envs/openai_agent.py):
an agent's chat messages become tokens there, and the endpoint's answers carry token counts.

The one-turn case is a reward: `RewardEnv` shows the equivalence (the built-in `reverse` and
`dataset` tasks, and any `task.reward`, are this environment; the rollout runs them through its
reward workers, laminar/tasks/reward_pool.py, which add process isolation, timeouts and
retries).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from laminar.config import ConfigError
from laminar.plugins import import_target
from laminar.types import PromptItem

if TYPE_CHECKING:  # template.py loads the tokenizer (transformers, torch)
    from laminar.envs.template import TurnTemplate


class StepResult(NamedTuple):
    observation: str  # shown to the model next (ignored when done)
    reward: float  # in [0, 1]; the trajectory's reward when done
    done: bool
    info: dict[str, Any] = {}  # "exact_match": bool is read by evaluation


class Env:
    stop: ClassVar[tuple[str, ...]] = ()  # strings that end a model turn besides EOS

    async def reset(self, sample: PromptItem) -> str:
        """Start an episode for one prompt; returns the first observation (the prompt text)."""
        return sample.prompt

    async def step(self, text: str) -> StepResult:
        """The model's turn (its text, decoded from exactly the tokens generated)."""
        raise NotImplementedError

    async def close(self) -> None:
        """Release what the episode holds; called once when the episode ends (or fails)."""


class Turn(NamedTuple):
    """A model turn as a `TokenEnv` sees it."""

    text: str  # decoded from exactly token_ids (special tokens skipped)
    token_ids: list[int]
    logprobs: list[float]  # one per token, under the distribution it was sampled from
    finish_reason: str  # "eos", "stop" (a stop string or stop token), "length" (the budget)
    last: bool  # the episode ends after this step whatever it returns (max_turns or the budget)
    room: int  # budget tokens left: an observation fits when it is shorter than this


class TokenEnv(Env):
    """An environment that reads and writes token ids. `reset_ids` returns the prompt ids and
    `step_ids` a StepResult whose observation is ids (appended as they are, loss mask 0); an
    observation that does not fit `turn.room` ends the episode as it does for `Env`.
    `turn_stops`, when set by the call, are the next turn's stop sequences (token ids) instead
    of the task's."""

    turn_stops: tuple[tuple[int, ...], ...] | None = None

    async def reset_ids(self, sample: PromptItem, template: TurnTemplate) -> list[int]:
        raise NotImplementedError

    async def step_ids(self, turn: Turn) -> StepResult:
        raise NotImplementedError


def exact_match(response: str, answer: str) -> bool:
    """The held-out score of a final answer (`info["exact_match"]` of a last step)."""
    return response.strip() == answer.strip()


class RewardEnv(Env):
    """A reward as a one-turn environment: the prompt, one model turn, its score."""

    def __init__(self, reward_fn: Any) -> None:
        self.reward_fn = reward_fn
        self.sample: PromptItem | None = None

    async def reset(self, sample: PromptItem) -> str:
        self.sample = sample
        return sample.prompt

    async def step(self, text: str) -> StepResult:
        s = self.sample
        reward = float(self.reward_fn(s.prompt, text, s.answer))
        return StepResult("", reward, True, {"exact_match": exact_match(text, s.answer)})


def resolve_env(path: str) -> type[Env]:
    """`package.module:Class` or `my_envs.py:Class` -> the class, checked against the API."""
    cls = import_target(path, "task.env", "Class")
    if not isinstance(cls, type):
        raise ConfigError(f"task.env='{path}' is not a class (got {type(cls).__name__}); name a "
                          "subclass of laminar.envs.Env")
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise ConfigError(f"task.env='{path}': class {cls.__name__} has no {', '.join(missing)}; "
                          "an environment implements async reset(sample) and step(text)")
    for name in ("reset", "step"):
        if not inspect.iscoroutinefunction(getattr(cls, name)):
            raise ConfigError(f"task.env='{path}': {cls.__name__}.{name} must be `async def` "
                              "(environment calls run on an asyncio loop)")
    stop = getattr(cls, "stop", ())
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise ConfigError(f"task.env='{path}': {cls.__name__}.stop={stop!r} must be a tuple of "
                          "non-empty strings")
    return cls


def make_env(cls: type[Env], args: dict[str, Any]) -> Env:
    try:
        return cls(**args)
    except TypeError as e:
        raise ConfigError(f"task.env_args={args!r} do not fit {cls.__name__}: {e}") from None
