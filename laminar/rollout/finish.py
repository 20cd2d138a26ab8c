"""From a finished generation request to a scored trajectory, after its environment call.

    finisher.add(request, group)          # score it; its emulated tool call starts now
    for traj in finisher.ready():         # the ones whose call is over, for the buffer
        ...

The reward runs at `add`; a reward function that raises scores 0 and is counted
(`reward_errors`). `rollout.env_latency` emulates a sandbox or tool call per trajectory: a
log-normal wait before the trajectory is ready, like the paper's Fig. 2 (right). The trajectory
carries the version of its first token, and its per-token versions when it mixes them.
"""

from __future__ import annotations

import heapq
import time

import numpy as np
from transformers import PreTrainedTokenizerBase

from laminar.config import EnvLatencyConfig
from laminar.metrics import evenly
from laminar.models.tokenizer import decode_response
from laminar.tasks import Task
from laminar.types import GenerationRequest, PromptGroup, Trajectory


def to_trajectory(req: GenerationRequest, group: PromptGroup, reward: float,
                  exact_match: bool) -> Trajectory:
    versions = req.token_versions
    return Trajectory(traj_id=req.request_id, group_id=group.group_id, prompt_ids=req.prompt_ids,
                      response_ids=req.output_ids, logprobs=req.logprobs,
                      version=versions[0] if versions else req.version,
                      reward=reward, exact_match=exact_match, finish_reason=req.finish_reason,
                      token_versions=list(versions) if req.mixes_versions else None)


class Finisher:
    def __init__(self, task: Task, tokenizer: PreTrainedTokenizerBase, env: EnvLatencyConfig,
                 seed: int) -> None:
        self.task, self.tokenizer, self.env = task, tokenizer, env
        self.rng = np.random.default_rng(seed)  # the emulated environment's latencies
        self.waiting: list[tuple[float, str, Trajectory]] = []  # heap by ready time
        self.reward_errors = 0
        self.delays: list[float] = []  # emulated environment latencies since the last take

    def add(self, req: GenerationRequest, group: PromptGroup) -> None:
        scored = self.task.score(group.item, decode_response(self.tokenizer, req.output_ids))
        self.reward_errors += scored.error is not None
        traj = to_trajectory(req, group, scored.reward, scored.exact_match)
        delay = 0.0
        if self.env.enabled:
            delay = min(self.env.max_s,
                        self.env.median_s * float(np.exp(self.env.sigma * self.rng.standard_normal())))
            if len(self.delays) < 4096:
                self.delays.append(delay)
        heapq.heappush(self.waiting, (time.monotonic() + delay, traj.traj_id, traj))

    def ready(self) -> list[Trajectory]:
        now, out = time.monotonic(), []
        while self.waiting and self.waiting[0][0] <= now:
            out.append(heapq.heappop(self.waiting)[2])
        return out

    def take_delays(self, at_most: int = 64) -> list[float]:
        """Up to `at_most` of the environment latencies since the last call, drawn evenly."""
        out, self.delays = self.delays, []
        return [round(d, 4) for d in evenly(out, at_most)]

    def __len__(self) -> int:
        return len(self.waiting)
