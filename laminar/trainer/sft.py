"""`laminar sft`: a short supervised warm start so that RL has a signal to climb.

Cross-entropy on the answer tokens (+ EOS) of the task's training prompts, AdamW with warm-up
and cosine decay, stopped at `sft.steps` or `sft.max_seconds`. The result is a Hugging Face
model directory cached under `sft.cache_dir/<key>`, where the key hashes every setting that
changes the result, so the default job trains it once and reuses it afterwards.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from laminar.config import Config
from laminar.engine.hf import HFEngine
from laminar.models import EOS_ID, encode_prompt, load_policy, save_pretrained
from laminar.tasks import build_task
from laminar.tasks.evaluate import evaluate
from laminar.trainer.batching import token_budget_batches


MICRO_BATCH_TOKENS = 2048  # padded tokens per forward; see laminar.trainer.batching


def _answer_loss(model, batch: list[tuple[list[int], list[int]]], pad: int) -> torch.Tensor:
    """Summed cross-entropy of the answer tokens (prompt tokens are context only)."""
    width = max(len(p) + len(a) for p, a in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (p, a) in enumerate(batch):
        input_ids[row, :len(p) + len(a)] = torch.tensor(p + a)
        labels[row, len(p):len(p) + len(a)] = torch.tensor(a)
        mask[row, :len(p) + len(a)] = 1
    logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             labels[:, 1:].reshape(-1), ignore_index=-100,
                                             reduction="sum")


def cache_key(cfg: Config) -> str:
    relevant = {"model": cfg.model.model_dump(), "task": cfg.task.model_dump(),
                "sft": cfg.sft.model_dump(exclude={"cache_dir"})}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def sft_model_dir(cfg: Config) -> Path:
    return Path(cfg.sft.cache_dir) / cache_key(cfg)


def run_sft(cfg: Config, log=print) -> Path:
    """Train (or reuse the cached) warm-started model; returns its directory."""
    out = sft_model_dir(cfg)
    if (out / "config.json").is_file():
        log(f"sft: using cached warm start {out}")
        return out
    torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.trainer.seed)
    model, tokenizer = load_policy(cfg.model)
    task = build_task(cfg.task)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else EOS_ID
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    examples = [(encode_prompt(tokenizer, it.prompt),
                 tokenizer.encode(it.answer, add_special_tokens=False) + [eos]) for it in task.train]
    s = cfg.sft
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = min(50, s.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / max(1, warmup))
                                                 * (0.1 + 0.45 * (1 + math.cos(math.pi * min(i, s.steps) / s.steps))))
    rng = np.random.default_rng(cfg.task.seed)
    model.train()
    t0, step, loss_ema = time.perf_counter(), 0, None
    log(f"sft: up to {s.steps} steps or {s.max_seconds:.0f}s on {len(examples)} examples")
    while step < s.steps and time.perf_counter() - t0 < s.max_seconds:
        batch = [examples[i] for i in rng.integers(0, len(examples), s.batch_size)]
        num_targets = sum(len(a) for _, a in batch)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for group in token_budget_batches([len(p) + len(a) for p, a in batch], MICRO_BATCH_TOKENS):
            loss = _answer_loss(model, [batch[i] for i in group], pad) / num_targets
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        step += 1
        loss_ema = total if loss_ema is None else 0.95 * loss_ema + 0.05 * total
        if step % 200 == 0:
            log(f"sft: step {step} loss {loss_ema:.3f} ({time.perf_counter() - t0:.0f}s)")
    model.eval()
    engine = HFEngine(model, eos, pad, max_batch_size=128)
    metrics = evaluate(engine, tokenizer, task, cfg.rollout.max_new_tokens)
    report = {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "loss": loss_ema, **metrics}
    log(f"sft: done in {report['seconds']}s, {step} steps: eval exact match "
        f"{metrics['eval_exact_match']:.2f}, eval reward {metrics['eval_reward']:.3f}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model, tokenizer, tmp)
    (tmp / "sft_report.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
