"""From a finished generation request to a scored trajectory, after its environment call.

    finisher = Finisher(task, tokenizer, cfg.bench.env_latency, seed, open_rewards(cfg.task),
                        episodes)
    if finisher.begin(request, group):    # one turn: decode it now (else reset runs first)
        engine.add(request)
    finisher.add(request, group)          # the engine finished it (or a turn of its episode)
    for request, group in finisher.next_turns():   # multi-turn: the next turn, to decode
        engine.add(request)
    for traj in finisher.ready():         # reward done and tool call over: for the buffer
        ...
    finisher.close()                      # ends the reward workers and live episodes

Multi-turn tasks (`task.multi_turn`) run episodes (laminar/envs/episode.py): every finished
turn goes to the environment's `step`, which either continues the episode (its observation is
appended and the request comes back from `next_turns`) or ends it with the reward; an ended
episode becomes a trajectory with its loss mask and turn count.

The reward runs as `rewards` says (laminar/tasks/reward_pool.py: killable worker processes with
a timeout and retries, or inline; default inline with the task's reward). A trajectory whose
reward failed for good is still handed on, with `failed` set to the reason and reward 0, so
its GRPO group completes in the buffer; the trainer leaves it out. Failures are counted
(`reward_errors`, `failed_by_reason`). `bench.env_latency` emulates a sandbox or tool call per
trajectory: a log-normal wait before the trajectory is ready, like the paper's Fig. 2 (right).
The trajectory carries the version of its first token, and its per-token versions when it
mixes them.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import Counter

import numpy as np
from transformers import PreTrainedTokenizerBase

from laminar.config import Config, EnvLatencyConfig
from laminar.envs.episode import Episodes
from laminar.metrics import evenly
from laminar.models.tokenizer import decode_response
from laminar.tasks import Task
from laminar.tasks.reward_pool import InlineRewards, RewardCall, RewardPool
from laminar.tasks.rewards import exact_match
from laminar.types import GenerationRequest, PromptGroup, Trajectory

log = logging.getLogger("laminar.rewards")


def to_trajectory(req: GenerationRequest, group: PromptGroup, reward: float, exact_match: bool,
                  loss_mask: list[int] | None = None, turns: int = 1) -> Trajectory:
    versions = req.token_versions
    return Trajectory(traj_id=req.request_id, group_id=group.group_id, prompt_ids=req.prompt_ids,
                      response_ids=req.output_ids, logprobs=req.logprobs,
                      version=versions[0] if versions else req.version,
                      reward=reward, exact_match=exact_match, finish_reason=req.finish_reason,
                      token_versions=list(versions) if req.mixes_versions else None,
                      loss_mask=loss_mask if loss_mask is not None and 0 in loss_mask else None,
                      turns=turns)


class Finisher:
    def __init__(self, task: Task, tokenizer: PreTrainedTokenizerBase, env: EnvLatencyConfig,
                 seed: int, rewards: RewardPool | InlineRewards | None = None,
                 episodes: Episodes | None = None) -> None:
        self.task, self.tokenizer, self.env = task, tokenizer, env
        self.episodes = episodes
        self.rewards = rewards or InlineRewards(task.reward_fn)
        self.rng = np.random.default_rng(seed)  # the emulated environment's latencies
        self.scoring: list[tuple[RewardCall, float, Trajectory]] = []  # reward not done yet
        self.waiting: list[tuple[float, str, Trajectory]] = []  # heap by ready time
        self.reward_errors = 0  # trajectories whose reward failed for good
        self.failed_by_reason: Counter[str] = Counter()
        self.delays: list[float] = []  # environment latencies since the last take (real
        # step calls of multi-turn episodes, or the emulated ones)
        self.turns: list[int] = []  # turns of the episodes ended since the last take

    def begin(self, req: GenerationRequest, group: PromptGroup) -> bool:
        """A request about to start: True when it can be decoded now; False when its episode's
        reset runs first (it comes back from `next_turns`)."""
        if self.episodes is None:
            return True
        self.episodes.begin(req, group)
        return False

    def next_turns(self) -> list[tuple[GenerationRequest, PromptGroup]]:
        return self.episodes.next_turns() if self.episodes is not None else []

    def add(self, req: GenerationRequest, group: PromptGroup) -> None:
        if self.episodes is not None and req.request_id in self.episodes.live:
            self.episodes.end_turn(req)
            return
        response = decode_response(self.tokenizer, req.output_ids)
        call = self.rewards.submit(group.item.prompt, response, group.item.answer)
        traj = to_trajectory(req, group, 0.0, exact_match(response, group.item.answer))
        delay = 0.0
        if self.env.enabled:
            delay = min(self.env.max_s,
                        self.env.median_s * float(np.exp(self.env.sigma * self.rng.standard_normal())))
            if len(self.delays) < 4096:
                self.delays.append(delay)
        self.scoring.append((call, time.monotonic() + delay, traj))
        self._collect()

    def ready(self) -> list[Trajectory]:
        """Trajectories whose reward is done and whose environment call is over."""
        self._collect()
        if self.episodes is not None:
            self._collect_episodes()
        now, out = time.monotonic(), []
        while self.waiting and self.waiting[0][0] <= now:
            out.append(heapq.heappop(self.waiting)[2])
        return out

    def _collect(self) -> None:
        scoring = []
        for call, at, traj in self.scoring:
            if not call.done:
                scoring.append((call, at, traj))
                continue
            traj.reward, traj.failed = call.reward, call.failed
            if call.failed:
                if not self.failed_by_reason[call.failed]:  # the first of each kind says why
                    log.warning("reward of %s failed after %d tries (%s: %s); the trajectory is "
                                "left out of training, and such failures are counted",
                                traj.traj_id, call.tries, call.failed, call.error)
                self.failed_by_reason[call.failed] += 1
                self.reward_errors += 1
            heapq.heappush(self.waiting, (at, traj.traj_id, traj))
        self.scoring = scoring

    def _collect_episodes(self) -> None:
        for e in self.episodes.finished():
            traj = to_trajectory(e.request, e.group, e.reward, e.exact_match, e.loss_mask, e.turns)
            if e.failed:
                traj.failed = e.failed
                self.failed_by_reason[e.failed] += 1
                self.reward_errors += 1
            heapq.heappush(self.waiting, (0.0, traj.traj_id, traj))
        latencies, turns = self.episodes.take_stats()
        self.delays += latencies[:max(0, 4096 - len(self.delays))]
        self.turns += turns[:max(0, 4096 - len(self.turns))]

    def close(self) -> None:
        """End the reward workers (a later `add` starts new ones) and the live episodes."""
        self.rewards.close()
        if self.episodes is not None:
            self.episodes.close()

    def take_delays(self, at_most: int = 64) -> list[float]:
        """Up to `at_most` of the environment latencies since the last call, drawn evenly."""
        out, self.delays = self.delays, []
        return [round(d, 4) for d in evenly(out, at_most)]

    def take_turns(self, at_most: int = 64) -> list[int]:
        """Up to `at_most` of the turn counts of episodes ended since the last call."""
        out, self.turns = self.turns, []
        return evenly(out, at_most)

    def __len__(self) -> int:
        """Trajectories not ready yet: being scored, in their environment call, or mid-episode."""
        outside = self.episodes.num_outside_engine if self.episodes is not None else 0
        return len(self.scoring) + len(self.waiting) + outside


def make_finisher(cfg: Config, task: Task, tokenizer: PreTrainedTokenizerBase,
                  seed: int) -> Finisher:
    """The finisher of a rollout: reward workers for one-turn tasks, episodes for multi-turn."""
    from laminar.tasks.reward_pool import open_rewards

    return Finisher(task, tokenizer, cfg.bench.env_latency, seed, open_rewards(cfg.task),
                    make_episodes(cfg, task, tokenizer))


def make_episodes(cfg: Config, task: Task, tokenizer: PreTrainedTokenizerBase) -> Episodes | None:
    """Episodes of a multi-turn task (None for one-turn tasks)."""
    if not task.multi_turn:
        return None
    return Episodes(task, tokenizer, cfg.task.max_turns, cfg.task.env_timeout_s)
