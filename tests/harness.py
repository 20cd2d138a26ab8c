"""What several test files build the same way (the shared fixtures, `ray_cluster` and
`one_thread`, are in conftest.py; how tests wait is in waiting.py):

    World, step_until     the pools, a weight board and rollout loops over them, in this
                          process (the rollout loop's own harness: no Ray)
    Recorder              an engine whose generated tokens and log-probs are kept per request
    sharpen               a tiny model whose greedy path depends on the whole context
    make_prompts,         random token prompts and greedy requests for the engine tests
    requests, GREEDY
"""

from __future__ import annotations

import copy
import random
from functools import partial
from typing import Any, Callable

import torch

from laminar.config import Config
from laminar.engine import Engine
from laminar.models import BOS_ID, EOS_ID, PAD_ID, build_preset
from laminar.models.tokenizer import build_char_tokenizer, encode_prompt
from laminar.modes import schedule
from laminar.pools.experience import ExperienceBuffer
from laminar.pools.partials import PartialPool
from laminar.pools.prompts import PromptPool, PromptSampler
from laminar.rollout.finish import make_finisher
from laminar.rollout.io import (BoardWeights, LocalBuffer, LocalPartials, LocalPrompts, RolloutIO,
                                WeightBoard)
from laminar.rollout.loop import RolloutLoop
from laminar.rollout.policy import Policy
from laminar.rollout.requests import sampling_params
from laminar.tasks import build_task
from laminar.types import GenerationRequest, SamplingParams, Trajectory
from waiting import stepping

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


class World:
    """The pools, a weight board, and any number of loops over them (tiny model, seed 0)."""

    def __init__(self, cfg: Config, mode: str = "laminar") -> None:
        self.cfg, self.policy = cfg, schedule(mode).policy(cfg)
        self.tokenizer = build_char_tokenizer()
        self.task = build_task(cfg.task)
        sampler = PromptSampler(self.task.train, partial(encode_prompt, self.tokenizer),
                                cfg.rollout.group_size, seed=0)
        self.prompts = PromptPool(sampler, 600.0, self.policy.max_outstanding)
        self.partials = PartialPool()
        self.buffer = ExperienceBuffer(cfg.rollout.group_size)
        self.board = WeightBoard()
        self.model = build_preset("tiny", seed=0)

    def loop(self, rollout_id: str = "r0", policy: Policy | None = None) -> RolloutLoop:
        """A loop with its own engine on the starting weights and the world's policy (or
        `policy`); its finisher is the one a rollout builds (reward, or episodes)."""
        engine = Engine(copy.deepcopy(self.model), EOS_ID, PAD_ID, max_batch_size=8)
        io = RolloutIO(LocalPrompts(self.prompts), LocalPartials(self.partials),
                       LocalBuffer(self.buffer), BoardWeights(self.board))
        finisher = make_finisher(self.cfg, self.task, self.tokenizer, 0)
        return RolloutLoop(rollout_id, engine, io, policy or self.policy, finisher,
                           sampling_params(self.cfg), self.cfg.rollout, heartbeat_s=1.0)

    def publish(self, version: int, seed: int) -> None:
        """Put the tiny model of `seed` on the board as `version`."""
        self.board.publish(dict(build_preset("tiny", seed=seed).named_parameters()), version)

    def trained(self) -> list[Trajectory]:
        """Every trajectory of the complete groups in the buffer."""
        return [t for g in self.buffer.complete for t in g]


def step_until(loop: RolloutLoop, done: Callable[[], Any]) -> None:
    stepping(f"loop {loop.id} to get there", loop.step, done)  # puts are batched every FLUSH_S


class Recorder:
    """The engine, with every token it generated recorded per request."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.logprobs: dict[str, list[float]] = {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        deltas = self.engine.step()
        for d in deltas:
            self.tokens.setdefault(d.request_id, []).extend(d.token_ids)
            self.logprobs.setdefault(d.request_id, []).extend(d.logprobs)
        return deltas


def sharpen(model: torch.nn.Module, factor: float = 8.0) -> torch.nn.Module:
    """Scale the decoder layers' matrices. At the default init the tied embedding dominates the
    residual stream and greedy decoding just repeats the last prompt token, which would hide any
    attention or KV-cache bug; scaled up, the greedy path depends on the whole context."""
    with torch.no_grad():
        for param in model.model.layers.parameters():
            if param.dim() == 2:
                param.mul_(factor)
    return model.eval()


def make_prompts(n: int, seed: int = 0, lo: int = 2, hi: int = 30) -> list[list[int]]:
    """`n` prompts of BOS and lo..hi-1 random ids in 4..103."""
    rng = random.Random(seed)
    return [[BOS_ID] + [rng.randrange(4, 104) for _ in range(rng.randrange(lo, hi))]
            for _ in range(n)]


def requests(prompts: list[list[int]], params: SamplingParams = GREEDY, prefix: str = "r"
             ) -> list[GenerationRequest]:
    return [GenerationRequest(f"{prefix}{i}", list(p), params) for i, p in enumerate(prompts)]
