"""What a rollout engine is to the rest of laminar: the `RolloutEngine` protocol.

The rollout loop, the evaluator, the relay client, LoRA merging, the repack trigger and the
benchmarks use an engine only through these members; nothing outside `laminar/engine/` reaches
into an engine's model, scheduler or sequences. Backends: `native` (laminar/engine/engine.py,
the reference), `vllm` (laminar/engine/vllm_engine.py), `hf` (benchmark baseline only).

The request object is the record of progress. `add(request)` hands a `GenerationRequest` to the
engine; until it finishes or is aborted, the engine is the only writer of its `output_ids`,
`logprobs` (the log-prob of each token under the distribution it was sampled from: after
temperature, top-k and top-p) and `token_versions` (the weight version that generated each
token), and sets `version` (at admission) and `finish_reason` (at the end). Callers read these
fields at any time and never write them while the request is inside. `abort` hands requests
back unfinished; adding such a request again, to this engine or another one holding the same
weights, resumes it by re-prefilling prompt + output (greedy continuations are identical).

Versions: `load_weights(named, version)` swaps weights in place (never by restarting the
engine); names are the trainer's `state_dict()` names. Requests admitted afterwards are stamped
with `version`. An engine must not serve anything computed with older weights after a load (a
prefix cache is reset). It refuses while a request holding tokens of the current version is in
flight, unless `force` (partial mode: continue them on the new weights).

Who builds engines: `laminar.engine.build_engine` (one factory, by `rollout.engine.backend`).
Outside `laminar/engine/`, a rollout gets an `EngineFactory` (laminar/rollout/build.py) that
builds a fresh engine of the run's backend on the run's starting weights; an evaluator builds its
own with it and loads the versions it evaluates through the weight source, never by asking
another engine for its weights (a vLLM engine cannot hand them out cheaply).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from laminar.types import EngineStats, GenerationRequest, TokenDelta

if TYPE_CHECKING:
    import torch

NamedTensors = Mapping[str, "torch.Tensor"] | Iterable[tuple[str, "torch.Tensor"]]


@runtime_checkable
class RolloutEngine(Protocol):
    backend: str  # "native" or "vllm": the name step rows carry as engine_backend
    version: int  # weight version loaded now; stamped on requests admitted from now on
    max_batch_size: int  # most sequences decoded together (the scheduler's limit)
    kv_capacity_tokens: int  # KV-cache capacity in tokens, all requests together
    num_generated_tokens: int  # tokens generated since the engine started
    num_reprefill_tokens: int  # context tokens of resumed requests prefilled again
    reprefill_s: float  # the time those re-prefills cost (their token share of the steps)

    def add(self, request: GenerationRequest) -> None:
        """Queue a request: new, or a resume when `output_ids` is non-empty."""
        ...

    def step(self) -> list[TokenDelta]:
        """Advance every running request by (usually) one token; the deltas of this step."""
        ...

    def abort(self, ids: list[str]) -> list[GenerationRequest]:
        """Remove requests (running or waiting) and return them unfinished; unknown ids skip."""
        ...

    def has_unfinished(self) -> bool:
        ...

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        """Run every request to its end; returns them (same objects, same order)."""
        ...

    def load_weights(self, named_tensors: NamedTensors, version: int, force: bool = False) -> None:
        """Swap weights in place (names: the trainer's `state_dict()`); stamp `version` on
        requests admitted from now on. Refuses while requests of the current version are in
        flight, unless `force`."""
        ...

    def stats(self) -> EngineStats:
        """Running/waiting counts and KV used/capacity, from the backend's own scheduler."""
        ...

    def close(self) -> None:
        """Free the engine's memory and processes; the engine is unusable afterwards."""
        ...


class WeightTarget(Protocol):
    """What a weight source loads a version into: a `RolloutEngine`, or a stand-in in front of
    one (the LoRA merge of laminar/engine/lora.py, which turns adapters into full weights first)."""

    def load_weights(self, named_tensors: NamedTensors, version: int) -> None:
        ...


EngineFactory = Callable[[], RolloutEngine]  # a fresh engine on the run's starting weights


def check_request(request: GenerationRequest, live: Container[str]) -> None:
    """What every engine's `add` refuses, whatever its limits (`live`: the ids inside it): a
    duplicate id, a finished request, an empty prompt, a resumed state whose per-token lists
    disagree, a budget below one token. ValueError naming the request."""
    rid = request.request_id
    if rid in live:
        raise ValueError(f"request_id '{rid}' is already in the engine; ids must be unique")
    if request.finish_reason is not None:
        raise ValueError(f"request '{rid}' already finished ({request.finish_reason}); "
                         "only unfinished requests can be added or resumed")
    if not request.prompt_ids:
        raise ValueError(f"request '{rid}' has an empty prompt_ids; pass at least one token")
    if not len(request.logprobs) == len(request.token_versions) == len(request.output_ids):
        raise ValueError(f"request '{rid}' has {len(request.output_ids)} output_ids but "
                         f"{len(request.logprobs)} logprobs and {len(request.token_versions)} "
                         "token_versions; a resumed state needs one of each per token")
    if request.params.max_new_tokens < 1:
        raise ValueError(f"request '{rid}': params.max_new_tokens={request.params.max_new_tokens} "
                         "must be >= 1")
