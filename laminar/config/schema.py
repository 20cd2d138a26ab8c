"""The root of the config tree: `Config` (top-level keys and one field per section, with the
cross-field rules that span sections) and the small sections that have no module of their own:
`model:`, `metrics:` and `sandbox:`. Task rules live beside the task sections (tasks.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from laminar.config.base import GLOBAL_BATCH_MODES, MODES, Mode, Section
from laminar.config.bench import BenchConfig
from laminar.config.cluster import ClusterConfig, ManagerConfig, RelayConfig
from laminar.config.rollout import RolloutConfig
from laminar.config.tasks import TaskConfig, task_rules
from laminar.config.trainer import SFTConfig, TrainerConfig


class ModelConfig(Section):
    preset: Literal["tiny", "small"] = Field(
        "tiny", description="Size preset for a model built from config: tiny (~0.5M params, "
        "hidden 128 / 2 layers) or small (~4M, hidden 256 / 4 layers). Ignored when `path` is set.")
    path: str | None = Field(
        None, description="Local Hugging Face model directory (weights + tokenizer) to start from "
        "instead of a preset. Also accepts a laminar checkpoint's `model/` folder.")
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", description="Attention kernel passed to transformers.")
    seed: int = Field(0, description="Seed for the random initialisation of a preset model "
                      "(the other seeds: task.seed, the prompts; trainer.seed, training and "
                      "sampling; docs/config.md).")


class MetricsConfig(Section):
    tensorboard: bool = Field(True, description="Write TensorBoard event files to RUN_DIR/tensorboard "
                              "(no server needed; `tensorboard --logdir RUN_DIR`).")
    wandb: bool = Field(False, description="Log to Weights & Biases (needs `pip install wandb`).")
    wandb_project: str = Field("laminar", description="W&B project name.")
    mlflow: bool = Field(False, description="Log to MLflow (needs `pip install mlflow`).")
    mlflow_tracking_uri: str | None = Field(None, description="MLflow tracking URI; unset = ./mlruns.")
    live: Literal["auto", "on", "off"] = Field("auto", description="Live view during training: "
                                               "`auto` = when stdout is a terminal, else plain lines.")

    @field_validator("live", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:  # YAML reads a bare on/off as a boolean
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class SandboxConfig(Section):
    backend: Literal["auto", "bwrap", "unshare", "unsafe"] = Field(
        "auto", description="How untrusted code is isolated. `bwrap`: bubblewrap. `unshare`: "
        "laminar's own namespaces (network, mount, pid, ipc, uts), a read-only minimal root and "
        "an unprivileged uid. `auto`: bwrap when installed, else unshare. `unsafe`: a plain "
        "subprocess with rlimits only (no network or filesystem isolation); refused unless "
        "`allow_unsafe` is true.")
    allow_unsafe: bool = Field(False, description="Permit the `unsafe` backend (and `auto` "
                               "falling back to it where the kernel refuses namespaces).")
    timeout_s: float = Field(5.0, gt=0.0, description="Wall-clock limit of one run; then the "
                             "whole process group is killed.")
    cpu_s: int = Field(5, ge=1, description="CPU-seconds limit (RLIMIT_CPU).")
    memory_mb: int = Field(512, ge=16, description="Address-space limit (RLIMIT_AS).")
    max_procs: int = Field(16, ge=1, description="Process limit (RLIMIT_NPROC).")
    max_file_mb: int = Field(8, ge=1, description="Largest file it may write (RLIMIT_FSIZE).")
    scratch_mb: int = Field(32, ge=1, description="Size of its private scratch directory.")
    max_output_bytes: int = Field(4096, ge=64, description="Output kept; the rest is cut and "
                                  "the run is stopped once it prints 16x this.")
    warm: int = Field(2, ge=0, description="Sandboxes kept started and waiting for code, so a "
                      "call costs little.")
    max_concurrent: int = Field(
        0, ge=0, description="Most programs running at once per process; further calls wait "
        "their turn (the wait counts in the environment's latency, not in `timeout_s`). 0 = the "
        "number of CPU cores: on a small machine, dozens of CPU-bound tool calls at once would "
        "starve the engine and the trainer.")
    zygote: bool = Field(True, description="`unshare` backend: start one pre-imported "
                         "interpreter (the zygote) inside the sandbox's namespaces and fork each "
                         "program from it, in namespaces, a /tmp and a uid of its own, instead of "
                         "starting two interpreters per call (docs/sandbox.md); false = the "
                         "one-shot path. bwrap and unsafe always use the one-shot path.")
    nice: int = Field(10, ge=0, le=19, description="Nice increment of every sandbox process "
                      "(the zygote and each program): tool calls yield the CPU to the engines "
                      "and the trainer; 0 = the host's priority.")


class Config(Section):
    name: str = Field("reverse", description="Run name; the default run directory is runs/<name>.")
    run_dir: str | None = Field(None, description="Where metrics and checkpoints go.")
    resume: bool = Field(False, description="Continue the killed or stopped job in `run_dir` "
                         "(what `laminar resume RUN_DIR` and `laminar train CONFIG --resume "
                         "RUN_DIR` set): the newest checkpoint's model, optimizer and RNG, and the "
                         "pools as RUN_DIR/pools.db left them (docs/fault-tolerance.md).")
    durable_pools: bool = Field(True, description="Keep the prompt pool, partial response pool "
                                "and experience buffer in RUN_DIR/pools.db (SQLite), so a killed "
                                "job resumes without losing buffered or in-flight work; false "
                                "keeps them in memory only.")
    mode: Mode = Field("sync", description=f"Schedule: {', '.join(MODES)} (laminar/modes/<mode>.py).")
    model: ModelConfig = Field(default_factory=ModelConfig, description="What model to train.")
    task: TaskConfig = Field(default_factory=TaskConfig, description="Prompts and reward.")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig,
                                   description="Isolation of untrusted code (the calc task's tool).")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Optimisation.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="Supervised warm start.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Ray placement.")
    manager: ManagerConfig = Field(default_factory=ManagerConfig, description="Rollout manager.")
    relay: RelayConfig = Field(default_factory=RelayConfig,
                               description="Relay tier: shared-memory weight store and chain broadcast.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig,
                                   description="Where metrics go besides RUN_DIR/metrics.jsonl.")
    bench: BenchConfig = Field(default_factory=BenchConfig, description="BENCHMARKS ONLY: "
                               "emulations that shape a benchmark's workload; never needed to "
                               "train a real task.")

    @model_validator(mode="after")
    def _cross_field_rules(self) -> "Config":
        task_rules(self)
        if self.cluster.backend == "local" and self.mode not in GLOBAL_BATCH_MODES:
            raise ValueError(f"cluster.backend=local runs mode={' | '.join(GLOBAL_BATCH_MODES)} "
                             f"(got mode={self.mode}, whose rollouts and trainer run at once); use "
                             "cluster.backend=ray for it")
        if self.cluster.virtual_nodes > self.rollout.num_workers:
            raise ValueError(f"cluster.virtual_nodes={self.cluster.virtual_nodes} exceeds "
                             f"rollout.num_workers={self.rollout.num_workers}; every virtual node "
                             "needs at least one rollout worker")
        if self.trainer.world_size > 1 and self.cluster.backend == "local":
            raise ValueError(f"trainer.world_size={self.trainer.world_size} starts one trainer "
                             "process per rank, which needs cluster.backend=ray (the one-process "
                             "backend has a single trainer); set cluster.backend=ray or "
                             "trainer.world_size=1")
        if self.trainer.mini_batches > self.trainer.prompts_per_step:
            raise ValueError(f"trainer.mini_batches={self.trainer.mini_batches} exceeds "
                             f"trainer.prompts_per_step={self.trainer.prompts_per_step}; a "
                             "mini-batch holds at least one prompt group")
        if self.trainer.publish_dtype == "auto":  # the engine's dtype: what rollouts serve in
            self.trainer.publish_dtype = self.rollout.engine.dtype
        return self

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name
