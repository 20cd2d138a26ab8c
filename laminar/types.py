"""The shared vocabulary every stage speaks.

Map of the data path and the type each hop carries:

    PromptPool --PromptGroup--> RolloutLoop --GenerationRequest--> Engine
    Engine --TokenDelta--> RolloutLoop --TokenDelta (with versions)--> PartialPool
    RolloutLoop --Trajectory--> ExperienceBuffer --list[Trajectory] groups--> Trainer
    Trainer --named tensors + version--> relays --> RolloutLoop (engine.load_weights)
    RolloutLoop --RolloutSnapshot--> RolloutManager --Moved--> RolloutLoop (repack, failover)

Small dataclasses, a comment per field. Add fields reluctantly. This module imports nothing
from laminar. It also names the schedules (`MODES`) and the built-in tasks (`TASKS`) once.

Glossary (one word per meaning):
- group: one prompt sampled `rollout.group_size` times (GRPO's group); the unit a rollout
  leases, the buffer completes and the trainer samples.
- trajectory: one sample of a group, prompt + response (+ an episode's observations);
  `traj_id` = f"{group_id}/{i}", also its engine request id.
- partial / in flight: a trajectory begun and not finished. Its durable record is the partial
  pool's `PartialEntry`; as it moves between rollouts it is an `Unfinished`. `partial` mode
  (AReaL's partial rollout) also continues one on new weights, so its tokens mix versions.
- version: the number of a set of weights. The trainer publishes version v + 1 after each
  step; every token and trajectory records the version that generated it. The latest (or
  newest) version is the newest one published complete; a relay's `forwardable()` one may
  still be arriving.
- step: one trainer update of a global batch (`trainer.total_steps` of them); `TrainerService.steps`
  counts them. A version equals the steps behind it unless a restart skipped numbers.
- staleness: the trainer's version when it trains a trajectory minus the trajectory's version.
- batch, by unit: a global batch is `trainer.prompts_per_step` groups (one step); a mini-batch
  is 1 / `trainer.mini_batches` of it (one optimizer update); a micro-batch is at most
  `trainer.micro_batch_tokens` padded tokens (one forward); a rollout keeps `rollout.batch_groups`
  groups in flight; an engine decodes at most `rollout.engine.max_batch_size` sequences per
  step; repack's batch bound B is in trajectories.
- mode / schedule: where the waits are (laminar/modes/<mode>.py); `MODES` below.
- episode, turn: a multi-turn trajectory with its environment (laminar/envs/); a turn is one
  model generation (up to a stop string, EOS or its token budget).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

# The schedules, one file each in laminar/modes/ and laminar/sim/schedules/ (DESIGN.md §6), in
# the order reports list them. `laminar.config` checks `mode` against the same names.
Mode = Literal["laminar", "sync", "one_step", "stream", "partial"]
MODES: tuple[str, ...] = get_args(Mode)
GLOBAL_BATCH_MODES = ("sync", "one_step", "stream")  # those whose waits come one at a time
# The built-in tasks (laminar/tasks/, `task.name`); `laminar.config` checks against the same names.
TaskName = Literal["reverse", "dataset", "calc", "reasoning_gym", "humaneval"]
TASKS: tuple[str, ...] = get_args(TaskName)

FinishReason = Literal["eos", "stop", "length"]


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus sampling; 1.0 = off
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 128  # token budget for the response (tokens already generated count)
    stop_token_ids: tuple[int, ...] = ()  # finishing tokens besides the engine's EOS
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # token sequences that finish ("stop") when
    # the output ends with one (an environment's stop strings, e.g. a closing tool tag)
    seed: int | None = None  # per-request seed for reproducible sampling; None = engine RNG

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class GenerationRequest:
    """One sequence in an engine: the request on the way in, the partial state that `abort`
    returns, and the finished completion on the way out (`finish_reason` set)."""

    request_id: str  # unique id; the rollout uses the trajectory id
    prompt_ids: list[int]  # tokenized prompt, BOS included
    params: SamplingParams = field(default_factory=SamplingParams)
    output_ids: list[int] = field(default_factory=list)  # generated so far (non-empty on resume)
    logprobs: list[float] = field(default_factory=list)  # one per output id, sampling distribution
    token_versions: list[int] = field(default_factory=list)  # one per output id: the weight
    # version that generated it (the engine appends; the only record of per-token versions)
    version: int | None = None  # version of the first generated token; None until admitted
    finish_reason: FinishReason | None = None  # None while running or after abort

    @property
    def mixes_versions(self) -> bool:
        """Generated by more than one weight version (only `partial` mode does that)."""
        return bool(self.token_versions) and self.token_versions[0] != self.token_versions[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class TokenDelta:
    """New tokens of one sequence: what one engine step produced for a request, or what a
    rollout streams to the partial pool (every token since its last update, with versions)."""

    request_id: str  # the trajectory id (a rollout's request id is its trajectory's)
    token_ids: list[int]  # new tokens (an engine step: usually one)
    logprobs: list[float]  # their log-probs under the sampling distribution
    finish_reason: FinishReason | None = None  # an engine's: set on the request's last delta
    token_versions: list[int] = field(default_factory=list)  # streamed: the weight version of
    # each token; an engine leaves it empty (it holds one version, EngineStats.version)


@dataclass(slots=True)
class EngineStats:
    num_running: int  # requests in the decode batch
    num_waiting: int  # admitted to the engine but not yet prefilled (or preempted)
    kv_used_tokens: int  # real tokens held in the KV cache (not padding)
    kv_capacity_tokens: int  # KV capacity in tokens
    num_generated_tokens: int  # cumulative tokens generated since the engine started
    version: int  # weight version currently loaded
    # cumulative, the native engine's (0 where an engine has none): speculative decoding's
    # drafted and accepted tokens and the steps that verified drafts; fresh admissions of a
    # shareable prompt and those that shared another sequence's prompt KV
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0
    num_prefix_lookups: int = 0
    num_prefix_hits: int = 0

    @property
    def kv_utilization(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0


@dataclass(slots=True)
class PromptItem:
    """One row of a task's data: the text shown to the model and the reference answer."""

    index: int  # position in the task's data (stable across runs with the same seed)
    prompt: str  # text after the chat/task template
    answer: str  # reference the reward compares against


