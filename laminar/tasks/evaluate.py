"""Held-out evaluation: the one way a held-out prompt becomes a request and a response a score.

- `eval_request`: a held-out prompt's request (BOS + prompt).
- `score_responses`: each finished one-turn response's (reward, exact match), by the task's
  reward inline or through a rollout's reward runner (laminar/tasks/reward_pool.py).
- `mean_outcomes`: their mean reward and exact-match rate.
- `evaluate`: greedy responses to `task.eval`, all at once, scored (a multi-turn task: greedy
  episodes scored by their environment; needs the native engine). The warm start
  (laminar/trainer/sft.py) and the TRL baseline call it; a rollout's `Evaluator`
  (laminar/rollout/evals.py) builds the same requests and scores them the same way, one engine
  step at a time.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from laminar.envs.episode import Episodes, run_episodes
from laminar.models.tokenizer import decode_response, encode_prompt
from laminar.tasks import Task
from laminar.tasks.rewards import exact_match
from laminar.types import GenerationRequest, PromptGroup, PromptItem, SamplingParams

Outcome = tuple[float, bool]  # (reward, exact match) of one held-out response or episode


class Generator(Protocol):
    def generate(self, requests: list[GenerationRequest]) -> list[GenerationRequest]: ...


def eval_request(tokenizer: Any, item: PromptItem, params: SamplingParams,
                 request_id: str) -> GenerationRequest:
    """The request of one held-out prompt (an episode replaces its prompt by its template's)."""
    return GenerationRequest(request_id, encode_prompt(tokenizer, item.prompt), params)


def score_responses(task: Task, tokenizer: Any, answered: list[tuple[PromptItem, GenerationRequest]],
                    rewards: Any = None) -> list[Outcome]:
    """(reward, exact match) of each finished one-turn response. `rewards`: a rollout's reward
    runner (a user's reward in killable processes, with its timeout and retries; a call that
    failed for good scores 0); None: the task's reward, inline."""
    texts = [(item, decode_response(tokenizer, req.output_ids)) for item, req in answered]
    if rewards is None:
        return [(s.reward, s.exact_match) for s in (task.score(item, text) for item, text in texts)]
    calls = [rewards.submit(item.prompt, text, item.answer) for item, text in texts]
    while not all(c.done for c in calls):
        time.sleep(0.001)
    return [(0.0 if call.failed else call.reward, exact_match(text, item.answer))
            for (item, text), call in zip(texts, calls)]


def mean_outcomes(outcomes: list[Outcome]) -> tuple[float, float]:
    """(mean reward, exact-match rate); (0, 0) for none."""
    n = max(1, len(outcomes))
    return sum(r for r, _ in outcomes) / n, sum(e for _, e in outcomes) / n


def evaluate(engine: Generator, tokenizer: Any, task: Task, max_new_tokens: int,
             max_turns: int = 4, timeout_s: float = 30.0) -> dict[str, float]:
    """Mean reward and exact-match rate of greedy decoding on `task.eval`."""
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    requests = [eval_request(tokenizer, item, params, f"eval-{i}") for i, item in enumerate(task.eval)]
    if task.multi_turn:
        episodes = Episodes(task, tokenizer, max_turns, timeout_s)
        ended = run_episodes(engine, episodes, [(req, PromptGroup(req.request_id, item, [], 1))
                                                for req, item in zip(requests, task.eval)])
        reward, exact = mean_outcomes([(e.reward, e.exact_match) for e in ended])
        return {"eval_reward": reward, "eval_exact_match": exact,
                "eval_turns": sum(e.turns for e in ended) / len(ended)}
    engine.generate(requests)
    reward, exact = mean_outcomes(score_responses(task, tokenizer, list(zip(task.eval, requests))))
    return {"eval_reward": reward, "eval_exact_match": exact}
