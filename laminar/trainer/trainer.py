"""The GRPO trainer: one global batch of trajectories in, one new weight version out.

Parts:
- `collate` (batching.py) packs trajectories into right-padded tensors with the behaviour
  log-probs aligned to the positions that predict each response token;
- `Trainer.train_step` computes group advantages, splits the batch into `mini_batches` (one
  AdamW update each; gradients accumulate over length-sorted micro-batches within one), and
  bumps `version` once per global batch; with `old_logprobs=recompute` (any correction implies
  it) the ratio is taken against a copy of the weights as they were when the global batch
  began, and `trainer.correction` (corrections.py) weighs tokens by pi_prox / pi_behaviour.
  Trajectories whose reward failed (`failed` set) are left out before the group advantages;
  an update whose loss or gradient norm is not finite is skipped (`nonfinite_skipped`), and
  `trainer.max_nonfinite_steps` skipped in a row raise `NonFiniteTraining`;
- with `ranks` (trainer.world_size > 1, laminar/trainer/ranks.py) rank 0 plans each mini-batch
  and every rank runs `train_shard` on its share: the model is sharded (FSDP2 `fully_shard`)
  or replicated (DDP), each rank's loss is its tokens' share of the mini-batch's token mean,
  gradients are summed over ranks before clipping, and the statistics are summed too, so one
  update equals the single-rank update on the same batch up to float summation order;
- `save_checkpoint` / `load_checkpoint` (laminar/trainer/checkpoint.py): model and optimizer
  as a torch distributed checkpoint, a Hugging Face export, version, RNG state and any caller
  state (e.g. the data position), atomically; `push` publishes the weights (from every rank's
  shard, laminar/trainer/shards.py);
- with `trainer.lora` the model gets peft adapters on a frozen base (`_with_lora`), the optimizer
  holds only the adapters, and a pushed version holds only them (`adapter_weights`: A, and B
  pre-multiplied by alpha / r, named after the base's modules; laminar/engine/lora.py merges
  them at the rollout); `merged_state_dict` is the base with the adapters merged in;
- the engine-trainer mismatch: the trained tokens of a global batch that the weights of the
  trainer's current version sampled (staleness 0) are compared with the log-probs of exactly
  those weights: the first forward of each mini-batch before the global batch's first optimizer
  step, or the proximal copy's (recompute: those weights all through the global batch); the
  ranks gather every value, and the global batch reports `logprob_abs_diff_mean` / `_p99`
  (None without such a token; loss.py `abs_diff_summary`);
  over every trained token, stale ones too, the same weights give `mismatch_summary`'s keys.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from laminar.config import ConfigError, TrainerConfig
from laminar.devices import resolve_device, to_host
from laminar.engine.lora import base_dir, merge
from laminar.trainer.advantage import group_advantages
from laminar.trainer.batching import Batch, collate, split_groups
from laminar.trainer.checkpoint import load, save
from laminar.trainer.corrections import correction_weights
from laminar.trainer.loss import (abs_diff_summary, fresh_abs_diffs, mismatch_summary, policy_loss,
                                  token_entropy, token_logprobs)
from laminar.trainer.ranks import Ranks, plan_micro_batches, shard
from laminar.trainer.shards import push_from_shards
from laminar.types import Trajectory

log = logging.getLogger("laminar.trainer")
PUBLISH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # trainer.publish_dtype


class NonFiniteTraining(RuntimeError):
    """`trainer.max_nonfinite_steps` optimizer updates in a row had a NaN or inf loss or
    gradient norm: training has diverged (the service checkpoints and stops the run)."""


class Trainer:
    def __init__(self, model: PreTrainedModel, cfg: TrainerConfig, pad_token_id: int,
                 temperature: float = 1.0, ranks: Ranks | None = None) -> None:
        self.cfg = cfg
        self.ranks = ranks  # None: one process, no process group (trainer.world_size = 1)
        self.world_size = ranks.world_size if ranks else 1
        # trainer.device (laminar/devices.py): a group's ranks resolved it when they joined
        self.device = ranks.device if ranks else resolve_device(cfg.device, "trainer.device")
        self.pad_token_id = pad_token_id
        self.temperature = temperature if temperature > 0 else 1.0
        self.version = 0  # the current weights' version: +1 per step (global batch); a restart may
        # number on past its checkpoint (TrainerService.steps counts the steps themselves)
        self._pending: list[dict[str, float]] = []  # stats of this global batch's mini-batches
        self._prox_due = True  # the first update of a global batch refreshes `prox_model`
        self.nonfinite_in_a_row = 0  # updates skipped for a NaN / inf loss or gradient, in a row
        self.last_minibatches: list[dict[str, float]] = []  # those of the last finished one
        self.weights_are_version = True  # the live weights are exactly those published (or to
        # be published) as `version`: False after an optimizer step until the version closes,
        # and after a restart numbered past its checkpoint (service.py `_recover`)
        self._prox_are_version = False  # the same of `prox_model`, as of its last refresh
        self._lp_diffs: list[torch.Tensor] = []  # this global batch's engine-trainer |diffs|
        self._lp_ratios: list[torch.Tensor] = []  # log pi_start - log pi_behaviour, every token
        model = model.to(self.device).train()
        self.peft_model: Any = None  # trainer.lora: peft's wrapper (save_pretrained of the adapter)
        self.lora_base: str | None = None  # trainer.lora: the model directory of the frozen base
        if cfg.lora is not None:
            model = self._with_lora(model)
        self.ref_model = None
        if cfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.prox_model = None  # the weights at the start of this global batch (recompute modes)
        if cfg.old_logprobs != "rollout":
            self.prox_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.module = model  # the Hugging Face model: parameter names, save_pretrained
        self.model = model  # what forward runs: the same module, or its DDP wrapper
        if ranks is not None:
            self.model = shard(model, ranks, cfg.sharding)
            if self.ref_model is not None:
                self.ref_model = shard(self.ref_model, ranks, cfg.sharding, frozen=True)
            if self.prox_model is not None:
                self.prox_model = shard(self.prox_model, ranks, cfg.sharding, frozen=True)
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters
        self.optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay)

    def _with_lora(self, model: PreTrainedModel) -> PreTrainedModel:
        """trainer.lora: inject peft adapters into `model` (in place; the base frozen) and return
        it: the same Hugging Face model, whose target layers now hold `base_layer`, `lora_A` and
        `lora_B`. Its base is `base_dir` of the directory it was loaded from (a LoRA
        checkpoint's merged `model/` names its run's base; loading the checkpoint restores it)."""
        from peft import LoraConfig, get_peft_model  # peft: only with trainer.lora

        lora = self.cfg.lora
        uses: dict[int, int] = {}  # a weight under two names is tied (lm_head to the embeddings)
        for _, p in model.named_parameters(remove_duplicate=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) and uses[id(m.weight)] == 1})
        for target in lora.target_modules:
            if target not in linear:
                raise ConfigError(f"trainer.lora.target_modules: '{target}' names no linear layer "
                                  f"of this model; its adaptable layers are {linear} (the last "
                                  "part of the dotted name; a weight tied to the embeddings is "
                                  "not adaptable)")
        if model.name_or_path:
            self.lora_base = str(base_dir(model.name_or_path))
        with warnings.catch_warnings():  # peft asks transformers about gradient checkpointing
            warnings.filterwarnings("ignore", category=FutureWarning)
            self.peft_model = get_peft_model(model, LoraConfig(
                r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                lora_dropout=lora.dropout, bias="none"))
        return self.peft_model.base_model.model

    def sequence_logprobs(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        return token_logprobs(self._logits(model, batch), batch.targets, self.temperature)

    def _logits(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """[B, L-1, V]: the logits of the positions that predict each target."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16):
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        return logits[:, :-1]

    def train_step(self, trajs: list[Trajectory]) -> dict[str, float | None]:
        """One global batch: `mini_batches` optimizer updates, then version += 1."""
        for mb in split_groups(trajs, self.cfg.mini_batches):
            self.train_minibatch(mb)
        return self.finish_global_batch()

    def train_minibatch(self, trajs: list[Trajectory]) -> None:
        """One optimizer update on whole groups; gradients accumulate over length-sorted
        micro-batches so the loss is the token-level mean of the mini-batch. Failed samples
        are left out (a group keeps its others); a NaN / inf loss or gradient skips the update.
        With ranks, the mini-batch's sequences are split over them by tokens (`train_shard`)."""
        t0 = time.perf_counter()
        for t in trajs:
            t.staleness = self.version - t.version
        trajs = [t for t in trajs if t.failed is None]
        if not trajs:  # every sample failed: nothing to learn from
            self._pending.append({"train_s": time.perf_counter() - t0, "nonfinite_skipped": 0})
            return
        adv = group_advantages([t.reward for t in trajs], [t.group_id for t in trajs]).tolist()
        num_tokens = sum(len(t.response_ids) if t.loss_mask is None else sum(t.loss_mask)
                         for t in trajs)  # the model's tokens: what the loss averages over
        plan = plan_micro_batches([t.num_tokens for t in trajs], self.world_size,
                                  self.cfg.micro_batch_tokens)
        steps = max(len(micro) for micro in plan)  # every rank runs as many forward passes
        refresh = self._prox_due and self.prox_model is not None
        if refresh:
            self._prox_are_version = self.weights_are_version
        # the log-probs of the weights published as this version: which tokens to compare
        exact = self._prox_are_version if self.prox_model is not None else self.weights_are_version
        measure = self.version if exact else None
        at_start = self.prox_model is not None or self._prox_due  # the global batch's weights
        args = [([([trajs[i] for i in g], [adv[i] for i in g]) for g in micro], num_tokens, steps,
                 refresh, measure, at_start) for micro in plan]
        if self.ranks is None:
            answers = [self.train_shard(*args[0])]
        else:
            answers = self.ranks.call(self, Trainer.train_shard, args)
        sums = answers[0]
        diffs = [answer.pop("lp_abs_diffs") for answer in answers]
        ratios = [answer.pop("lp_log_ratios") for answer in answers]
        self._prox_due = False
        if sums.pop("finite"):
            self.nonfinite_in_a_row = 0
            sums["nonfinite_skipped"] = 0
            if "correction_masked" in sums:  # a share of this mini-batch's tokens: as a count
                sums["correction_dropped_tokens"] = round(sums["correction_masked"] * num_tokens)
            self._lp_diffs += diffs
            self._lp_ratios += ratios
            self.weights_are_version = False  # stepped: no longer the published weights
        else:
            self._skip_nonfinite(sums["loss"], sums["grad_norm"])
            sums = {"nonfinite_skipped": 1}
        sums["train_s"] = time.perf_counter() - t0
        self._pending.append(sums)

    def train_shard(self, micro_batches: list[tuple[list[Trajectory], list[float]]],
                    num_tokens: int, steps: int, refresh_prox: bool,
                    measure: int | None = None, at_start: bool = False) -> dict[str, Any]:
        """This rank's part of one optimizer update (every rank runs it at once): forward and
        backward over its micro-batches (trajectories, advantages), padded to `steps` with empty
        ones, the loss of each divided by the mini-batch's `num_tokens`; then the gradient norm,
        clipping and the step (or no step, on every rank alike, when the summed loss or the
        norm is not finite). Returns the mini-batch's statistics, summed over the ranks, and
        this rank's own `lp_abs_diffs`: |engine - trainer| log-prob of its trained tokens that
        version `measure` sampled (None: the weights at hand are no published version's), and
        `lp_log_ratios`: trainer - engine log-prob of all its trained tokens, when the trainer's
        side is the weights the global batch began with (`at_start`; else empty)."""
        if refresh_prox:  # a new global batch begins: the proximal weights are these
            self.prox_model.load_state_dict(self.module.state_dict())
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        diffs: list[torch.Tensor] = []
        ratios: list[torch.Tensor] = []
        for k in range(steps):
            if k < len(micro_batches):
                trajs, adv = micro_batches[k]
                batch = collate(trajs, torch.tensor(adv), self.pad_token_id).to(self.device)
            else:
                batch = self._empty_batch()
            with self._gradient_sync(k == steps - 1):
                loss, stats, lp = self._loss(batch, num_tokens)
                # DDP and FSDP average gradients over the ranks; each rank's loss is its share
                # of the mini-batch's mean, so scale it back to a sum (exact: a power of two or 1)
                (loss * self.world_size if self.world_size > 1 else loss).backward()
            if measure is not None:
                diffs.append(fresh_abs_diffs(lp, batch.old_logprobs, batch.response_mask,
                                             batch.token_versions, measure))
            if at_start:
                ratios.append((lp.detach().float() - batch.old_logprobs.float())
                              [batch.response_mask > 0].cpu())
            weight = batch.num_response_tokens / num_tokens  # token-weighted average of stats
            if weight == 0:  # an empty micro-batch: same keys on every rank, nothing added
                sums.update({key: sums.get(key, 0.0) for key in [*stats, "loss"]})
                continue
            for key, value in {**stats, "loss": loss.item() / weight}.items():
                sums[key] = sums.get(key, 0.0) + value * weight
        if self.ranks is not None:
            sums = self.ranks.all_reduce_sum(sums)
        sums["lp_abs_diffs"] = torch.cat(diffs) if diffs else torch.empty(0)  # not reduced
        sums["lp_log_ratios"] = torch.cat(ratios) if ratios else torch.empty(0)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        sums["grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        sums["finite"] = math.isfinite(sums["loss"]) and math.isfinite(sums["grad_norm"])
        if sums["finite"]:
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        return sums

    def _gradient_sync(self, last: bool) -> Any:
        """How this micro-batch's gradients meet the other ranks'. DDP: all-reduced only after
        the last micro-batch. FSDP `grad_op`: the layers gathered by the first forward stay
        gathered, and the gradients accumulate unsharded, until the last micro-batch's backward
        reduce-scatters them and reshards: one all-gather and one reduce-scatter per layer per
        update instead of one each per micro-batch (sharded again at rest). FSDP `full`:
        every backward reduce-scatters into the sharded gradients, which then accumulate."""
        if self.world_size > 1 and self.cfg.sharding == "grad_op":
            self.model.set_requires_gradient_sync(last)
            self.model.set_reshard_after_backward(last)
            return contextlib.nullcontext()
        if last or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def _empty_batch(self) -> Batch:
        """A micro-batch with no response tokens (its loss is 0): a rank that has fewer
        micro-batches than another runs these, since every forward and backward is a collective."""
        ids = torch.full((1, 2), self.pad_token_id, dtype=torch.long)
        zeros = torch.zeros((1, 1))
        return Batch(ids, torch.ones_like(ids), ids[:, 1:], zeros, zeros, torch.zeros(1),
                     torch.zeros((1, 1), dtype=torch.long)).to(self.device)

    def _skip_nonfinite(self, loss: float, grad_norm: float) -> None:
        """This update was dropped (no optimizer step); too many in a row end training."""
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

    def finish_global_batch(self) -> dict[str, float | None]:
        """Close the global batch: version += 1; returns the mini-batches' mean stats (over
        those that made an update), the sums of `train_s` and `nonfinite_skipped`, and the
        engine-trainer mismatch of its staleness-0 tokens (`abs_diff_summary`)."""
        pending, self._pending = self._pending, []
        self.last_minibatches = pending
        diffs, self._lp_diffs = self._lp_diffs, []
        ratios, self._lp_ratios = self._lp_ratios, []
        self.version += 1
        self.weights_are_version = True  # these weights are what the new version publishes
        self._prox_due = True
        keys = dict.fromkeys(key for p in pending for key in p)
        metrics = {}
        for key in keys:
            values = [p[key] for p in pending if key in p]
            metrics[key] = sum(values) / len(values)
        for key in ("train_s", "nonfinite_skipped", "correction_dropped_tokens"):
            if any(key in p for p in pending):
                metrics[key] = sum(p.get(key, 0) for p in pending)
        return {**metrics, **abs_diff_summary(diffs), **mismatch_summary(ratios)}

    def _loss(self, batch: Batch, num_tokens: int) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        """The loss, its statistics, and the log-probs of the weights this global batch began
        with: the proximal copy's where there is one, else the live model's (no gradient)."""
        logits = self._logits(self.model, batch)
        logprobs = token_logprobs(logits, batch.targets, self.temperature)
        entropy = token_entropy(logits.detach(), batch.response_mask, self.temperature)
        del logits
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref = self.sequence_logprobs(self.ref_model, batch)
        old, weights, mask, extra = batch.old_logprobs, None, batch.response_mask, {}
        if self.prox_model is not None:
            with torch.no_grad():
                old = self.sequence_logprobs(self.prox_model, batch)
            weights, extra = correction_weights(self.cfg.correction, old - batch.old_logprobs,
                                                batch.response_mask)
            if weights is not None:  # a dropped token leaves the clip statistics too
                mask = batch.response_mask * (weights > 0)
        loss, stats = policy_loss(logprobs, old, batch.advantages, mask, self.cfg.eps_low,
                                  self.cfg.eps_high, ref, self.cfg.kl_coef, num_tokens, weights)
        start = old if self.prox_model is not None else logprobs.detach()
        return loss, {**stats, **extra, "entropy": entropy}, start

    # ------------------------------------------------------------------------- weights out

    def named_weights(self) -> dict[str, torch.Tensor]:
        """One process: the weights to publish, a detached view of every parameter (no copy);
        with trainer.lora only the adapters (`adapter_weights`)."""
        if self.cfg.lora is not None:
            return self.adapter_weights()
        dtype = self.publish_dtype
        return {name: p.detach() if p.dtype == dtype or dtype is None else p.detach().to(dtype)
                for name, p in self.module.named_parameters()}

    @property
    def publish_dtype(self) -> torch.dtype | None:
        """trainer.publish_dtype as a torch dtype; None (`auto` unresolved, as in a bare
        TrainerConfig): the master weights' own."""
        return PUBLISH_DTYPES.get(self.cfg.publish_dtype)

    def lora_layers(self) -> dict[str, Any]:
        """trainer.lora: the adapted layers by the base model's dotted module name."""
        from peft.tuners.lora import LoraLayer  # peft: only with trainer.lora

        return {name: m for name, m in self.module.named_modules() if isinstance(m, LoraLayer)}

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """trainer.lora: what a version holds (laminar/engine/lora.py): `<module>.lora_A`
        [r, in] and `<module>.lora_B` [out, r] multiplied by alpha / r, `<module>` named as in
        the base model's state_dict. A is a detached view, B a small scaled copy."""
        out = {}
        with torch.no_grad():
            for name, layer in self.lora_layers().items():
                out[f"{name}.lora_A"] = layer.lora_A["default"].weight.detach()
                out[f"{name}.lora_B"] = layer.lora_B["default"].weight.detach() * layer.scaling["default"]
        return out

    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """trainer.lora: the base model's state_dict with W0 + B @ A in every adapted layer (what
        a rollout loads after pulling this version; the checkpoint's `model/` export)."""
        state = {name.replace(".base_layer.", "."): t.detach()
                 for name, t in self.module.state_dict().items() if ".lora_" not in name}
        return {**state, **merge(state, self.adapter_weights())}

    def push(self, sink: Any, version: int, chunk_bytes: int) -> float:
        """Publish the current weights as `version` through `sink` (a `WeightSink`); returns
        the stall in seconds. With ranks every rank writes its own rows (shards.py) into
        a version of `chunk_bytes` chunks; with trainer.lora (DDP: rank 0 holds every adapter)
        rank 0 pushes the adapters alone. On a GPU the tensors go to the sink as they are: the
        relay's writer copies each from the device into the master relay's host memory."""
        if self.ranks is None or self.cfg.lora is not None:
            named = self.named_weights()
            if self.device.type != "cpu" and not hasattr(sink, "push_parts"):
                named = to_host(named)  # a sink that keeps what it is handed gets host copies
            return sink.push(named, version)  # the relay's writer copies device -> its slot
        return push_from_shards(self, sink, version, chunk_bytes)

    def save_checkpoint(self, path: str | Path, tokenizer: PreTrainedTokenizerBase,
                        extra: dict[str, Any] | None = None) -> Path:
        """Write atomically: into `path.tmp`, then rename; a crash never leaves half a checkpoint."""
        return save(self, Path(path), tokenizer, extra or {})

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer, version and RNG; returns the caller state saved with it."""
        extra = load(self, Path(path))
        self.weights_are_version = True  # the weights saved as its version
        return extra
