"""TRL's `GRPOTrainer` on `laminar bench modes`' workload, set up as a TRL user tuning for speed
on this machine would: the reference outside laminar.

Same warm-started model, tokenizer, prompts, reward, group size, batch, learning rate and
optimizer steps per batch as the schedules; its reward function sleeps for the batch's slowest
emulated tool call (a synchronous batch waits for its slowest member). Three settings are
timed on a few steps and the fastest runs the benchmark (`pick_fastest`):

- `defaults`: TRL's own defaults for what we do not set (gradient checkpointing on, plain
  `generate`);
- `no_checkpointing`: gradient checkpointing off (a model this small has no activation memory
  to save, only the recomputation to pay);
- `no_checkpointing_cb`: that, plus transformers' continuous-batching generation
  (`use_transformers_continuous_batching`), TRL's fastest generation path without vLLM on GPUs.

Every way `beta=0` (no reference model is loaded when the KL coefficient is 0). TRL computes
the old log-probs with one more forward pass, since it makes several optimizer steps per
generated batch (`steps_per_generation` = `trainer.mini_batches`) and its generator returns no
log-probs; laminar's engine records them while sampling.

`available()` says whether TRL is installed; `laminar bench modes` runs the rest without it.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

SETTINGS: dict[str, dict[str, Any]] = {
    "defaults": {},  # TRL's gradient_checkpointing default (True) and plain generate
    "no_checkpointing": {"gradient_checkpointing": False},
    "no_checkpointing_cb": {"gradient_checkpointing": False, "use_transformers_continuous_batching": True},
}
INSTALL_HINT = "TRL is not installed: `pip install 'laminar[bench]'` (or `make bench`) adds it"


def available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("trl", "datasets", "accelerate"))


def trl_args(cfg: Any, steps: int, out_dir: Path, setting: str) -> dict[str, Any]:
    """GRPOConfig keyword arguments for the bench workload `cfg` (a laminar Config)."""
    group, prompts = cfg.rollout.group_size, cfg.trainer.prompts_per_step
    return dict(
        output_dir=str(out_dir), use_cpu=True, bf16=False, seed=cfg.trainer.seed,
        per_device_train_batch_size=group * prompts // cfg.trainer.mini_batches,
        steps_per_generation=cfg.trainer.mini_batches, num_generations=group,
        max_completion_length=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
        top_k=0, top_p=1.0, learning_rate=cfg.trainer.lr, lr_scheduler_type="constant",
        adam_beta1=cfg.trainer.betas[0], adam_beta2=cfg.trainer.betas[1],
        weight_decay=cfg.trainer.weight_decay, max_grad_norm=cfg.trainer.grad_clip,
        beta=0.0, epsilon=cfg.trainer.eps_low, epsilon_high=cfg.trainer.eps_high, loss_type="dapo",
        max_steps=steps * cfg.trainer.mini_batches, logging_steps=cfg.trainer.mini_batches,
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        **SETTINGS[setting])


def run_trl(cfg: Any, steps: int, out_dir: Path, setting: str = "no_checkpointing",
            warmup_steps: int = 3) -> dict[str, Any]:
    """Train `steps` global batches with TRL; tokens/s after `warmup_steps`, the reward curve,
    and the held-out greedy exact match of the final model (the same prompts and scorer as the
    schedules' evaluations)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from laminar.models import load_pretrained
    from laminar.tasks import build_task
    from laminar.trainer.sft import run_sft

    torch.set_num_threads(2)  # one process: TRL gets both cores
    model, tokenizer = load_pretrained(run_sft(cfg))
    task = build_task(cfg.task)
    bos = tokenizer.bos_token
    data = Dataset.from_list([{"prompt": bos + it.prompt, "answer": it.answer} for it in task.train])
    env = cfg.bench.env_latency
    rng = np.random.default_rng(cfg.trainer.seed)

    def reward(completions, answer, **_):
        if env.enabled:  # the same emulated tool call per completion; the batch waits for its slowest
            calls = env.median_s * np.exp(env.sigma * rng.standard_normal(len(completions)))
            time.sleep(float(np.minimum(calls, env.max_s).max()))
        return [task.reward_fn("", c, a) for c, a in zip(completions, answer)]

    stamps: list[tuple[float, float, float]] = []  # (time, cumulative tokens, reward)

    class Clock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "num_tokens" in logs:
                stamps.append((time.perf_counter(), float(logs["num_tokens"]), float(logs.get("reward", 0))))

    kwargs = trl_args(cfg, steps, out_dir, setting)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=GRPOConfig(**kwargs),
                          train_dataset=data, processing_class=tokenizer, callbacks=[Clock()])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    tail = stamps[warmup_steps:] if len(stamps) > warmup_steps + 1 else stamps
    tokens_per_s = (tail[-1][1] - tail[0][1]) / (tail[-1][0] - tail[0][0])
    return {"throughput": tokens_per_s, "wall_s": wall, "setting": setting,
            "curve": [(round(t - t0, 3), r) for t, _, r in stamps],
            "final_heldout": _greedy_exact_match(trainer.model, tokenizer, task, cfg),
            "trl_config": {k: v for k, v in kwargs.items() if k != "output_dir"}}


def _greedy_exact_match(model: Any, tokenizer: Any, task: Any, cfg: Any) -> float:
    from laminar.engine.hf import HFEngine
    from laminar.tasks.evaluate import evaluate

    model.eval()
    engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_batch_size=128)
    return evaluate(engine, tokenizer, task, cfg.rollout.max_new_tokens)["eval_exact_match"]


def pick_fastest(cfg: Any, out_dir: Path, probe_steps: int = 6) -> tuple[str, dict[str, float]]:
    """Time each of SETTINGS on `probe_steps` batches; (the fastest, tokens/s of each). A
    setting that fails (a generation path this TRL/transformers cannot run on CPU) is skipped
    with its error."""
    speeds: dict[str, float] = {}
    for setting in SETTINGS:
        try:
            speeds[setting] = run_trl(cfg, probe_steps, out_dir / f"probe-{setting}", setting,
                                      warmup_steps=2)["throughput"]
        except Exception as e:  # report and go on with the other settings
            print(f"trl: setting {setting!r} failed on this machine: {type(e).__name__}: {e}")
    if not speeds:
        raise RuntimeError("TRL failed with every setting; see the messages above")
    return max(speeds, key=speeds.get), speeds
