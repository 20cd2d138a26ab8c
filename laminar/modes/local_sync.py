"""sync without Ray: the verl schedule in one process (`cluster.backend: local`).

Useful to debug a task or reward without starting a cluster, and as the reference the Ray
schedules are checked against.

    for each step:  generate the global batch with version v  →  reward  →  train  →  load v+1

Nothing overlaps: the engine idles while the trainer trains and the trainer idles while the
slowest trajectory of the batch finishes. Every trajectory has staleness 0.
"""

from __future__ import annotations

import copy
import time
from functools import partial

import torch

from laminar.config import Config
from laminar.metrics import MetricsLogger, read_metrics, reward_trend, summarize
from laminar.models.tokenizer import encode_prompt
from laminar.engine import build_engine
from laminar.models import load_pretrained
from laminar.modes.common import Stopwatch, start_weights, to_trajectory
from laminar.rollout.requests import group_requests, sampling_params
from laminar.pools.prompts import PromptSampler
from laminar.tasks import build_task
from laminar.tasks.evaluate import evaluate
from laminar.trainer.trainer import Trainer


def run(cfg: Config) -> dict[str, float]:
    torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.trainer.seed)
    model, tokenizer = load_pretrained(start_weights(cfg)[0], cfg.model.attn_implementation)
    task = build_task(cfg.task)
    if task.load_report:
        print(task.load_report.summary())
    sampler = PromptSampler(task.train, partial(encode_prompt, tokenizer), cfg.rollout.group_size,
                            seed=cfg.task.seed)
    trainer = Trainer(model, cfg.trainer, tokenizer.pad_token_id, cfg.rollout.temperature)
    if cfg.trainer.resume:
        extra = trainer.load_checkpoint(cfg.trainer.resume)  # from this loop or from the runtime
        sampler.load_state_dict(extra["sampler"] if "sampler" in extra else extra["prompts"]["sampler"])
        print(f"resumed from {cfg.trainer.resume} at version {trainer.version}")
    engine = build_engine(cfg.rollout.engine, copy.deepcopy(model).eval(), tokenizer.eos_token_id,
                          tokenizer.pad_token_id, trainer.version, cfg.trainer.seed)
    run_dir = cfg.resolved_run_dir
    logger = MetricsLogger(run_dir, cfg.trainer.total_steps, fresh=not cfg.trainer.resume)
    params = sampling_params(cfg)
    before = evaluate(engine, tokenizer, task, cfg.rollout.max_new_tokens)
    print(f"sync mode: {cfg.trainer.total_steps} steps x {cfg.trainer.prompts_per_step} prompts x "
          f"{cfg.rollout.group_size} samples; eval exact match {before['eval_exact_match']:.2f} "
          f"reward {before['eval_reward']:.3f}; metrics -> {logger.path}")

    while trainer.version < cfg.trainer.total_steps:
        clock = Stopwatch()
        groups = sampler.next_groups(cfg.trainer.prompts_per_step)
        requests = {g.group_id: group_requests(g, params) for g in groups}
        engine.generate([r for reqs in requests.values() for r in reqs])
        gen_s = clock.lap()
        trajs, errors = [], 0
        for g in groups:
            for req in requests[g.group_id]:
                traj, error = to_trajectory(g, req, task, tokenizer)
                trajs.append(traj)
                errors += error is not None
        stats = trainer.train_step(trajs)
        train_s = clock.lap()
        engine.load_weights(trainer.named_weights(), trainer.version)
        step_s = gen_s + train_s + clock.lap()
        summary = summarize(trajs)
        logger.log(trainer.version, {
            **summary, **stats, "gen_s": gen_s, "step_s": step_s, "reward_errors": errors,
            "throughput_tokens_per_s": summary["batch_tokens"] / step_s,
            "gen_tokens_per_s": summary["response_tokens"] / gen_s,
            "trainer_idle_frac": gen_s / step_s,
        })
        every = cfg.trainer.checkpoint_every
        if (every and trainer.version % every == 0) or trainer.version == cfg.trainer.total_steps:
            trainer.save_checkpoint(run_dir / "checkpoints" / f"step_{trainer.version:06d}", tokenizer,
                                    {"sampler": sampler.state_dict()})

    after = evaluate(engine, tokenizer, task, cfg.rollout.max_new_tokens)
    first, last = reward_trend(read_metrics(run_dir))
    print(f"done: mean training reward {first:.3f} (first steps) -> {last:.3f} (last steps); "
          f"eval exact match {before['eval_exact_match']:.2f} -> {after['eval_exact_match']:.2f}, "
          f"eval reward {before['eval_reward']:.3f} -> {after['eval_reward']:.3f} ({run_dir})")
    return ({"before_" + k: v for k, v in before.items()} | {"after_" + k: v for k, v in after.items()}
            | {"reward_first": first, "reward_last": last})
