"""Held-out evaluation: greedy responses to the task's eval prompts, scored by the task (for a
multi-turn task, greedy episodes scored by their environment; needs the native engine)."""

from __future__ import annotations

from typing import Protocol

from laminar.envs.episode import Episodes, run_episodes
from laminar.models.tokenizer import decode_response, encode_prompt
from laminar.tasks import Task
from laminar.types import GenerationRequest, PromptGroup, SamplingParams


class Generator(Protocol):
    def generate(self, requests: list[GenerationRequest]) -> list[GenerationRequest]: ...


def evaluate(engine: Generator, tokenizer, task: Task, max_new_tokens: int, max_turns: int = 4,
             timeout_s: float = 30.0) -> dict[str, float]:
    """Mean reward and exact-match rate of greedy decoding on `task.eval`."""
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    if task.multi_turn:
        episodes = Episodes(task, tokenizer, max_turns, timeout_s)
        ended = run_episodes(engine, episodes, [
            (GenerationRequest(f"eval-{i}", [], params), PromptGroup(f"eval-{i}", item, [], 1))
            for i, item in enumerate(task.eval)])
        return {"eval_reward": sum(e.reward for e in ended) / len(ended),
                "eval_exact_match": sum(e.exact_match for e in ended) / len(ended),
                "eval_turns": sum(e.turns for e in ended) / len(ended)}
    requests = [GenerationRequest(f"eval-{i}", encode_prompt(tokenizer, item.prompt), params)
                for i, item in enumerate(task.eval)]
    engine.generate(requests)
    scores = [task.score(item, decode_response(tokenizer, req.output_ids))
              for item, req in zip(task.eval, requests)]
    return {"eval_reward": sum(s.reward for s in scores) / len(scores),
            "eval_exact_match": sum(s.exact_match for s in scores) / len(scores)}
