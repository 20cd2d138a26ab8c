"""The `trainer:` section (optimiser, loss, global batch, checkpoints, data-parallel ranks,
LoRA) and `sft:` (the supervised warm start)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from laminar.config.base import Device, Section, device_setting


class LoraConfig(Section):
    r: int = Field(8, ge=1, description="LoRA rank: each adapted layer learns B @ A with A [r, in] "
                   "and B [out, r].")
    alpha: float = Field(16.0, gt=0.0, description="LoRA scale numerator: the update is "
                         "(alpha / r) * B @ A.")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1,
        description="Linear layers to adapt, by the last part of their dotted name (peft's "
        "rule): the attention projections by default; add gate_proj, up_proj, down_proj for "
        "every linear layer of a decoder block.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")


Correction = Literal["none", "tis", "mis", "icepop", "geo_mask", "decoupled", "m2po"]

# Each correction's parameters and their defaults (sources in laminar/trainer/corrections.py).
CORRECTION_PARAMS: dict[str, dict[str, Any]] = {
    "none": {},
    "tis": {"level": "token", "cap": 2.0},
    "mis": {"level": "token", "low": 0.5, "high": 2.0},
    "icepop": {"low": 0.5, "high": 5.0},
    "geo_mask": {"low": 0.99, "high": 1.01},
    "decoupled": {"cap": 5.0},
    "m2po": {"tau": 0.04},
}


class CorrectionConfig(Section):
    """One off-policy correction and its parameters; those it does not take stay unset (None),
    those it takes default to CORRECTION_PARAMS[kind]."""

    kind: Correction = Field("none", description="`none`: PPO-clip against the behaviour "
                             "log-probs, every token counts 1. `tis`: truncated importance "
                             "weights min(rho, cap). `mis`: tokens (or sequences) whose ratio "
                             "leaves [low, high] dropped, the others count 1. `icepop`: rho "
                             "inside [low, high], 0 outside. `geo_mask`: a sequence whose "
                             "geometric-mean ratio leaves [low, high] dropped. `decoupled`: "
                             "decoupled PPO (AReaL), rho, 0 above cap. `m2po`: the tokens of "
                             "largest (log rho)^2 dropped until the rest's mean is <= tau. "
                             "rho = pi_prox / pi_behaviour per token.")
    level: Literal["token", "sequence"] | None = Field(
        None, description="`tis`, `mis`: the ratio of each token, or of the whole sequence (the "
        "product of its tokens' ratios) applied to each of its tokens. Default: token.")
    cap: float | None = Field(None, description="`tis`: the truncation (> 1, default 2); "
                              "`decoupled`: the weight above which a token is dropped (> 1, "
                              "default 5, AReaL's behav_imp_weight_cap).")
    low: float | None = Field(None, description="`mis`, `icepop`, `geo_mask`: the band's lower "
                              "end (default 0.5, 0.5, 0.99).")
    high: float | None = Field(None, description="`mis`, `icepop`, `geo_mask`: the band's upper "
                               "end (default 2, 5, 1.01).")
    tau: float | None = Field(None, description="`m2po`: the bound on the kept tokens' second "
                              "moment mean((log rho)^2) (default 0.04, the M2PO paper's).")

    @model_validator(mode="before")
    @classmethod
    def _kind_defaults(cls, data: Any) -> Any:
        """`trainer.correction=tis` names the kind alone; a kind's parameters default to
        CORRECTION_PARAMS, and one it does not take is refused."""
        if isinstance(data, str):
            data = {"kind": data}
        if not isinstance(data, dict):
            return data
        kind = data.get("kind", "none")
        if kind not in CORRECTION_PARAMS:
            return data  # the Literal names the allowed kinds
        takes = CORRECTION_PARAMS[kind]
        for key in ("level", "cap", "low", "high", "tau"):
            if data.get(key) is not None and key not in takes:
                took = ", ".join(takes) or "no parameters"
                raise ValueError(f"trainer.correction.{key}={data[key]!r} is not a parameter "
                                 f"of trainer.correction.kind={kind} (it takes {took})")
        return {**takes, **{k: v for k, v in data.items() if v is not None}}

    @model_validator(mode="after")
    def _meaningful(self) -> "CorrectionConfig":
        if self.cap is not None and self.cap <= 1.0:
            raise ValueError(f"trainer.correction.cap={self.cap} must be > 1 (kind={self.kind}): "
                             "a cap at or below 1 down-weights every token the new policy "
                             "favours; try 2 (tis) or 5 (decoupled)")
        if self.low is not None and self.high is not None and not 0.0 <= self.low < self.high:
            raise ValueError(f"trainer.correction.low={self.low} and trainer.correction.high="
                             f"{self.high} (kind={self.kind}) are not a band: need 0 <= low < "
                             f"high, e.g. low=0.5 high=5")
        if self.tau is not None and self.tau <= 0.0:
            raise ValueError(f"trainer.correction.tau={self.tau} must be > 0 (kind=m2po; the "
                             "paper's is 0.04)")
        return self


class TrainerConfig(Section):
    lr: float = Field(2e-4, gt=0.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0.0, description="Clip the global gradient norm to this.")
    eps_low: float = Field(0.2, ge=0.0, lt=1.0, description="Lower PPO clip (ratio >= 1-eps_low).")
    eps_high: float = Field(0.28, ge=0.0, description="Upper PPO clip, Clip-Higher (DAPO).")
    kl_coef: float = Field(0.0, ge=0.0, description="KL penalty to the starting model; 0 = off.")
    old_logprobs: Literal["rollout", "recompute"] = Field(
        "rollout", description="What the PPO ratio is taken against. `rollout`: the log-probs the "
        "engine recorded while generating (the behaviour policy; laminar's choice, one trajectory "
        "= one version). `recompute`: the trainer's own log-probs under the weights at the start "
        "of the global batch (the proximal policy), one more forward pass per token (verl's "
        "compute_log_prob); with `trainer.correction.kind=none` it measures the engine-trainer "
        "mismatch at the trainer's own version. Every correction other than `none` implies it. "
        "(`decoupled` moved to trainer.correction=decoupled.)")
    correction: CorrectionConfig = Field(
        default_factory=lambda: CorrectionConfig(), description="The off-policy correction: how "
        "much each token of the PPO-clip objective counts, from its ratio pi_prox / pi_behaviour "
        "(laminar/trainer/corrections.py, docs/staleness.md). `trainer.correction=tis` picks one "
        "with its default parameters; `trainer.correction.cap=3` sets one. The default, `none`, "
        "is today's PPO-clip against the behaviour log-probs; it stays the default until the "
        "staleness sweep (`laminar bench staleness`) has measured the others.")
    prompts_per_step: int = Field(16, ge=1, description="Prompt groups in one global batch.")
    mini_batches: int = Field(1, ge=1, description="Optimizer updates per global batch.")
    micro_batch_tokens: int = Field(2048, ge=1, description="Padded tokens per forward pass; "
                                    "gradients accumulate over micro-batches of similar length.")
    total_steps: int = Field(30, ge=1, description="Global batches to train (weight versions).")
    checkpoint_every: int = Field(10, ge=0, description="Save a checkpoint every N steps (0 = only "
                                  "at the end). A trainer that dies restarts from the newest one.")
    max_restarts: int = Field(3, ge=0, description="Times the trainer actor is restarted after "
                              "a crash (from its newest checkpoint) before the run fails.")
    threads: int = Field(2, ge=1, description="torch threads for training.")
    bf16: bool = Field(False, description="bfloat16 autocast for forward/backward (fp32 master weights).")
    from_checkpoint: str | None = Field(
        None, description="Start this new run from a laminar checkpoint directory "
        "(RUN_DIR/checkpoints/step_NNNNNN): its model, optimizer, step count and place in the "
        "prompt stream. Not the same as "
        "the top-level `resume`, which continues a killed job in its own run_dir, pools "
        "included.")
    seed: int = Field(0, description="Seed of the trainer and the sampling RNG (every "
                      "trajectory's sampling seed derives from it and the trajectory's id).")
    eval_every: int = Field(10, ge=0, description="Held-out evaluation (greedy and sampled, on "
                            "task.eval_prompts prompts) every N trainer steps, run by a rollout "
                            "while the trainer goes on; also at the start and the end (0 = only then).")
    eval_every_s: float = Field(
        0.0, ge=0.0, description="Also evaluate the newest version every this many seconds of "
        "wall-clock time since the rollouts started (0 = off): schedules that update at different "
        "rates are then scored on the same clock (`laminar bench modes` uses it).")
    max_nonfinite_steps: int = Field(
        3, ge=1, description="An optimizer update whose loss or gradient norm is NaN or inf is "
        "skipped (counted as `nonfinite_skipped`); this many in a row stop the run with a "
        "checkpoint and an error naming the step (a lower trainer.lr usually helps).")
    world_size: int = Field(
        1, ge=1, description="Data-parallel trainer ranks: N Ray actors forming one torch process "
        "group (gloo on CPU, nccl on GPU), placed with a Ray placement group, one per node where "
        "possible; each global batch is split across them by tokens (docs/trainer.md). Each rank "
        "reserves trainer.threads CPUs plus cluster.trainer_resources (e.g. {GPU: 1}). Needs "
        "cluster.backend=ray when above 1.")
    sharding: Literal["full", "grad_op", "none"] = Field(
        "full", description="With world_size > 1: `full` (FSDP2 fully_shard: parameters, "
        "gradients and optimizer state sharded; parameters gathered per layer for forward and "
        "again for backward; the least memory, the most communication), `grad_op` (the same at "
        "rest; during an update the layers stay gathered and the gradients unsharded from the "
        "first forward to the last backward: one all-gather and one reduce-scatter per update, "
        "the whole model's parameters and gradients held meanwhile), `none` "
        "(DistributedDataParallel: everything replicated, gradients all-reduced).")
    lora: LoraConfig | None = Field(
        None, description="Train LoRA adapters (peft) on a frozen base instead of every weight, "
        "e.g. `trainer.lora={}` or `trainer.lora.r=16`; a weight version then holds only the "
        "adapters and each rollout merges them into its copy of the base (docs/lora.md).")
    publish_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="The dtype of the weight versions the trainer publishes: the "
        "trainer keeps fp32 master weights and pushes their cast. `auto`: the rollout engine's "
        "(rollout.engine.dtype); `bf16` halves the bytes on the relay chain and, at small "
        "learning rates, leaves most bytes unchanged between versions, which the relay's delta "
        "versions exploit (docs/relay.md). LoRA versions (adapters only) stay fp32.")
    device: Device = Field(
        "auto", description="Where the trainer's model and optimizer live: `auto` (the GPU when "
        "the trainer's process sees one, else the CPU), `cpu`, or `cuda` (an error at start where "
        "there is none). Ranks on GPUs form their group over nccl, on the CPU over gloo; a push "
        "copies from the device straight into the master relay's host memory (docs/devices.md).")

    @field_validator("old_logprobs", mode="before")
    @classmethod
    def _decoupled_moved(cls, value: Any) -> Any:
        if value == "decoupled":
            raise ValueError("trainer.old_logprobs=decoupled is now trainer.correction=decoupled "
                             "(one of the off-policy corrections; its cap, formerly "
                             "trainer.behaviour_weight_cap, is trainer.correction.cap); write "
                             "trainer.correction=decoupled and drop trainer.old_logprobs")
        return value

    @model_validator(mode="before")
    @classmethod
    def _correction_recomputes(cls, data: Any) -> Any:
        """A correction weighs pi_prox / pi_behaviour, so the ratio is taken against the
        recomputed proximal log-probs: `old_logprobs` becomes `recompute` (set to `rollout` by
        hand, it contradicts the correction)."""
        if not isinstance(data, dict):
            return data
        corr = data.get("correction")
        kind = corr if isinstance(corr, str) else (corr.get("kind", "none") if isinstance(
            corr, dict) else getattr(corr, "kind", "none"))
        if kind in (None, "none"):
            return data
        if data.get("old_logprobs") == "rollout":
            raise ValueError(f"trainer.correction.kind={kind} weighs each token by pi_prox / "
                             "pi_behaviour and clips against the recomputed proximal log-probs, "
                             "so trainer.old_logprobs=rollout contradicts it; drop "
                             "trainer.old_logprobs (or set trainer.correction=none)")
        return {**data, "old_logprobs": "recompute"}

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, value: Any) -> Any:
        return device_setting(value, "trainer.device")

    @model_validator(mode="after")
    def _lora_sharding(self) -> "TrainerConfig":
        if self.lora is not None and self.world_size > 1 and self.sharding != "none":
            raise ValueError(f"trainer.lora with trainer.world_size={self.world_size} needs "
                             f"trainer.sharding=none (DDP; got trainer.sharding={self.sharding}): "
                             "the adapters are small, so replicating them costs little; FSDP "
                             "sharding of a LoRA model is not supported")
        return self


class SFTConfig(Section):
    enabled: bool = Field(True, description="Run the supervised warm start when `model.path` is unset.")
    steps: int = Field(200, ge=1, description="Optimizer steps (stops earlier at `max_seconds`).")
    max_seconds: float = Field(115.0, gt=0.0, description="Wall-clock cap for the warm start.")
    batch_size: int = Field(64, ge=1, description="Sequences per warm-start step (RL's global "
                            "batch is trainer.prompts_per_step groups).")
    lr: float = Field(3e-3, gt=0.0, description="AdamW learning rate (cosine decay to 10%).")
    cache_dir: str = Field(".cache/sft", description="Where warm-started models are cached, keyed "
                           "by the model, task and SFT settings.")
