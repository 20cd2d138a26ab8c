"""The GRPO trainer: one global batch of trajectories in, one new weight version out.

Parts:
- `collate` packs trajectories into right-padded tensors with the behaviour log-probs aligned
  to the positions that predict each response token;
- `Trainer.train_step` computes group advantages, splits the batch into `mini_batches` (one
  AdamW update each; gradients accumulate over length-sorted micro-batches within one), and
  bumps `version` once per global batch; with `old_logprobs` = `recompute` or `decoupled` the
  ratio is taken against a copy of the weights as they were when the global batch began.
  Trajectories whose reward failed (`failed` set) are left out before the group advantages;
  an update whose loss or gradient norm is not finite is skipped (`nonfinite_skipped`), and
  `trainer.max_nonfinite_steps` skipped in a row raise `NonFiniteTraining`;
- `save_checkpoint` / `load_checkpoint` write and read model (Hugging Face format), optimizer,
  version, RNG state and any caller state (e.g. the data position), atomically.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from laminar.config import TrainerConfig
from laminar.trainer.advantage import group_advantages
from laminar.trainer.batching import token_budget_batches
from laminar.trainer.loss import policy_loss, token_logprobs
from laminar.types import Trajectory

log = logging.getLogger("laminar.trainer")


class NonFiniteTraining(RuntimeError):
    """`trainer.max_nonfinite_steps` optimizer updates in a row had a NaN or inf loss or
    gradient norm: training has diverged (the service checkpoints and stops the run)."""


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1] input_ids shifted left: the token each position predicts
    response_mask: torch.Tensor  # [B, L-1] 1 where the target is a response token
    old_logprobs: torch.Tensor  # [B, L-1] behaviour log-probs at the response positions
    advantages: torch.Tensor  # [B]

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())


def collate(trajs: list[Trajectory], advantages: torch.Tensor, pad_token_id: int) -> Batch:
    width = max(t.num_tokens for t in trajs)
    B = len(trajs)
    input_ids = torch.full((B, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, width), dtype=torch.long)
    response_mask = torch.zeros((B, width - 1))
    old_logprobs = torch.zeros((B, width - 1))
    for row, t in enumerate(trajs):
        seq = t.prompt_ids + t.response_ids
        input_ids[row, :len(seq)] = torch.tensor(seq)
        attention_mask[row, :len(seq)] = 1
        start = len(t.prompt_ids) - 1  # position whose logits predict the first response token
        end = start + len(t.response_ids)
        response_mask[row, start:end] = (1.0 if t.loss_mask is None else  # observations: context
                                          torch.tensor(t.loss_mask, dtype=torch.float32))
        old_logprobs[row, start:end] = torch.tensor(t.logprobs, dtype=torch.float32)
    return Batch(input_ids, attention_mask, input_ids[:, 1:], response_mask, old_logprobs, advantages)


def split_groups(trajs: list[Trajectory], parts: int) -> list[list[Trajectory]]:
    """Split into `parts` mini-batches of whole groups (a group's advantages belong together)."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
    ordered = list(groups.values())
    size = -(-len(ordered) // parts)
    return [[t for g in ordered[i:i + size] for t in g] for i in range(0, len(ordered), size)]


class Trainer:
    def __init__(self, model: PreTrainedModel, cfg: TrainerConfig, pad_token_id: int,
                 temperature: float = 1.0) -> None:
        self.model = model.train()
        self.cfg = cfg
        self.pad_token_id = pad_token_id
        self.temperature = temperature if temperature > 0 else 1.0
        self.version = 0  # completed global batches = version of the current weights
        self._pending: list[dict[str, float]] = []  # stats of this global batch's mini-batches
        self.nonfinite_in_a_row = 0  # updates skipped for a NaN / inf loss or gradient, in a row
        self.last_minibatches: list[dict[str, float]] = []  # those of the last finished one
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay)
        self.ref_model = None
        if cfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.prox_model = None  # the weights at the start of this global batch (recompute modes)
        if cfg.old_logprobs != "rollout":
            self.prox_model = copy.deepcopy(model).eval().requires_grad_(False)

    def sequence_logprobs(self, model: PreTrainedModel, batch: Batch) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.bf16):
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        return token_logprobs(logits[:, :-1], batch.targets, self.temperature)

    def train_step(self, trajs: list[Trajectory]) -> dict[str, float]:
        """One global batch: `mini_batches` optimizer updates, then version += 1."""
        for mb in split_groups(trajs, self.cfg.mini_batches):
            self.train_minibatch(mb)
        return self.finish_global_batch()

    def train_minibatch(self, trajs: list[Trajectory]) -> None:
        """One optimizer update on whole groups; gradients accumulate over length-sorted
        micro-batches so the loss is the token-level mean of the mini-batch. Failed samples
        are left out (a group keeps its others); a NaN / inf loss or gradient skips the update."""
        t0 = time.perf_counter()
        if self.prox_model is not None and not self._pending:  # a new global batch begins
            self.prox_model.load_state_dict(self.model.state_dict())
        for t in trajs:
            t.staleness = self.version - t.version
        trajs = [t for t in trajs if t.failed is None]
        if not trajs:  # every sample failed: nothing to learn from
            self._pending.append({"train_s": time.perf_counter() - t0, "nonfinite_skipped": 0})
            return
        adv = group_advantages([t.reward for t in trajs], [t.group_id for t in trajs]).tolist()
        num_tokens = sum(len(t.response_ids) if t.loss_mask is None else sum(t.loss_mask)
                         for t in trajs)  # the model's tokens: what the loss averages over
        sums: dict[str, float] = {}
        self.optimizer.zero_grad(set_to_none=True)
        for group in token_budget_batches([t.num_tokens for t in trajs], self.cfg.micro_batch_tokens):
            batch = collate([trajs[i] for i in group], torch.tensor([adv[i] for i in group]),
                            self.pad_token_id)
            loss, stats = self._loss(batch, num_tokens)
            loss.backward()
            weight = batch.num_response_tokens / num_tokens  # token-weighted average of stats
            for key, value in {**stats, "loss": loss.item() / weight}.items():
                sums[key] = sums.get(key, 0.0) + value * weight
        sums["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                                 self.cfg.grad_clip))
        if math.isfinite(sums["loss"]) and math.isfinite(sums["grad_norm"]):
            self.optimizer.step()
            self.nonfinite_in_a_row = 0
            sums["nonfinite_skipped"] = 0
        else:
            self._skip_nonfinite(sums["loss"], sums["grad_norm"])
            sums = {"nonfinite_skipped": 1}
        sums["train_s"] = time.perf_counter() - t0
        self._pending.append(sums)

    def _skip_nonfinite(self, loss: float, grad_norm: float) -> None:
        """Drop this update's gradients (no optimizer step); too many in a row end training."""
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_in_a_row += 1
        limit = self.cfg.max_nonfinite_steps
        log.warning("trainer step %d: skipped an optimizer update, its loss is %s and its "
                    "gradient norm %s (%d in a row; trainer.max_nonfinite_steps=%d)",
                    self.version + 1, loss, grad_norm, self.nonfinite_in_a_row, limit)
        if self.nonfinite_in_a_row >= limit:
            raise NonFiniteTraining(
                f"training diverged: {self.nonfinite_in_a_row} optimizer updates in a row up to "
                f"step {self.version + 1} had a non-finite loss or gradient norm (last: loss "
                f"{loss}, gradient norm {grad_norm}); trainer.max_nonfinite_steps={limit}. Resume "
                "from the newest checkpoint with a lower trainer.lr, or look for NaN / inf in the "
                "rewards and log-probs")

    def finish_global_batch(self) -> dict[str, float]:
        """Close the global batch: version += 1; returns the mini-batches' mean stats (over
        those that made an update) and the sums of `train_s` and `nonfinite_skipped`."""
        pending, self._pending = self._pending, []
        self.last_minibatches = pending
        self.version += 1
        keys = dict.fromkeys(key for p in pending for key in p)
        metrics = {}
        for key in keys:
            values = [p[key] for p in pending if key in p]
            metrics[key] = sum(values) / len(values)
        for key in ("train_s", "nonfinite_skipped"):
            metrics[key] = sum(p[key] for p in pending)
        return metrics

    def _loss(self, batch: Batch, num_tokens: int) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs = self.sequence_logprobs(self.model, batch)
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref = self.sequence_logprobs(self.ref_model, batch)
        old, weights, mask, extra = batch.old_logprobs, None, batch.response_mask, {}
        if self.prox_model is not None:
            with torch.no_grad():
                old = self.sequence_logprobs(self.prox_model, batch)
            if self.cfg.old_logprobs == "decoupled":
                weights = torch.exp(old - batch.old_logprobs) * batch.response_mask
                capped = weights > self.cfg.behaviour_weight_cap
                mask = batch.response_mask * ~capped
                n = batch.response_mask.sum().clamp(min=1.0)
                extra = {"behaviour_weight": float(weights.sum() / n),
                         "behaviour_capped": float(capped.sum() / n)}
        loss, stats = policy_loss(logprobs, old, batch.advantages, mask, self.cfg.eps_low,
                                  self.cfg.eps_high, ref, self.cfg.kl_coef, num_tokens, weights)
        return loss, {**stats, **extra}

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The weights to publish: a detached view of every parameter (no copy)."""
        return {name: p.detach() for name, p in self.model.named_parameters()}

    # ----------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self, path: str | Path, tokenizer: PreTrainedTokenizerBase,
                        extra: dict[str, Any] | None = None) -> Path:
        """Write atomically: into `path.tmp`, then rename; a crash never leaves half a checkpoint."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.model.save_pretrained(tmp / "model")
        tokenizer.save_pretrained(tmp / "model")
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                    "python": random.getstate()}, tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps({"version": self.version, **(extra or {})}))
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        return path

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer, version and RNG; returns the caller state saved with it."""
        from transformers import AutoModelForCausalLM

        path = Path(path)
        saved = AutoModelForCausalLM.from_pretrained(path / "model", dtype=torch.float32)
        self.model.load_state_dict(saved.state_dict())
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        rng = torch.load(path / "rng.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        extra = json.loads((path / "trainer_state.json").read_text())
        self.version = extra.pop("version")
        return extra
