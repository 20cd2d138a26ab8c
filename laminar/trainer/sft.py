"""`laminar sft`: a short supervised warm start so that RL has a signal to climb.

Cross-entropy on the answer tokens (+ EOS) of the task's training prompts, AdamW with warm-up
and cosine decay, stopped at `sft.steps` or `sft.max_seconds`. A multi-turn task with
demonstrations (`task.demonstrate`, the built-in `calc`) trains on the prompt followed by a
demonstrated episode: the model's segments (+ the final EOS) are targets, the environment's
observations context only, each segment tokenized on its own as the rollout does (so token
boundaries match the episodes RL samples). The result is a Hugging Face
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

from laminar.config import Config, EngineConfig
from laminar.engine import HFEngine, build_engine
from laminar.envs.template import TurnTemplate
from laminar.models import EOS_ID, encode_prompt, load_policy, save_pretrained
from laminar.tasks import build_task
from laminar.tasks.evaluate import evaluate
from laminar.trainer.batching import token_budget_batches


MICRO_BATCH_TOKENS = 2048  # padded tokens per forward; see laminar.trainer.batching


Example = tuple[list[int], list[int]]  # token ids, and per id 1 = a target, 0 = context


def answer_example(tokenizer, item, eos: int) -> Example:
    """Prompt (context) + answer and EOS (targets)."""
    p = encode_prompt(tokenizer, item.prompt)
    a = tokenizer.encode(item.answer, add_special_tokens=False) + [eos]
    return p + a, [0] * len(p) + [1] * len(a)


def demonstration_example(turns: TurnTemplate, item, segments: list[tuple[str, bool]],
                          eos: int) -> Example:
    """Prompt + a demonstrated episode: trained segments (and the final EOS) are targets,
    observations context. Tokenized like the rollout: the prompt and every observation by the
    turn template (the built-in one: BOS + prompt, observations as plain text), the model's
    segments on their own without special tokens."""
    tokenizer = turns.tokenizer
    ids = list(turns.prompt_ids(item.prompt))
    mask = [0] * len(ids)
    for text, trained in segments:
        seg = (tokenizer.encode(text, add_special_tokens=False) if trained
               else turns.observation_ids(text, ended_with_eos=False))
        ids += seg
        mask += [int(trained)] * len(seg)
    return ids + [eos], mask + [1]


def _answer_loss(model, batch: list[Example], pad: int) -> torch.Tensor:
    """Summed cross-entropy of the target tokens (the rest is context only)."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, targets) in enumerate(batch):
        t = torch.tensor(ids)
        input_ids[row, :len(ids)] = t
        labels[row, :len(ids)] = torch.where(torch.tensor(targets, dtype=torch.bool), t, -100)
        mask[row, :len(ids)] = 1
    logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             labels[:, 1:].reshape(-1), ignore_index=-100,
                                             reduction="sum")


def task_format(cfg: Config) -> str | None:
    """A version of what the task's SFT examples look like beyond its settings (the built-in
    calc task's prompt, program and observation formats), so a format change retrains; None for
    prompt + answer examples."""
    if cfg.task.name == "calc" and cfg.task.env is None:
        from laminar.tasks import calc

        return calc.FORMAT
    return None


def cache_key(cfg: Config) -> str:
    relevant = {"model": cfg.model.model_dump(),  # a timeout changes no demonstration
                "task": cfg.task.model_dump(exclude={"env_timeout_s"}),
                "sft": cfg.sft.model_dump(exclude={"cache_dir"})}
    if (fmt := task_format(cfg)) is not None:  # (absent: earlier caches stay valid)
        relevant["task_format"] = fmt
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def sft_model_dir(cfg: Config) -> Path:
    return Path(cfg.sft.cache_dir) / cache_key(cfg)


def build_examples(task, tokenizer, eos: int) -> list[Example]:
    if task.demonstrate is not None:
        turns = TurnTemplate(tokenizer)
        return [demonstration_example(turns, it, task.demonstrate(it), eos) for it in task.train]
    return [answer_example(tokenizer, it, eos) for it in task.train]


def evaluate_model(cfg: Config, model, tokenizer, task, eos: int, pad: int) -> dict[str, float]:
    """Held-out greedy evaluation of the warm start; multi-turn tasks run whole episodes on the
    native engine (the one that stops at the environment's stop strings). Fixed backends, not
    `rollout.engine`: the model is in this process's memory (not saved yet), and the numbers
    describe the warm start alone, whatever backend the RL run then uses."""
    if not task.multi_turn:
        engine = HFEngine(model, eos, pad, max_batch_size=128)
        return evaluate(engine, tokenizer, task, cfg.rollout.max_new_tokens)
    longest = max(len(encode_prompt(tokenizer, it.prompt)) for it in task.eval)
    width = longest + cfg.rollout.max_new_tokens + 1
    rows = max(1, min(64, len(task.eval)))
    engine = build_engine(EngineConfig(backend="native", max_batch_size=rows,
                                       kv_capacity_tokens=max(16, rows * width)), model, eos, pad)
    return evaluate(engine, tokenizer, task, cfg.rollout.max_new_tokens, cfg.task.max_turns,
                    cfg.task.env_timeout_s)


def run_sft(cfg: Config, log=print) -> Path:
    """Train (or reuse the cached) warm-started model; returns its directory."""
    out = sft_model_dir(cfg)
    if (out / "config.json").is_file():
        log(f"sft: using cached warm start {out}")
        return out
    torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.trainer.seed)
    model, tokenizer = load_policy(cfg.model)
    task = build_task(cfg.task, cfg.sandbox)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else EOS_ID
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    examples = build_examples(task, tokenizer, eos)
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
        num_targets = sum(sum(m) for _, m in batch)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for group in token_budget_batches([len(ids) for ids, _ in batch], MICRO_BATCH_TOKENS):
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
    metrics = evaluate_model(cfg, model, tokenizer, task, eos, pad)
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
