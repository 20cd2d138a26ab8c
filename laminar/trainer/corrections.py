"""Off-policy corrections: how much each token of the PPO-clip objective counts when it was
sampled by another policy than the one the trainer clips against (an older version, or the same
weights in another engine's numerics).

Every correction is a pure function of the per-token log-ratio

    log_rho = log pi_prox - log pi_behaviour            [B, T]

(pi_prox: the trainer's weights at the start of the global batch, recomputed; pi_behaviour: the
log-probs the engine sampled the token with, at the version stamped on its trajectory, exact in
laminar since one trajectory = one version) and the 0/1 mask of trained tokens [B, T]. It
returns per-token weights [B, T] that multiply each token's clipped surrogate (no gradient
flows through them); 0 drops a token. The surrogate itself is clipped around pi_prox
(decoupled PPO's frame), so a correction replaces the staleness correction that PPO-clip
against pi_behaviour makes implicitly.

Parts: one function per correction (`tis`, `mis`, `icepop`, `geo_mask`, `decoupled`, `m2po`),
`correction_weights` to pick one from a `CorrectionConfig` with its step-row statistics.
Rows outside the mask get weight 0 everywhere.
"""

from __future__ import annotations

import torch

from laminar.config import CorrectionConfig


def _sequence_log_ratio(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The log of the sequence's ratio, prod_t rho_t over its trained tokens: [B, 1]."""
    return (log_rho * mask).sum(dim=-1, keepdim=True)


def tis(log_rho: torch.Tensor, mask: torch.Tensor, cap: float,
        level: str = "token") -> torch.Tensor:
    """Truncated importance sampling: w = min(rho, cap), of each token or of the whole sequence.
    Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
    (token level, cap 2); verl `rollout_is` token / sequence (docs/algo/rollout_corr.md)."""
    ratio = log_rho if level == "token" else _sequence_log_ratio(log_rho, mask)
    return torch.exp(ratio).clamp(max=cap).expand_as(log_rho) * mask


def mis(log_rho: torch.Tensor, mask: torch.Tensor, low: float, high: float,
        level: str = "token") -> torch.Tensor:
    """Masked importance sampling as rejection: a token (or every token of a sequence) whose
    ratio leaves [low, high] is dropped, the others count 1 (verl's rejection sampling
    `rollout_rs` token / sequence; TRL's `token_mask` / `sequence_mask` keep the weight too,
    which is `icepop` at token level here)."""
    ratio = log_rho if level == "token" else _sequence_log_ratio(log_rho, mask)
    rho = torch.exp(ratio)
    keep = (rho >= low) & (rho <= high)
    return keep.expand_as(log_rho).to(mask.dtype) * mask


def icepop(log_rho: torch.Tensor, mask: torch.Tensor, low: float = 0.5,
           high: float = 5.0) -> torch.Tensor:
    """IcePop: w = rho inside [low, high], 0 outside (per token). Ling Team 2025, "Every Step
    Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model" (Ring-1T, arXiv
    2510.18855), M(k) = k if k in [alpha, beta] else 0, alpha 0.5, beta 5; verl's "0.5_5.0"."""
    rho = torch.exp(log_rho)
    return torch.where((rho >= low) & (rho <= high), rho, torch.zeros_like(rho)) * mask


def geo_mask(log_rho: torch.Tensor, mask: torch.Tensor, low: float = 0.99,
             high: float = 1.01) -> torch.Tensor:
    """Geometric-mean sequence mask: g = exp(mean_t log rho_t) over the sequence's trained
    tokens; the whole sequence counts 1 inside [low, high], 0 outside (SkyRL's recommended
    [0.99, 1.01]; verl `geo_rs`). Length-independent, unlike the sequence product."""
    n = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    g = torch.exp(_sequence_log_ratio(log_rho, mask) / n)
    keep = (g >= low) & (g <= high)
    return keep.expand_as(log_rho).to(mask.dtype) * mask


def decoupled(log_rho: torch.Tensor, mask: torch.Tensor, cap: float = 5.0) -> torch.Tensor:
    """Decoupled PPO: w = pi_prox / pi_behaviour, tokens above `cap` dropped. Fu et al. 2025,
    "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning"
    (arXiv 2505.24298), eq. 5; `behav_imp_weight_cap`."""
    rho = torch.exp(log_rho)
    return torch.where(rho > cap, torch.zeros_like(rho), rho) * mask


def m2po(log_rho: torch.Tensor, mask: torch.Tensor, tau: float = 0.04) -> torch.Tensor:
    """Second-moment mask: drop the tokens of largest (log rho)^2, one at a time, until the
    kept tokens' mean (log rho)^2 is <= tau; the kept ones count 1. Zheng et al. 2025,
    "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?"
    (M2PO, arXiv 2510.01161), tau = 0.04. The paper takes the moment over a batch; here it is
    over the tensors given (one micro-batch), and laminar keeps the PPO clip around it."""
    m2 = log_rho.square()
    flat = m2[mask > 0]
    keep = torch.zeros_like(mask)
    if flat.numel() == 0:
        return keep
    ordered = flat.sort().values  # ascending: the running mean of a prefix only grows
    prefix_mean = ordered.cumsum(0) / torch.arange(1, ordered.numel() + 1, dtype=ordered.dtype)
    kept = int((prefix_mean <= tau).sum())
    if kept == 0:
        return keep
    keep_flat = torch.zeros_like(flat)
    order = flat.argsort(stable=True)  # ties at the threshold: the first ones in order kept
    keep_flat[order[:kept]] = 1.0
    keep[mask > 0] = keep_flat
    return keep * mask


def correction_weights(cfg: CorrectionConfig, log_rho: torch.Tensor,
                       mask: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The weights of `cfg.kind` (None for `none`: every token counts 1) and their statistics
    over the trained tokens: `correction_weight_mean`, `correction_masked` (share dropped,
    weight 0) and `correction_clipped` (share whose weight was truncated: `tis` only)."""
    log_rho = log_rho.detach().float()
    mask = mask.float()
    kind = cfg.kind
    if kind == "none":
        return None, {}
    if kind == "tis":
        w = tis(log_rho, mask, cfg.cap, cfg.level)
    elif kind == "mis":
        w = mis(log_rho, mask, cfg.low, cfg.high, cfg.level)
    elif kind == "icepop":
        w = icepop(log_rho, mask, cfg.low, cfg.high)
    elif kind == "geo_mask":
        w = geo_mask(log_rho, mask, cfg.low, cfg.high)
    elif kind == "decoupled":
        w = decoupled(log_rho, mask, cfg.cap)
    elif kind == "m2po":
        w = m2po(log_rho, mask, cfg.tau)
    else:
        raise ValueError(f"trainer.correction.kind={kind!r} is not a correction")
    n = mask.sum().clamp(min=1.0)
    clipped = (w >= cfg.cap) & (mask > 0) if kind == "tis" else mask < 0  # tis: w = min(rho, cap)
    stats = {"correction_weight_mean": float((w * mask).sum() / n),
             "correction_masked": float(((w == 0) & (mask > 0)).sum() / n),
             "correction_clipped": float(clipped.sum() / n)}
    return w, stats
