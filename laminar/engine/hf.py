"""Static-batch generation on `transformers.generate`: the baseline the native engine is measured
against, and the simplest backend that works with any Hugging Face causal LM.

Requests are cut into batches of at most `max_batch_size`; each batch is left-padded and runs
until its longest member finishes (the static-batching cost on long tails). Per-token log-probs
come from the processed scores, i.e. under the sampling distribution (temperature, top-k, top-p),
which is the behaviour policy the PPO ratio needs. Per-request seeds are not supported here
(one `generate` call shares one RNG); the native engine has them.

Not a `RolloutEngine` (laminar/engine/protocol.py): a static batch cannot admit a request while
another decodes, so there is no `add`/`step`/`abort`, and no KV accounting for `stats`. It offers
`generate` and `load_weights` (a `WeightTarget`), which is what benchmarks and offline
evaluation use; training refuses `rollout.engine.backend: hf` (laminar/config/rollout.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from transformers import GenerationConfig, PreTrainedModel

from laminar.types import GenerationRequest, SamplingParams


class HFEngine:
    backend = "hf"

    def __init__(self, model: PreTrainedModel, eos_token_id: int, pad_token_id: int,
                 max_batch_size: int = 64, version: int = 0) -> None:
        self.model = model.eval()
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.version = version
        self.num_generated_tokens = 0

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                     version: int) -> None:
        """Copy new weights into the model in place and stamp `version` on later requests."""
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in items:
                if name in params:
                    params[name].copy_(torch.as_tensor(tensor))
        self.version = version

    def close(self) -> None:
        """Nothing to free beyond what garbage collection does."""

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        """Finish every request; returns them (same objects, same order) with outputs filled."""
        for start in range(0, len(requests), self.max_batch_size):
            batch = requests[start:start + self.max_batch_size]
            by_params: dict[tuple, list[GenerationRequest]] = {}
            for req in batch:
                p = req.params
                if p.stop_sequences:
                    raise ValueError(f"request '{req.request_id}' has stop_sequences; the hf "
                                     "baseline engine does not support them (use the native one)")
                key = (p.temperature, p.top_p, p.top_k, p.stop_token_ids)
                by_params.setdefault(key, []).append(req)
            for group in by_params.values():
                self._generate_batch(group)
        return requests

    @torch.no_grad()
    def _generate_batch(self, batch: list[GenerationRequest]) -> None:
        params = batch[0].params
        contexts = [req.prompt_ids + req.output_ids for req in batch]
        budgets = [req.params.max_new_tokens - len(req.output_ids) for req in batch]
        width = max(len(c) for c in contexts)
        device = next(self.model.parameters()).device
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long,
                               device=device)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long, device=device)
        for row, ctx in enumerate(contexts):
            input_ids[row, width - len(ctx):] = torch.tensor(ctx, device=device)
            attention_mask[row, width - len(ctx):] = 1
        stop_ids = [self.eos_token_id, *params.stop_token_ids]
        out = self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask,
            generation_config=self._generation_config(params, max(budgets), stop_ids),
        )
        sequences = out.sequences[:, width:]
        # scores: one [batch, vocab] tensor per generated position, after the logits processors
        logprobs = torch.stack(out.scores, dim=1).log_softmax(-1)
        token_logprobs = logprobs.gather(-1, sequences[:, :logprobs.shape[1], None]).squeeze(-1)
        for row, req in enumerate(batch):
            ids = sequences[row].tolist()
            n, reason = budgets[row], "length"
            for i, tok in enumerate(ids[:budgets[row]]):
                if tok in stop_ids:
                    n, reason = i + 1, ("eos" if tok == self.eos_token_id else "stop")
                    break
            req.output_ids.extend(ids[:n])
            req.logprobs.extend(token_logprobs[row, :n].tolist())
            req.token_versions.extend([self.version] * n)
            req.finish_reason = reason
            if req.version is None:
                req.version = self.version
            self.num_generated_tokens += n

    def _generation_config(self, params: SamplingParams, max_new_tokens: int,
                           stop_ids: list[int]) -> GenerationConfig:
        sampling = dict(do_sample=False) if params.is_greedy else dict(
            do_sample=True, temperature=params.temperature,
            top_k=params.top_k, top_p=params.top_p)  # explicit: generate's default top_k is 50
        return GenerationConfig(
            max_new_tokens=max_new_tokens, eos_token_id=stop_ids,
            pad_token_id=self.pad_token_id, output_scores=True, return_dict_in_generate=True,
            **sampling)
