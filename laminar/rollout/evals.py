"""Held-out evaluation inside a rollout, without stalling anyone.

    evaluator = Evaluator(make_engine, tokenizer, task)   # make_engine: laminar/rollout/build.py
    evaluator.queue(EvalJob("step10", step=10, at_least=10, items=task.eval, params=params))
    evaluator.step(weights)        # from the rollout loop's step: one engine step of the eval
    evaluator.take()               # finished results: [{"step": 10, "version": 11, ...}]

The evaluator has an engine of its own (of the run's backend), built on first use by the
rollout's engine factory on the run's starting weights (`prepare`, which the rollout loop calls
outside its lock), so the version it evaluates never changes under it and the schedule's own
engine, policy, drains, repacks and interrupts are untouched. It evaluates the newest weights the rollout's weight source offers once that is
`at_least` the version asked for, loading them into its engine through that source (before
anything is published: the starting weights, which the rollout's engine started from too; it
never asks the rollout's engine for weights), then decodes every held-out prompt twice:
greedy, and sampled with the rollout's sampling parameters and a fixed seed per prompt (the same
draws at every evaluation, so two evaluations differ by the weights only). One engine step per
loop step: the evaluation shares the rollout's CPU with generation instead of pausing it.
A multi-turn task evaluates whole episodes (laminar/envs/episode.py, with environments of its
own), scored by their environment: exact match is the episode's `info["exact_match"]`.
Requests and scores are the held-out evaluation's own (laminar/tasks/evaluate.py), the same as
the warm start's `evaluate`: its greedy half gives the same numbers on the same weights.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any

from laminar.engine.protocol import EngineFactory, RolloutEngine
from laminar.envs.episode import step_episodes
from laminar.rollout.io import WeightSource
from laminar.tasks.evaluate import Outcome, eval_request, mean_outcomes, score_responses
from laminar.types import GenerationRequest, PromptGroup, PromptItem, SamplingParams


@dataclass
class EvalJob:
    eval_id: str
    step: int  # trainer steps done when it was asked (0: the warm start)
    at_least: int  # the weights version it must run on, at least
    items: list[PromptItem]
    params: SamplingParams  # the rollout's sampling parameters (the sampled half)


class Evaluator:
    def __init__(self, make_engine: EngineFactory, tokenizer: Any, task: Any, rewards: Any = None,
                 episodes: Any = None) -> None:
        """`make_engine`: a fresh engine on the run's starting weights (called once, at the
        first evaluation). `rewards`: score through the rollout's reward runner (a user's
        reward in killable processes, with its timeout), not inline. `episodes`: a multi-turn
        task's evaluation episodes (environments of their own)."""
        self.make_engine, self.tokenizer, self.task = make_engine, tokenizer, task
        self.engine: RolloutEngine | None = None
        self.jobs: deque[EvalJob] = deque()
        self.job: EvalJob | None = None
        self.requests: dict[str, tuple[str, PromptItem, GenerationRequest]] = {}
        self.left = 0
        self.t0 = 0.0
        self.results: list[dict[str, Any]] = []
        self.rewards = rewards  # the rollout's reward runner (tasks/reward_pool.py), if any
        self.episodes = episodes  # multi-turn tasks: the evaluation's own episodes
        self.outcomes: dict[str, Outcome] = {}  # episodes: request id -> (reward, exact match)

    def queue(self, job: EvalJob) -> None:
        self.jobs.append(job)

    @property
    def pending(self) -> int:
        return len(self.jobs) + (self.job is not None)

    def prepare(self) -> None:
        """Build the evaluation's engine when a job waits and there is none yet. The rollout
        loop calls this outside its lock: an engine takes seconds to build (a vLLM one more),
        and the manager's health checks (the loop's `snapshot`) must not wait for it. Only
        the loop's thread touches the evaluator's engine."""
        if self.engine is None and self.jobs:
            self.engine = self.make_engine()

    def step(self, weights: WeightSource) -> bool:
        """Start the next job when its weights are there, or advance the running one by one
        engine step; False when there was nothing to do."""
        if self.job is None:
            return self._start(weights)
        if self.episodes is not None:
            progressed = self._step_episodes()
        else:
            progressed = True
            for delta in self.engine.step():
                if delta.finish_reason is not None and delta.request_id in self.requests:
                    self.left -= 1
        if self.left == 0:
            self._finish()
        return progressed

    def _step_episodes(self) -> bool:
        """False when every episode of the evaluation is in its environment: the loop may nap
        (it spun a core at 100% through a tool-heavy evaluation before)."""
        stepped, ended = step_episodes(self.engine, self.episodes)
        for e in ended:
            if e.request.request_id in self.requests:
                self.outcomes[e.request.request_id] = (e.reward, e.exact_match)
                self.left -= 1
        self.episodes.take_stats()  # the evaluation's latencies are not the run's
        return stepped or bool(ended)

    def close(self) -> None:
        """Free the evaluation's engine (a later evaluation builds a fresh one)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def take(self) -> list[dict[str, Any]]:
        out, self.results = self.results, []
        return out

    def _start(self, weights: WeightSource) -> bool:
        if not self.jobs:
            return False
        job = self.jobs[0]
        self.prepare()  # the starting weights (the loop built it already, outside its lock)
        newest = weights.newest()
        if newest is not None and newest > self.engine.version and newest >= job.at_least:
            weights.load_newest(self.engine, newer_than=self.engine.version)
        if self.engine.version < job.at_least:
            return False  # not at the local relay yet
        self.jobs.popleft()
        self.job, self.t0, self.requests = job, time.perf_counter(), {}
        greedy = dataclasses.replace(job.params, temperature=0.0, seed=None)
        for i, item in enumerate(job.items):
            seed = zlib.crc32(f"{job.params.seed}/eval/{i}".encode())
            for kind, params in (("greedy", greedy), ("sampled", dataclasses.replace(job.params, seed=seed))):
                req = eval_request(self.tokenizer, item, params, f"eval/{job.eval_id}/{kind}/{i}")
                self.requests[req.request_id] = (kind, item, req)
                if self.episodes is not None:
                    self.episodes.begin(req, PromptGroup(req.request_id, item, [], 1))
                else:
                    self.engine.add(req)
        self.left = len(self.requests)
        if self.left == 0:
            self._finish()
        return True

    def _finish(self) -> None:
        job = self.job
        answered = list(self.requests.values())
        if self.episodes is not None:  # scored by their environment as they ended
            scored = [self.outcomes.pop(req.request_id, (0.0, False)) for _, _, req in answered]
        else:  # every call of a reward runner ends within its timeout and retries
            scored = score_responses(self.task, self.tokenizer,
                                     [(item, req) for _, item, req in answered], self.rewards)
        row = {"step": job.step, "version": self.engine.version, "eval_id": job.eval_id}
        for kind in ("greedy", "sampled"):
            reward, exact = mean_outcomes([s for (k, _, _), s in zip(answered, scored) if k == kind])
            row[f"{kind}_exact_match"], row[f"{kind}_reward"] = exact, reward
        self.results.append({**row, "num_prompts": len(job.items),
                             "eval_s": round(time.perf_counter() - self.t0, 3)})
        self.job, self.requests, self.left = None, {}, 0
