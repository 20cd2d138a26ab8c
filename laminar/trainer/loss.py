"""The policy loss: PPO with Clip-Higher, token-level mean (DAPO), optional KL.

Simplifications, stated: GRPO has no value model (advantages come from group normalisation and
are shared by every token of a response); the importance ratio is taken against the behaviour
log-probs the engine recorded at generation, with no extra correction for staleness, unless
the trainer passes recomputed proximal log-probs and the off-policy correction's per-token
weights (`behaviour_weights`, laminar/trainer/corrections.py); the KL term (off by default) is the k3 estimator against a frozen
reference model.

The engine-trainer mismatch (`fresh_abs_diffs`, `abs_diff_summary`): on tokens sampled by the
very weights the trainer computes with (staleness 0), |engine log-prob - trainer log-prob| is
the two implementations' numerics alone; the step row reports its mean and p99. Over every
trained token (`mismatch_summary`), staleness adds to it: |log-ratio|, the k3 KL estimate and
the importance ratio's percentiles; `token_entropy` is the trained tokens' entropy.

All functions are pure; shapes are [batch, time] with a 0/1 mask over response tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, eps_low: float = 0.2, eps_high: float = 0.28,
                ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0,
                num_tokens: int | float | None = None,
                behaviour_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate summed over masked tokens and divided by `num_tokens` (default: the
    tokens in this batch). Pass the token count of the whole mini-batch when accumulating
    gradients over micro-batches, so the result is the token-level mean of the mini-batch.

    logprobs, old_logprobs, mask: [B, T]; advantages: [B] (broadcast over tokens).
    behaviour_weights [B, T] (an off-policy correction, corrections.py): old_logprobs are then
    the proximal policy's and each token's surrogate is multiplied by its weight (no gradient).
    """
    mask = mask.to(logprobs.dtype)
    adv = advantages[:, None].to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    if behaviour_weights is not None:
        per_token = per_token * behaviour_weights.detach().to(per_token.dtype)
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None and kl_coef > 0:
        log_r = ref_logprobs - logprobs
        kl = torch.exp(log_r) - log_r - 1.0  # k3: unbiased, always >= 0
        per_token = per_token + kl_coef * kl
    denom = float(num_tokens) if num_tokens is not None else mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / denom
    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        metrics = {
            "clip_frac": float(((unclipped < clipped).to(mask.dtype) * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
            "kl": float((kl * mask).sum() / n),
        }
    return loss, metrics


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(tokens) under softmax(logits / temperature). logits [B, T, V], tokens [B, T] -> [B, T]."""
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def fresh_abs_diffs(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                    mask: torch.Tensor, token_versions: torch.Tensor, version: int) -> torch.Tensor:
    """|engine - trainer| log-prob of every trained token (`mask` > 0) that weights `version`
    sampled (`token_versions` == version), where `trainer_logprobs` were computed with exactly
    the weights published as `version`. All [B, T]; returns a 1-D float32 CPU tensor (maybe
    empty), no gradient."""
    keep = (mask > 0) & (token_versions == version)
    return (engine_logprobs.detach().float() - trainer_logprobs.detach().float()).abs()[keep].cpu()


def _percentile(ordered: torch.Tensor, q: float) -> float:
    """The q-th quantile (0..1) of sorted values, linear between order statistics (numpy's)."""
    pos = q * (ordered.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, ordered.numel() - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


def _cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([d.reshape(-1).double() for d in parts]) if parts else torch.empty(0)


def abs_diff_summary(diffs: Sequence[torch.Tensor]) -> dict[str, float | None]:
    """`logprob_abs_diff_mean` and `logprob_abs_diff_p99` (linear interpolation between the
    order statistics, as numpy.percentile) of all the values in `diffs`; both None when there
    are none."""
    values = _cat(diffs)
    if values.numel() == 0:
        return {"logprob_abs_diff_mean": None, "logprob_abs_diff_p99": None}
    return {"logprob_abs_diff_mean": float(values.mean()),
            "logprob_abs_diff_p99": _percentile(values.sort().values, 0.99)}


MISMATCH_KEYS = ("logprob_abs_diff_all_mean", "logprob_abs_diff_all_p99", "mismatch_kl_k3",
                 "is_ratio_p1", "is_ratio_p50", "is_ratio_p99")


def mismatch_summary(log_ratios: Sequence[torch.Tensor]) -> dict[str, float | None]:
    """Over every trained token of a global batch, whatever its staleness, from
    log_rho = log pi_trainer - log pi_behaviour (pi_trainer: the weights the global batch began
    with): |log_rho| mean and p99 (mismatch and staleness together), the k3 estimate of
    KL(pi_behaviour || pi_trainer) = mean(rho - 1 - log rho) (Schulman's k3, sampled from the
    behaviour policy), and the 1st / 50th / 99th percentiles of rho. All None without tokens."""
    values = _cat(log_ratios)
    if values.numel() == 0:
        return dict.fromkeys(MISMATCH_KEYS)
    ordered = values.sort().values  # exp is monotone: rho's percentiles are exp of these
    return {"logprob_abs_diff_all_mean": float(values.abs().mean()),
            "logprob_abs_diff_all_p99": _percentile(values.abs().sort().values, 0.99),
            "mismatch_kl_k3": float((torch.exp(values) - 1.0 - values).mean()),
            "is_ratio_p1": float(torch.exp(torch.tensor(_percentile(ordered, 0.01)))),
            "is_ratio_p50": float(torch.exp(torch.tensor(_percentile(ordered, 0.50)))),
            "is_ratio_p99": float(torch.exp(torch.tensor(_percentile(ordered, 0.99))))}


def token_entropy(logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0,
                  rows: int = 8) -> float:
    """Mean entropy (nats) of softmax(logits / temperature) over the masked positions, `rows`
    sequences at a time so the extra [rows, T, V] stays small. logits [B, T, V], mask [B, T]."""
    total = 0.0
    with torch.no_grad():
        for i in range(0, logits.shape[0], rows):
            chunk = logits[i:i + rows].float()
            if temperature not in (0.0, 1.0):
                chunk = chunk / temperature
            logp = torch.log_softmax(chunk, dim=-1)
            ent = -(logp.exp() * logp).sum(-1)
            total += float((ent * mask[i:i + rows]).sum())
    return total / max(float(mask.sum()), 1.0)
