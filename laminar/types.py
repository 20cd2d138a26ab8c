"""The shared vocabulary every stage speaks.

Map of the data path and the type each hop carries:

    PromptPool --PromptGroup--> Rollout --GenerationRequest--> Engine
    Engine --TokenDelta--> Rollout --Trajectory--> PartialPool / ExperienceBuffer --> Trainer
    Trainer --WeightVersion--> relays --> Rollout (engine.load_weights)

Small dataclasses, a comment per field. Add fields reluctantly. This module imports nothing
from laminar.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["eos", "stop", "length"]


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus sampling; 1.0 = off
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 128  # token budget for the response (tokens already generated count)
    stop_token_ids: tuple[int, ...] = ()  # finishing tokens besides the engine's EOS
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
    version: int = -1  # weight version that generated output_ids; -1 = not started yet
    finish_reason: FinishReason | None = None  # None while running or after abort

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class TokenDelta:
    """What one engine step produced for one request."""

    request_id: str
    token_ids: list[int]  # new tokens this step (usually one)
    logprobs: list[float]  # their log-probs under the sampling distribution
    finish_reason: FinishReason | None = None  # set on the request's last delta


@dataclass(slots=True)
class EngineStats:
    num_running: int  # requests in the decode batch
    num_waiting: int  # admitted to the engine but not yet prefilled (or preempted)
    kv_used_tokens: int  # real tokens held in the KV cache (not padding)
    kv_capacity_tokens: int  # KV capacity in tokens
    num_generated_tokens: int  # cumulative tokens generated since the engine started
    version: int  # weight version currently loaded

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

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(slots=True)
class WeightVersion:
    """Metadata of one published set of weights."""

    version: int  # trainer update count that produced these weights
    num_bytes: int  # size of the flat buffer
    num_tensors: int
