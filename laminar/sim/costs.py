"""What things cost on the paper's testbed (H800, §8.1): the simulator's physics.

Parts:
- `ModelSpec` / `QWEN25`: the three Qwen2.5 models (sizes from their public configs).
- `DecodeCurve`: seconds per decode step of one replica as a function of batch size and KV
  tokens, with closed forms for n steps while the KV grows (`steps_s`, `steps_within`).
  `decode_curve` builds it from a roofline fitted to the paper's Fig. 4 (`fit_fig4`).
- `prefill_s`, `kv_capacity_tokens`, `roofline_batch`: the rest of a rollout replica.
- `train_s`: trainer time for a set of trajectories on G GPUs (FLOPs / (G * peak * MFU) plus
  per-optimizer-step FSDP traffic).
- Weight movement: `global_sync_s` (NCCL-style broadcast to every rollout, fitted to Fig. 14),
  `relay_broadcast_s` (Appendix D chain model, T_byte and T_start fitted to Fig. 18's 32B row),
  `relay_pull_s` and `actor_push_s` (linear in model bytes, fitted to Fig. 14).

Constants measured by the paper are fitted here once, deterministically; everything tuned by
hand lives in `calibration.Calibration`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from laminar.sim import paper

GPU_MEM_BYTES = 80e9  # H800-80GB
GPU_BF16_FLOPS = 989e12  # dense
NVLINK_BYTES_PER_S = 400e9  # within a machine, per §8.1
NET_BYTES_PER_S_PER_GPU = 50e9  # 8 x 400 Gbps per machine


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int = 128

    @property
    def weight_bytes(self) -> float:  # bf16
        return 2.0 * self.params

    @property
    def kv_bytes_per_token(self) -> float:  # K and V, every layer, bf16
        return 2.0 * self.layers * self.kv_heads * self.head_dim * 2.0


QWEN25 = {
    "7b": ModelSpec("7b", 7.62e9, 28, 3584, 4),
    "32b": ModelSpec("32b", 32.8e9, 64, 5120, 8),
    "72b": ModelSpec("72b", 72.7e9, 80, 8192, 8),
}


@dataclass(frozen=True, slots=True)
class DecodeCurve:
    """One decode step of a replica: base_s + per_seq_s * b + per_kv_s * kv (kv = real tokens
    in its KV cache). Every running sequence emits one token per step, so kv grows by b."""

    base_s: float
    per_seq_s: float
    per_kv_s: float

    def step_s(self, b: int, kv: float) -> float:
        return self.base_s + self.per_seq_s * b + self.per_kv_s * kv

    def steps_s(self, b: int, kv: float, n: int) -> float:
        """Time of n consecutive steps with b sequences, starting at kv tokens."""
        return n * self.step_s(b, kv) + self.per_kv_s * b * n * (n - 1) / 2.0

    def steps_within(self, b: int, kv: float, dt: float) -> int:
        """The most whole steps that fit in dt seconds (inverse of `steps_s`)."""
        if dt <= 0:
            return 0
        s0, a = self.step_s(b, kv), self.per_kv_s * b / 2.0
        if a <= 0:
            return int(dt / s0)
        # a n^2 + (s0 - a) n - dt = 0
        n = int((-(s0 - a) + math.sqrt((s0 - a) ** 2 + 4 * a * dt)) / (2 * a))
        tol = dt * 1e-12  # the closed form and a sum of steps may differ in the last bit
        while n > 0 and self.steps_s(b, kv, n) > dt + tol:
            n -= 1
        while self.steps_s(b, kv, n + 1) <= dt + tol:
            n += 1
        return n


@lru_cache(maxsize=None)
def fit_fig4() -> tuple[float, float, float, float]:
    """Least-squares roofline through every Fig. 4 point:
    ms = c0 + c_tp * layers * [tp > 1] + bytes_read / BW + flops / F, where a step reads the
    weight shard and the KV shard, and computes 2 * params / tp FLOPs per sequence.
    Returns (c0 ms, c_tp ms per layer, ms per GB read, ms per TFLOP)."""
    rows, ys = [], []
    for (name, tp), points in paper.FIG4_DECODE_MS.items():
        m = QWEN25[name]
        for b, ms in points.items():
            rows.append(_fig4_features(m, tp, b * paper.FIG4_SEQ_LEN, b))
            ys.append(ms)
    coef = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)[0]
    return tuple(float(c) for c in coef)  # type: ignore[return-value]


def _fig4_features(m: ModelSpec, tp: int, kv_tokens: float, b: int) -> list[float]:
    gb_read = (m.weight_bytes + m.kv_bytes_per_token * kv_tokens) / tp / 1e9
    return [1.0, m.layers * (tp > 1), gb_read, 2.0 * m.params / tp * b / 1e12]


def decode_curve(m: ModelSpec, tp: int, step_overhead_s: float = 0.0,
                 seq_overhead_s: float = 0.0) -> DecodeCurve:
    """Fig. 4's roofline for (model, TP), plus the RL setting's overheads (calibration)."""
    c0, c_tp, ms_per_gb, ms_per_tflop = fit_fig4()
    base_ms = c0 + c_tp * m.layers * (tp > 1) + ms_per_gb * m.weight_bytes / tp / 1e9
    return DecodeCurve(
        base_s=base_ms / 1e3 + step_overhead_s,
        per_seq_s=ms_per_tflop * 2.0 * m.params / tp / 1e12 / 1e3 + seq_overhead_s,
        per_kv_s=ms_per_gb * m.kv_bytes_per_token / tp / 1e9 / 1e3)


def prefill_s(m: ModelSpec, tp: int, tokens: float, sum_sq: float, mfu: float) -> float:
    """Prefill `tokens` context tokens (sum_sq = sum of squared lengths, for attention)."""
    flops = 2.0 * m.params * tokens + 2.0 * m.layers * m.hidden * sum_sq
    return flops / (tp * GPU_BF16_FLOPS * mfu)


def kv_capacity_tokens(m: ModelSpec, tp: int, mem_util: float, reserve_gb: float) -> int:
    """Tokens of KV a replica holds: its share of GPU memory minus weights and activations."""
    free = tp * (GPU_MEM_BYTES * mem_util - reserve_gb * 1e9) - m.weight_bytes
    if free <= 0:
        raise ValueError(f"{m.name} does not fit on TP{tp} at gpu memory utilisation {mem_util}")
    return int(free / m.kv_bytes_per_token)


def roofline_batch(curve: DecodeCurve, ctx: int, factor: float) -> int:
    """Algorithm 1's B: the batch at which a step costs `factor` x a batch-1 step (decode
    stops being memory-bound; §5.2 gives no number, Fig. 4 doubles between 64 and 128)."""
    one = curve.step_s(1, ctx)
    per_b = curve.per_seq_s + curve.per_kv_s * ctx
    if per_b <= 0:  # a flat curve (a measured one can be): never compute-bound
        return 1 << 30
    return max(1, int(1 + (factor - 1.0) * one / per_b))


def train_s(m: ModelSpec, gpus: int, tokens: float, sum_sq: float, n_steps: int,
            mfu: float, tp_pp: tuple[int, int] = (1, 1),
            mb_tokens: float = float("inf"), recompute_logprobs: bool = True) -> float:
    """Trainer time for trajectories with `tokens` prompt+response tokens in total and
    `sum_sq` = sum of squared lengths, in `n_steps` optimizer steps. FLOPs: forward+backward
    (6P) per token, plus the old-log-prob forward (2P) when `recompute_logprobs` (the trainer
    recomputes the behaviour or proximal log-probs instead of using the rollout's), and
    causal attention. Each step also
    all-gathers and reduce-scatters the FSDP shards (3x the weights through every GPU's link:
    NVLink within a machine, the network across); prefetching overlaps that traffic with
    compute, so a step costs whichever is longer.

    With pipeline parallelism (`tp_pp` = Megatron's (TP, PP), pp > 1) a step is a 1F1B
    pipeline over the micro-batches of one data-parallel rank: its share of the step's
    tokens, cut into micro-batches of at most `mb_tokens`. m micro-batches through p stages
    take (m + p - 1) / m of the bubble-free time. Strong scaling adds data-parallel ranks,
    so each rank has fewer micro-batches and the bubble grows."""
    passes = 4.0 if recompute_logprobs else 3.0  # forward = 1, backward = 2, recompute = 1
    flops = passes * (2.0 * m.params * tokens + 2.0 * m.layers * m.hidden * sum_sq)
    compute = flops / (gpus * GPU_BF16_FLOPS * mfu)
    tp, pp = tp_pp
    compute *= pipeline_stretch(tokens / max(n_steps, 1), gpus // (tp * pp) or 1, pp, mb_tokens)
    if gpus <= 1:
        return compute
    bw = NVLINK_BYTES_PER_S if gpus <= paper.GPUS_PER_MACHINE else NET_BYTES_PER_S_PER_GPU
    return n_steps * max(compute / n_steps, 3.0 * m.weight_bytes / bw)


def pipeline_stretch(step_tokens: float, dp: int, pp: int, mb_tokens: float) -> float:
    """(m + p - 1) / m for a 1F1B pipeline of p stages over m micro-batches, where m is one
    data-parallel rank's share of a step's tokens in micro-batches of at most mb_tokens."""
    if pp <= 1:
        return 1.0
    mbs = max(1, math.ceil(step_tokens / dp / mb_tokens)) if mb_tokens < float("inf") else 0
    return (mbs + pp - 1) / mbs if mbs else 1.0


# --- weight movement --------------------------------------------------------------------

@lru_cache(maxsize=None)
def _fit_fig14_sync() -> tuple[float, float]:
    """Global sync seconds = weight GB * (a + b * log2(rollout GPUs)), least squares over
    Fig. 14's four global-sync points."""
    rows, ys = [], []
    for name, d in paper.FIG14.items():
        gb = QWEN25[name].weight_bytes / 1e9
        for n, s in zip(paper.FIG14_ROLLOUT_GPUS, d["global_sync"]):
            rows.append([gb, gb * math.log2(n)])
            ys.append(s)
    a, b = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)[0]
    return float(a), float(b)


def global_sync_s(m: ModelSpec, rollout_gpus: int) -> float:
    """The baselines' NCCL broadcast from the trainer to every rollout (Fig. 14)."""
    a, b = _fit_fig14_sync()
    return m.weight_bytes / 1e9 * (a + b * math.log2(max(rollout_gpus, 2)))


def _per_gb(key: str) -> float:
    pts = [(QWEN25[n].weight_bytes / 1e9, d[key]) for n, d in paper.FIG14.items()]
    return sum(s for _, s in pts) / sum(gb for gb, _ in pts)


def relay_pull_s(m: ModelSpec) -> float:
    """A rollout loading the newest version from its local relay over PCIe (Fig. 14's best
    case: 0.57 s for 32B, 1.30 s for 72B, ~8.8 ms per GB)."""
    return m.weight_bytes / 1e9 * _per_gb("laminar_best")


def actor_push_s(m: ModelSpec) -> float:
    """The trainer's stall while handing a version to the master relay (0.64 s / 1.40 s)."""
    return m.weight_bytes / 1e9 * _per_gb("actor_stall")


def chain_s(weight_bytes: float, relays: int, t_byte: float, t_start: float) -> float:
    """Appendix D, Eq. 1 at the optimal chunk count k*: p = relays in the chain (master
    included). T* = M T_byte + (p-2) T_start + 2 sqrt((p-2) M T_byte T_start)."""
    p = max(relays, 2)
    mt = weight_bytes * t_byte
    return mt + (p - 2) * t_start + 2.0 * math.sqrt((p - 2) * mt * t_start)


@lru_cache(maxsize=None)
def fit_fig18(model: str = "32b") -> tuple[float, float]:
    """(T_byte, T_start) of the chain model fitted to one row of Fig. 18 by a log-spaced grid
    search (deterministic). The other row is then a prediction."""
    m = QWEN25[model]
    p = np.array(paper.FIG18_MACHINES, dtype=float)[None, None, :]
    measured = np.array(paper.FIG18[model])
    t_byte = (1.0 / np.geomspace(20e9, 2000e9, 400))[:, None, None]
    t_start = np.geomspace(1e-6, 1e-1, 400)[None, :, None]
    mt = m.weight_bytes * t_byte
    pred = mt + (p - 2) * t_start + 2.0 * np.sqrt((p - 2) * mt * t_start)
    err = np.sum((np.log(pred) - np.log(measured)) ** 2, axis=2)
    i, j = np.unravel_index(int(np.argmin(err)), err.shape)
    return float(t_byte[i, 0, 0]), float(t_start[0, j, 0])


def relay_broadcast_s(m: ModelSpec, machines: int) -> float:
    """Master relay to every other relay (one per rollout machine), pipelined chain."""
    t_byte, t_start = fit_fig18()
    return chain_s(m.weight_bytes, machines, t_byte, t_start)