@dataclass(slots=True)
class PromptGroup:
    """One prompt leased to a rollout, to be sampled `num_samples` times (a GRPO group)."""

    group_id: str  # unique across the run: f"e{epoch}-{index}" for task data
    item: PromptItem
    prompt_ids: list[int]
    num_samples: int


@dataclass(slots=True)
class Trajectory:
    """One finished sample: the unit the experience buffer stores and the trainer consumes."""

    traj_id: str  # f"{group_id}/{sample_index}"; the idempotency key of the buffer
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # behaviour log-probs recorded at generation, one per response id
    version: int  # the one weight version that generated every response token
    reward: float = 0.0
    exact_match: bool = False
    finish_reason: FinishReason | None = None
    token_versions: list[int] | None = None  # per token; only `partial` mode mixes versions
    staleness: int | None = None  # trainer version at consumption - version; set by the trainer
    failed: str | None = None  # why its reward failed for good (laminar.tasks.rewards.FAILURES:
    # the reward's, or the environment's env_error / env_timeout): it still completes its group
    # in the buffer; the trainer leaves it out
    loss_mask: list[int] | None = None  # per response id: 1 the model's, 0 the environment's
    # (observations of a multi-turn episode: context, not trained); None = every id the model's
    turns: int = 1  # model turns of its episode

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(slots=True)
class Unfinished:
    """A trajectory in flight as it moves between rollouts (repack, failover, retirement), with
    the state that lives only in a rollout's process (its episode, its start time). The partial
    pool's record of it, durable and naming its owner, is a `PartialEntry` (pools/partials.py)."""

    request: GenerationRequest  # prompt, tokens, log-probs and their versions so far
    group: PromptGroup  # the prompt (and reference answer) it samples
    episode: Any = None  # a multi-turn episode's state and environment (laminar.envs.episode)
    started_at: float | None = None  # wall time of its first admission (its latency's start);
    # None when it comes from the partial pool (failover, resume)


@dataclass(slots=True)
class RolloutCounters:
    """Cumulative counts of one rollout since it started."""

    generated_tokens: int = 0
    finished: int = 0  # trajectories confirmed by the experience buffer
    batches: int = 0  # leases that started new groups
    pulls: int = 0  # weight versions loaded
    pull_s: float = 0.0  # time spent copying new weights in
    busy_s: float = 0.0  # engine steps
    idle_s: float = 0.0  # nothing to decode (waiting for prompts, weights or the environment)
    drain_idle_s: float = 0.0  # the part of idle_s spent draining: admitting nothing, waiting for
    # the work in flight (episodes in their tools) to end before the newest weights can load
    swaps: int = 0  # interruptions of in-flight work for new weights (partial rollout)
    reprefill_tokens: int = 0  # context tokens re-prefilled for trajectories that arrived with
    # tokens already generated (a repack or failover move, a partial-rollout swap)
    reprefill_s: float = 0.0  # engine time of those re-prefills: each step's time x their share
    # of the step's tokens (engine/engine.py)
    reward_errors: int = 0  # trajectories whose reward failed for good (after its retries)
    failed_by_reason: dict[str, int] = field(default_factory=dict)  # those, by reason
    tool_calls: dict[str, int] = field(default_factory=dict)  # environment tool calls by status
    # (a step's info["tool_status"]: ok, error, timeout, killed, output_limit for the sandbox)
    traj_timed: int = 0  # trajectories whose generation ended here with a known start
    traj_latency_sum_s: float = 0.0  # their latencies summed: wall time from the first admission
    # of the trajectory (on whichever rollout) to its last token here, moves included
    traj_latency_max_s: float = 0.0  # the longest of them
    adopted: int = 0  # trajectories received by repack or failover
    exported: int = 0  # trajectories handed over by repack or retirement
    versions: list[int] = field(default_factory=list)  # versions loaded, in order
    spec_drafted_tokens: int = 0  # the engine's EngineStats of the same names, as of the
    spec_accepted_tokens: int = 0  # last snapshot (speculative decoding, shared prefixes)
    spec_steps: int = 0
    prefix_lookups: int = 0
    prefix_hits: int = 0


@dataclass(slots=True)
class RolloutSnapshot:
    """One rollout as the manager and the driver see it (the idleness metric of repack)."""

    rollout_id: str
    version: int  # weights the engine holds
    num_in_flight: int  # trajectories decoding: what a repack or a failover would move
    num_unsettled: int  # finished, in their environment call or not yet confirmed by the buffer
    num_running: int  # engine: in the decode batch
    num_waiting: int  # engine: admitted, not yet prefilled (or preempted)
    kv_used_tokens: int
    kv_capacity_tokens: int
    held: bool  # admissions held by the manager (a repack source, until released)
    draining: bool  # admits nothing new until its in-flight work is done
    counters: RolloutCounters
    newest: int | None = None  # newest version its weight source offered at its last step
    # (None: none yet); above `version` once a newer one is published

    @property
    def kv_utilization(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0
