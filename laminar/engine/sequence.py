"""A request's life inside the engine: the caller's `GenerationRequest` plus scheduling state.

The request object itself is the record of progress (`output_ids`, `logprobs` grow in place),
so aborting returns it as is and resuming is just adding it again. While a sequence runs, its
cached tokens are `num_tokens - 1`: the last sampled token is fed (and cached) next step.

Shared prompts: a fresh sequence (nothing generated yet) of a prompt at least 2 tokens long has
a `prompt_key`; while running, a sequence whose first `num_prompt` cached tokens are a shared
prompt's holds `prefix` = (prompt_key, weight version of those keys and values). Sequences
holding the same `prefix` count those tokens once (scheduler.py).
"""

from __future__ import annotations

from laminar.engine.sampler import sampling_row
from laminar.types import GenerationRequest


class Sequence:
    __slots__ = ("request", "seed", "stop_ids", "admitted_at", "num_tokens", "sampling_row",
                 "is_greedy", "is_filtered", "stop_seqs", "is_resumed", "prompt_key", "prefix", "num_prompt",
                 "spec")

    def __init__(self, request: GenerationRequest, seed: int, eos_token_id: int,
                 share_prefix: bool = False) -> None:
        params = request.params
        self.request = request
        self.seed = seed  # drives the counter-based sampling noise (see sampler.py)
        self.stop_ids = frozenset((eos_token_id, *params.stop_token_ids))
        # last token -> stop sequences ending with it, so the step checks only on a match
        self.stop_seqs: dict[int, list[list[int]]] = {}
        for s in params.stop_sequences:
            if s:
                self.stop_seqs.setdefault(s[-1], []).append(list(s))
        self.admitted_at = -1  # admission counter; the newest running sequence is preempted first
        # prompt + output length; a plain attribute (the step reads it for every row), kept in
        # step by the engine, the only writer of output_ids while the request is inside
        self.num_tokens = len(request.prompt_ids) + len(request.output_ids)
        self.sampling_row, self.is_greedy, self.is_filtered = sampling_row(params)
        # arrived with tokens generated elsewhere (a move, a swap): its first prefill is a
        # re-prefill, counted by the engine; cleared once done (a preemption's is not)
        self.is_resumed = bool(request.output_ids)
        self.num_prompt = len(request.prompt_ids)
        self.prompt_key: tuple[int, ...] | None = (
            tuple(request.prompt_ids) if share_prefix and self.num_prompt >= 2 else None)
        self.prefix: tuple[tuple[int, ...], int] | None = None
        self.spec = None  # the drafter's per-sequence state (speculation.py), when it is on

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_cached_tokens(self) -> int:
        """KV tokens held while running."""
        return self.num_tokens - 1

    @property
    def budget_left(self) -> int:
        return self.request.params.max_new_tokens - len(self.request.output_ids)

    @property
    def is_fresh(self) -> bool:
        """Nothing generated yet: its whole context is the prompt."""
        return not self.request.output_ids

    def last_token(self) -> int:
        """The token a decode step feeds: the last one sampled, or the prompt's last."""
        request = self.request
        return request.output_ids[-1] if request.output_ids else request.prompt_ids[-1]

    def stops_at_end(self, output: list[int]) -> bool:
        """The output ends with one of the request's stop sequences."""
        for s in self.stop_seqs.get(output[-1], ()) if output else ():
            if len(output) >= len(s) and output[-len(s):] == s:
                return True
        return False

    def context(self) -> list[int]:
        """What a (re-)prefill feeds: the prompt and everything generated so far."""
        return self.request.prompt_ids + self.request.output_ids
