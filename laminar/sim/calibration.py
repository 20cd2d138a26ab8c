"""The one place where the simulator is calibrated: every constant not measured by the paper.

`Calibration()` (the defaults) is what `laminar simulate` and docs/simulator.md use. Every
field says where its value comes from. "Fitted on the fit set" means chosen by `fit.py`'s
search against the Fig. 11 ratios of `split.FIT_POINTS` only (7B @ 16-128, 32B @ 32-256);
the held-out points (every 72B point, 7B @ 256, 32B @ 512) never entered it. `fit.FITTED`
lists those constants (13). Nothing here is per model, per scale or per system
beyond what the paper itself states (Table 2 allocations, App. A.2 parallelism, Table 3 batch
sizes live in `paper.py`); the fitted physics (Fig. 4 decode roofline, Fig. 14 sync times,
Fig. 18 chain constants) lives in `costs.py` and is fitted there from the paper's points.

`Calibration.from_json` reads a file with any of these fields (unknown keys are an error),
plus an optional `local` block describing a machine that is not the paper's testbed; see
`local.py`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Calibration:
    # --- rollout engine in the RL setting -------------------------------------------------
    step_overhead_ms: float = 0.0
    """Fixed cost added to every decode step over Fig. 4's microbenchmark (scheduler, sampler
    with log-probs, data streaming). Fitted on the fit set (fit.py): none."""
    seq_overhead_ms: float = 0.01
    """Per running sequence per step on top of Fig. 4, on every replica (per-sequence
    sampling and log-prob work). Fitted on the fit set: 0.01 ms."""
    tp_seq_overhead_ms: float = 0.065
    """Per running sequence per step, more, on replicas with TP > 1 (32B TP4, 72B TP8, the
    baselines' 7B TP2). Fig. 9's 32B TP4 replica is more than twice as slow as Fig. 4's
    roofline, while Fig. 11's laminar 7B TP1 rates fit Fig. 4 as it is; a per-sequence cost
    slows the bulk of a batch but not a lone trajectory in the tail. Fitted on the fit set:
    0.065 ms (Fig. 9 alone would ask ~0.2 ms; docs/simulator.md)."""
    gpu_mem_util: float = 0.8
    """Fraction of GPU memory the rollout engine may use (vLLM's gpu_memory_utilization) of
    laminar's and AReaL's rollouts. Hand-set, not searched: vLLM's own default is 0.9, and
    0.8 was chosen with the Fig. 9 replica in view."""
    colocated_mem_util: float = 0.45
    """The same for verl's colocated rollout, which shares its GPUs with the trainer's state.
    verl's default `actor_rollout_ref.rollout.gpu_memory_utilization` is 0.5 (verl's
    trainer/config/ppo_trainer.yaml, docs/examples/config.rst). Fitted on the fit set over
    0.4, 0.45, 0.5, starting from 0.5: 0.45. (It was 0.4 before, a hand nudge at 72B @ 128,
    a point now held out.)"""
    async_baselines_mem_util: float = 0.5
    """The same for the rollouts of one_step and stream, which the paper's authors built on
    verl but on GPUs of their own: verl's default 0.5, left in place (fitted on the fit set
    over 0.5, 0.6 and `gpu_mem_util`'s 0.8, the budget of laminar's and AReaL's).
    At 32B it halves their rollouts' KV, which makes them generation-bound at 32B @ 32 and 64."""
    activation_reserve_gb: float = 2.0
    """Per-GPU memory kept for activations and CUDA graphs, outside the KV cache."""
    prefill_mfu: float = 0.5
    """Model FLOPs utilisation of prefill (compute-bound) and of re-prefill after a move."""
    decode_quantum: int = 16
    """Simulation granularity: minimum decode steps per replica segment (see replica.py).
    1 is exact; 16 keeps the full grid within two minutes and moves results by < 1%."""

    # --- trainer ----------------------------------------------------------------------------
    trainer_mfu: float = 0.3
    """Trainer model FLOPs utilisation (FSDP + Ulysses SP, long sequences). Fitted on the fit
    set over 0.3, 0.34, 0.38: the smallest-scale points, where Table 2 makes every system
    trainer-bound (7B @ 16, 32B @ 32), set it."""

    trainer_update_s_per_gb: float = 0.0
    """Fixed trainer work per weight update, per GB of weights (gathering full weights for
    the hand-off, optimizer bookkeeping, data loading): what more GPUs do not shrink. Fitted
    on the fit set: 0 (the per-update cost is `trainer_update_s` instead; it was 0.25 s/GB
    when all 60 ratios were the objective)."""
    trainer_update_s: float = 20.0
    """Fixed trainer work per weight update in seconds, whatever the model size; added to
    `trainer_update_s_per_gb`. The paper's trainer-bound laminar points lose per-GPU
    efficiency with scale (32B: 1.3k tokens/s/GPU at 16 trainer GPUs, 0.96k at 128), which a
    fixed cost per update explains. Fitted on the fit set over 0, 20, 40 s: 20 s."""
    laminar_rollout_logprobs: bool = False
    """True: Laminar's trainer takes the behaviour log-probs from the rollout (one trajectory,
    one version: they are exact), as this project's trainer does, so its update is forward +
    backward (6P per token), while verl (`compute_log_prob`) and AReaL (decoupled PPO's
    proximal log-probs) recompute them with one more forward (8P). The paper does not say
    which Laminar does. With True, 18 of the 60 Fig. 11 ratios fall outside tolerance, and a
    `fit.py --quick` search from there was at 9 after one and a half rounds (stopped), against
    3 for False: the paper's numbers fit better if Laminar pays the same forward, so the
    default gives every system the recompute."""
    partial_trainer_mfu: float = 0.25
    """AReaL's trainer is Megatron-LM, not FSDP (§8.1), so its MFU is its own. Fitted on the
    fit set over 0.25, 0.27, 0.3. The paper's 7B @ 32 point bounds it: AReaL with 16 trainer
    GPUs (54.9k tokens/s) stays below laminar with 24 (66.6k), which needs a lower per-GPU
    training rate than laminar's."""

    megatron_mb_tokens: float = 8192.0
    """AReaL's Megatron trainer: tokens per micro-batch (a packed micro-batch of one data-
    parallel rank). With App. A.2's pipeline parallelism (PP 2 at 32B, 4 at 72B) it sets the
    1F1B bubble: a rank with m micro-batches per optimizer step idles (PP - 1) / (m + PP - 1)
    of the step, and strong scaling shrinks m (see costs.pipeline_stretch). The paper gives
    no number; fitted on the fit set over 8K, 16K, 32K: 8K (it was 32K when all 60 ratios,
    72B's PP 4 among them, were the objective; the fit set has PP 1 and 2 only)."""

    # --- verl-based baselines (sync, one_step, stream) -------------------------------------
    controller_us_per_token: float = 12.0
    """Serial work per prompt+response token at the global barrier of the verl-based
    baselines: the single controller gathers the batch, computes rule-based rewards and packs
    mini-batches before the trainer can use them (pipelined with the trainer per mini-batch).
    The paper's baselines plateau at ~60k tokens/s for every model size (one-step: 63.5k
    7B, 63.8k 32B, 58.1k 72B), i.e. a per-token cost that more GPUs do not shrink. Laminar
    and AReaL compute rewards per trajectory, off the critical path. verl starts this work
    after its barrier; one_step and stream score trajectories as they complete (see
    schedules/). Fitted on the fit set over 12-15 us: 12 us, which would put the one-step /
    stream plateau at 83.3k tokens/s; their generation tail keeps them below it."""

    # --- workload ---------------------------------------------------------------------------
    group_corr: float = 0.5
    """Share of log-length variance common to the 16 samples of one prompt (hard prompts
    are long for every sample). The paper gives no number."""
    length_max_quantile: float = 0.99999
    """Where Fig. 17's "max" length sits in the distribution. The paper does not say how
    many responses its CDF holds; a throughput run makes 15 iterations x 8192 = 122,880
    (10 warm-up + 5 measured, §8.1), and the largest of ~1e5 draws sits near quantile
    1 - 1e-5. It matters for 72B, whose max (12.3k) is far beyond its p99 (2.8k): it sets
    the decode tail of a batch, and so the 72B baselines' iteration."""
    prompt_median: float = 200.0
    """Median prompt tokens (DAPO-Math prompts with the template; max 2K per §8.1)."""
    prompt_sigma: float = 0.4
    tool_calls_max: int = 0
    """Agentic workload: each trajectory makes 0..this many tool calls (uniform), evenly
    spaced through its response; 0 = the single-turn math workload of Fig. 11."""
    tool_median_s: float = 2.0  # tool-call latency, log-normal (Fig. 2 right: skewed)
    tool_sigma: float = 1.0
    env_median_s: float = 0.0
    """Environment (reward sandbox) latency after the last token, log-normal with
    `env_sigma`, clipped at `env_max_s`; 0 = off. `laminar bench modes` uses one."""
    env_sigma: float = 1.0
    env_max_s: float = float("inf")

    # --- laminar ----------------------------------------------------------------------------
    inflight_batches: float = 0.75
    """Laminar: trajectories a rollout leases per batch = this x global batch / replicas
    (capped at 1024, §8.1), so about this many global batches are in flight. The paper's
    staleness (mostly 1-2, max 4) implies about one. Fitted on the fit set over 0.5, 0.75,
    1: 0.75."""
    version_lag: int = 1
    """Laminar: a rollout stops admitting once its relay holds a version this many updates
    newer than its own (the runtime's rollout.version_lag)."""
    stream_minibatches: bool = False
    """laminar and partial: the trainer takes each mini-batch as soon as its groups are
    complete (the runtime's trainer.stream_minibatches) instead of a whole global batch. Off
    for Fig. 11: the paper's Laminar samples a whole batch."""
    repack_c_max: float = 0.99  # §5.2, "e.g., above 99% of total KVCache"
    repack_check_s: float = 5.0  # §5.1, "e.g., 5 seconds"
    roofline_factor: float = 2.0
    """Algorithm 1's B = batch where a step costs this x a batch-1 step (§5.2 gives no B)."""

    # --- partial rollout (AReaL) --------------------------------------------------------
    max_outstanding_batches: float = float("inf")
    """laminar and partial: rollouts lease new groups only while fewer than this many global
    batches are leased or waiting untrained (the runtime's rollout.max_outstanding_batches;
    AReaL's staleness bound η + 1). ∞ as in the paper's throughput runs (η = ∞)."""
    partial_inflight_batches: float = 0.25
    """AReaL: trajectories generating at once across all rollouts (max_concurrent_rollouts)
    = this x global batch, split evenly over replicas (each at most 1024). Fitted on the fit
    set over 0.25, 0.5: 0.25."""

    def with_overrides(self, **kw: Any) -> Calibration:
        return replace(self, **kw)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, path: str | Path) -> tuple[Calibration, dict[str, Any] | None]:
        """(calibration, local block or None) from a JSON file."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object")
        local = data.pop("local", None)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown calibration keys {unknown}; "
                             f"allowed: {sorted(known)} and 'local'")
        return cls(**data), local
