"""Pieces every schedule shares: the starting model, the engine, and turning finished
generation requests into scored trajectories."""

from __future__ import annotations

import time
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from laminar.config import Config, ConfigError
from laminar.models import load_policy, load_pretrained
from laminar.models.tokenizer import decode_response
from laminar.tasks import Task
from laminar.types import GenerationRequest, PromptGroup, SamplingParams, Trajectory


def starting_model(cfg: Config, log=print) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Resume checkpoint > model.path > cached SFT warm start > randomly initialised preset."""
    if cfg.trainer.resume:
        model_dir = Path(cfg.trainer.resume) / "model"
        if not model_dir.is_dir():
            raise ConfigError(f"trainer.resume='{cfg.trainer.resume}' is not a laminar checkpoint "
                              "(no model/ folder inside)")
        return load_pretrained(model_dir, cfg.model.attn_implementation)
    if cfg.model.path:
        return load_policy(cfg.model)
    if cfg.sft.enabled:
        from laminar.trainer.sft import run_sft

        return load_pretrained(run_sft(cfg, log=log), cfg.model.attn_implementation)
    return load_policy(cfg.model)


def sampling_params(cfg: Config) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens)


def make_engine(cfg: Config, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, version: int = 0):
    e = cfg.rollout.engine
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if e.backend == "hf":
        from laminar.engine.hf import HFEngine

        return HFEngine(model, eos, pad, max_batch_size=e.max_batch_size, version=version)
    from laminar.engine import Engine

    return Engine(model, eos, pad, max_batch_size=e.max_batch_size,
                  kv_capacity_tokens=e.kv_capacity_tokens, version=version, seed=cfg.trainer.seed)


def group_requests(group: PromptGroup, params: SamplingParams) -> list[GenerationRequest]:
    return [GenerationRequest(f"{group.group_id}/{i}", list(group.prompt_ids), params)
            for i in range(group.num_samples)]


def to_trajectory(group: PromptGroup, req: GenerationRequest, task: Task,
                  tokenizer: PreTrainedTokenizerBase) -> tuple[Trajectory, str | None]:
    """Score a finished request; returns the trajectory and the reward error, if any."""
    scored = task.score(group.item, decode_response(tokenizer, req.output_ids))
    traj = Trajectory(traj_id=req.request_id, group_id=group.group_id, prompt_ids=req.prompt_ids,
                      response_ids=req.output_ids, logprobs=req.logprobs, version=req.version,
                      reward=scored.reward, exact_match=scored.exact_match,
                      finish_reason=req.finish_reason)
    return traj, scored.error


class Stopwatch:
    def __init__(self) -> None:
        self.t = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt
