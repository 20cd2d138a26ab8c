"""Reward functions and the plugin contract.

A reward function has the signature

    def reward(prompt: str, response: str, answer: str) -> float

and returns a finite number in [0, 1]. Give your own as a dotted path `package.module:function`
in `task.reward`. `call_reward()` wraps any reward so that one raising or returning garbage
fails that one call with a reason in `FAILURES` (reward 0) instead of stopping training;
laminar/tasks/reward_pool.py adds the timeout and the retries, and runs it in worker processes.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

from laminar.config import ConfigError
from laminar.envs.base import exact_match
from laminar.plugins import import_target

RewardFn = Callable[[str, str, str], float]


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence, O(len(a) * len(b)) time, O(len(b)) memory."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def similarity(response: str, answer: str) -> float:
    """LCS ratio 2*LCS/(|response|+|answer|) in [0, 1]; 1.0 exactly when they are equal."""
    if not response and not answer:
        return 1.0
    return 2.0 * lcs_length(response, answer) / (len(response) + len(answer))


def similarity_reward(prompt: str, response: str, answer: str) -> float:
    """The built-in reward: how close the response is to the reference answer."""
    return similarity(response.strip(), answer.strip())


def exact_match_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 for exactly the answer, else 0.0: rewards only what the held-out exact match scores
    (`task.reward: laminar.tasks.rewards:exact_match_reward`; `laminar bench modes` uses it)."""
    return float(exact_match(response, answer))


def resolve_reward(path: str | None) -> RewardFn:
    """`package.module:function` -> the function, checked against the contract."""
    if path is None:
        return similarity_reward
    module_name, _, attr = path.rpartition(":")
    fn = import_target(path, "task.reward")
    if not callable(fn):
        raise ConfigError(f"task.reward='{path}': '{attr}' in module '{module_name}' is not a function")
    try:
        inspect.signature(fn).bind("prompt", "response", "answer")
    except TypeError:
        raise ConfigError(f"task.reward='{path}' must accept (prompt: str, response: str, "
                          f"answer: str); its signature is {inspect.signature(fn)}") from None
    return fn


# Why a reward call failed: it raised (or returned something that is not a number, or its
# worker process died); it did not answer within task.reward_timeout_s; it returned NaN or inf;
# it returned a number outside [0, 1].
FAILURES = ("error", "timeout", "nan", "out_of_range")


def check_reward(value: float) -> tuple[float, str | None, str | None]:
    """(reward, failure reason, error) of a value a reward function returned: the value itself
    and two Nones when it keeps the contract, else 0 with a reason from `FAILURES`."""
    if not math.isfinite(value):
        return 0.0, "nan", f"reward is not finite: {value}"
    if not 0.0 <= value <= 1.0:
        return 0.0, "out_of_range", f"reward {value} is outside [0, 1]"
    return value, None, None


def call_reward(fn: RewardFn, prompt: str, response: str,
                answer: str) -> tuple[float, str | None, str | None]:
    """One call of `fn`: (reward, failure reason, error), as `check_reward` says."""
    try:
        value = float(fn(prompt, response, answer))
    except Exception as e:  # a user plugin may raise anything; one trajectory must not stop training
        return 0.0, "error", f"{type(e).__name__}: {e}"
    return check_reward(value)


def score(fn: RewardFn, prompt: str, response: str, answer: str) -> tuple[float, str | None]:
    """(reward, error). A reward that raises, is not a finite number or is outside [0, 1]
    scores 0 with an error."""
    value, _, error = call_reward(fn, prompt, response, answer)
    return value, error
