"""The `vllm` rollout backend: vLLM's engine behind the `RolloutEngine` protocol.

    engine = VLLMEngine(model, eos_token_id=EOS_ID, max_batch_size=64, kv_capacity_tokens=16384)
    engine.add(GenerationRequest("t0", prompt_ids, SamplingParams(temperature=1.0)))
    while engine.has_unfinished():
        for delta in engine.step(): ...          # new tokens, their log-probs, finish reasons

Process layout: one in-process engine per rollout actor (`LLMEngine` with the uni executor,
`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the rollout's process is vLLM's engine core and its one
worker. On CPU that costs ~0.75 GB and ~2 s to start, where vLLM's default layout (a separate
engine-core process per engine) costs ~2 GB and 15-25 s for the tiny model; a killed engine is a
killed rollout actor, which the manager already treats as a dead rollout. The constructor
runs one throwaway request, so the process's one-off first-forward cost (seconds on CPU) is paid
at build time, not in the rollout loop's first step (`_warm_up`). Each engine uses the
torch threads its process has (`VLLM_CPU_OMP_THREADS_BIND=nobind`: vLLM would otherwise bind
every engine on a machine to the same cores).

Token ids in, token ids out: vLLM gets prompts as ids (`skip_tokenizer_init`) and never sees a
tokenizer; the EOS id and the request's stop ids go in as `stop_token_ids`, and token stop
sequences are checked here after each step (a hit aborts the request in vLLM and finishes it
"stop"), as the native engine does. The model directory's generation_config and EOS ids are
ignored (`generation_config="vllm"`, `ignore_eos`), so the engine's EOS id and the request's
parameters are the only ones in force.

Log-probs: `logprobs_mode="processed_logprobs"` returns the log-prob under the distribution the
token was sampled from (after temperature, top-k and top-p), the native sampler's semantics;
greedy rows get the plain log-softmax, as in the native engine. vLLM's default mode returns
temperature-1 values, which are off the sampling distribution whenever temperature != 1.

Weights: built from a torch model (saved once, config + safetensors, to a temporary directory
vLLM loads and that `close` removes) or from a model directory. `load_weights` hands the
trainer's `state_dict()` tensors (Hugging Face names, which vLLM's loaders map onto its fused
layers) to the worker's `reload_weights` through `collective_rpc` and the `WeightLoader`
extension below; in-process the tensors pass by reference. Every live request is taken out of
vLLM first and put back afterwards (requests with tokens re-prefill them, on the new weights),
and the prefix cache is reset, so nothing computed with older weights is ever served.
vLLM reloads whole layers, so a partial load (trainer.lora: the merged target modules) is
completed with the starting checkpoint's other tensors, which no load has changed.

Speculation (`speculation` = k > 0, rollout.engine.speculation): vLLM's n-gram drafter and
standard rejection sampler (vllm_support.speculative_config); a step may then emit several
tokens per request, each with the target model's log-prob. vLLM counts drafts per request;
`stats()` sums them into the native engine's counters (docs/engine.md, "Speculative decoding on
the vllm backend", for where this is lossless and where not).

Sampling seeds: vLLM seeds its process-wide RNG from `seed` at start. A per-request
`params.seed` is passed to vLLM on GPUs only: on the CPU backend a per-request generator kills
the engine core (vLLM 0.32), so there it is ignored.
"""

from __future__ import annotations

import gc
import json
import shutil
import tempfile
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from laminar.config import ConfigError
from laminar.engine.protocol import NamedTensors, check_request
from laminar.engine.vllm_support import (check_servable, checkpoint_names, engine_kwargs,
                                          finish_reason, import_vllm, kv_bytes_per_token,
                                          kv_cache_bytes, loader_env_kept, read_tensors,
                                          shut_down_keeping_process_state)
from laminar.types import EngineStats, GenerationRequest, TokenDelta

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_OPEN: weakref.WeakSet = weakref.WeakSet()  # the VLLMEngines of this process not yet closed


def _draft_counts(metrics: Any) -> tuple[int, int]:
    """(drafted, accepted) tokens of one vLLM request (its `RequestSpecDecodeMetrics`: a
    histogram of accepted drafts per verifying step, and the drafted tokens)."""
    return metrics.num_draft_tokens, sum(j * n for j, n in enumerate(metrics.histogram))


class _Live:
    """A request inside the engine: the laminar object plus vLLM's id and resume accounting."""

    __slots__ = ("request", "stop_ids", "stop_seqs", "internal_id", "reprefill", "done_on_add",
                 "drafts")

    def __init__(self, request: GenerationRequest, eos_token_id: int) -> None:
        self.request = request
        self.stop_ids = frozenset((eos_token_id, *request.params.stop_token_ids))
        self.stop_seqs = tuple(tuple(s) for s in request.params.stop_sequences if s)
        self.internal_id: str | None = None  # vLLM's request id while it is inside vLLM
        self.reprefill = 0  # context tokens to prefill again (a resume), until its first token
        self.done_on_add = False  # resumed with nothing left to generate
        self.drafts: Any = None  # speculation: vLLM's draft counts of its request while inside


class VLLMEngine:
    backend = "vllm"

    def __init__(self, model: torch.nn.Module | None, eos_token_id: int, pad_token_id: int = 0,
                 max_batch_size: int = 64, kv_capacity_tokens: int = 16384, version: int = 0,
                 seed: int = 0, model_path: str | None = None, block_size: int = 32,
                 enforce_eager: bool = True, speculation: int = 0) -> None:
        if (model is None) == (model_path is None):
            raise ValueError("VLLMEngine needs exactly one of model (a torch module) and "
                             "model_path (a Hugging Face model directory)")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        if kv_capacity_tokens < block_size:
            raise ConfigError(f"rollout.engine.kv_capacity_tokens={kv_capacity_tokens} is below "
                              f"one KV block ({block_size} tokens); raise it")
        vllm = import_vllm()
        self._tmpdir: str | None = None
        if model is not None:
            dtype = next(model.parameters()).dtype
            self._tmpdir = tempfile.mkdtemp(prefix="laminar-vllm-")
            model.save_pretrained(self._tmpdir)  # config.json + model.safetensors
            model_path = self._tmpdir
        path = Path(model_path)
        config = json.loads((path / "config.json").read_text())
        if model is None:
            dtype = getattr(torch, str(config.get("torch_dtype") or config.get("dtype")
                                       or "float32"), torch.float32)
        check_servable(vllm, config, str(model_path), dtype, _DTYPES)
        self._tied_head = (("lm_head.weight", "model.embed_tokens.weight")
                           if config.get("tie_word_embeddings") else None)
        # the names load_weights takes: the checkpoint's (a tied head is saved once) + the head
        self._checkpoint_names = checkpoint_names(path) | set(self._tied_head or ())
        self._start_path = path  # the starting weights: what a partial load leaves unchanged
        self._replaced: set[str] = set()  # names some load_weights has given since the start
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id  # unused: vLLM never pads what it is given
        self.max_batch_size = max_batch_size
        self.version = version
        self.num_generated_tokens = 0
        self.num_reprefill_tokens = 0
        self.reprefill_s = 0.0
        self.speculation = speculation
        # speculation: drafted and accepted tokens of requests no longer inside vLLM, and the
        # steps in which vLLM verified drafts (the native engine's counters)
        self._past_drafts = [0, 0]
        self.num_spec_steps = 0
        self._live: dict[str, _Live] = {}
        from vllm.platforms import current_platform

        self._on_cpu = current_platform.is_cpu()
        max_positions = int(config.get("max_position_embeddings") or 2048)
        # stop ids outside the vocabulary are never sampled (a benchmark's "no EOS"); vLLM
        # rejects them, so they stay out of its stop list
        self._vocab_size = int(config["vocab_size"])
        per_token = kv_bytes_per_token(config, dtype)
        # vLLM refuses to start unless one request of max_model_len fits the KV cache
        self.max_model_len = min(max_positions, (kv_capacity_tokens // block_size) * block_size)
        args = vllm.EngineArgs(**engine_kwargs(
            str(model_path), _DTYPES.get(dtype, "auto"), max_batch_size, self.max_model_len,
            kv_cache_bytes(kv_capacity_tokens, block_size, per_token), block_size,
            enforce_eager, seed, speculation))
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it process-wide
        try:
            with loader_env_kept():
                vllm_config = args.create_engine_config()
                self._engine = LLMEngine(vllm_config=vllm_config,
                                         executor_class=Executor.get_class(vllm_config),
                                         log_stats=False, multiprocess_mode=False)
        finally:
            torch.set_num_threads = set_num_threads
        self._scheduler = self._engine.engine_core.engine_core.scheduler
        pool = self._scheduler.kv_cache_manager.block_pool
        self.block_size = block_size
        self.kv_capacity_tokens = (pool.num_gpu_blocks - 1) * block_size  # less the null block
        self._sampling = vllm.SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._tokens_prompt = TokensPrompt
        self._delta_kind = RequestOutputKind.DELTA
        _OPEN.add(self)
        self._warm_up()

    def _warm_up(self) -> None:
        """Run one throwaway greedy request (a prefill and a decode) before the engine is handed
        out. The first forward pass in a process pays a one-off initialisation on vLLM's CPU
        backend (2 s measured for the tiny preset on an idle machine, 5-6 s on a loaded 2-core
        one; the next engine in the same process pays nothing). Paid later, it lands in the
        rollout loop's first step, which holds the loop's lock, so the manager's health checks
        (`snapshot`) wait behind it; past the hang limit (then 3 x cluster.heartbeat_s, now
        cluster.hang_timeout_s) the manager declared the rollout dead.
        Greedy, so the sampling RNG seeded at start is untouched; the prefix cache is reset."""
        sampling = self._sampling(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=0,
                                  detokenize=False, output_kind=self._delta_kind)
        self._engine.add_request("laminar-warm-up",
                                 self._tokens_prompt(prompt_token_ids=[0]), sampling)
        while self._engine.has_unfinished_requests():
            self._engine.step()
        self._engine.reset_prefix_cache()

    # -- requests ---------------------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> None:
        """Queue a request (new, or a resume when `output_ids` is non-empty)."""
        check_request(request, self._live)
        rid, params = request.request_id, request.params
        longest = len(request.prompt_ids) + params.max_new_tokens
        if longest > self.max_model_len:
            raise ValueError(f"request '{rid}' may need {longest} tokens (prompt "
                             f"{len(request.prompt_ids)} + max_new_tokens {params.max_new_tokens})"
                             f" but this engine serves at most {self.max_model_len} (the model's "
                             "max_position_embeddings and kv_capacity_tokens); raise "
                             "rollout.engine.kv_capacity_tokens or lower max_new_tokens")
        live = _Live(request, self.eos_token_id)
        self._live[rid] = live
        out = request.output_ids
        if out and finish_reason(out, self.eos_token_id, live.stop_ids, live.stop_seqs,
                                 params.max_new_tokens) is not None:
            live.done_on_add = True  # nothing left to generate: finishes next step
        else:
            self._submit(live)

    def _submit(self, live: _Live) -> None:
        """Hand a live request to vLLM: prompt + what it generated so far, the budget left."""
        request, params = live.request, live.request.params
        context = request.prompt_ids + request.output_ids
        live.reprefill = len(context) if request.output_ids else 0
        sampling = self._sampling(
            temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0),
            max_tokens=params.max_new_tokens - len(request.output_ids),
            stop_token_ids=sorted(t for t in live.stop_ids if 0 <= t < self._vocab_size),
            ignore_eos=True,  # the model directory's EOS ids: laminar's own are stop ids above
            logprobs=0, detokenize=False,
            seed=None if self._on_cpu else params.seed, output_kind=self._delta_kind)
        live.internal_id = self._engine.add_request(
            request.request_id, self._tokens_prompt(prompt_token_ids=context), sampling)
        if self.speculation:  # vLLM counts its drafts per request (in-process: the same object)
            live.drafts = self._scheduler.requests[live.internal_id].spec_decode_metrics

    def _withdraw(self, lives: list[_Live]) -> None:
        """Take requests out of vLLM (they stay ours)."""
        inside = [live.request.request_id for live in lives if live.internal_id is not None]
        if inside:
            self._engine.abort_request(inside)
        for live in lives:
            self._left_vllm(live)

    def _left_vllm(self, live: _Live) -> None:
        """The request is no longer inside vLLM: its draft counts join the past ones."""
        live.internal_id = None
        if live.drafts is not None:
            drafted, accepted = _draft_counts(live.drafts)
            self._past_drafts[0] += drafted
            self._past_drafts[1] += accepted
            live.drafts = None

    def abort(self, ids: list[str]) -> list[GenerationRequest]:
        """Remove requests (running or waiting); returns their state, unfinished. Unknown ids
        (for example requests that already finished) are skipped."""
        found = [self._live.pop(rid) for rid in ids if rid in self._live]
        self._withdraw(found)
        return [live.request for live in found]

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        """Finish every request; returns them (same objects, same order) with outputs filled."""
        for request in requests:
            self.add(request)
        while self.has_unfinished():
            self.step()
        return requests

    # -- the step ---------------------------------------------------------------------------------

    def step(self) -> list[TokenDelta]:
        """One vLLM step (its scheduler admits, prefills and decodes); the deltas it produced."""
        deltas = [self._finish_on_add(live) for live in list(self._live.values())
                  if live.done_on_add]
        if not self._engine.has_unfinished_requests():
            return deltas
        drafted = self.num_drafted_tokens if self.speculation else 0
        t0 = time.perf_counter()
        outputs = self._engine.step()
        seconds = time.perf_counter() - t0
        step_tokens, reprefill = 0, 0
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is None or live.internal_id is None:
                continue  # aborted meanwhile
            if live.reprefill:  # its first token: the re-prefill happened in this step
                redone = max(live.reprefill - (output.num_cached_tokens or 0), 0)
                reprefill += redone
                step_tokens += redone
                live.reprefill = 0
            else:
                step_tokens += max(len(output.outputs[0].token_ids), 1)
            deltas.append(self._apply(live, output.outputs[0]))
        if self.speculation and self.num_drafted_tokens > drafted:
            self.num_spec_steps += 1
        if reprefill:
            self.num_reprefill_tokens += reprefill
            self.reprefill_s += seconds * reprefill / max(step_tokens, 1)
        return deltas

    def _apply(self, live: _Live, completion: Any) -> TokenDelta:
        """Append a step's tokens to the request; finish it on EOS, a stop id or sequence, or
        its budget (the first that applies; vLLM stops on the same ids and budget)."""
        request = live.request
        if request.version is None:
            request.version = self.version
        tokens, logprobs, reason = [], [], None
        entries = completion.logprobs or [None] * len(completion.token_ids)
        for token, entry in zip(completion.token_ids, entries):
            logprob = float(entry[token].logprob) if entry is not None else float("nan")
            request.output_ids.append(token)
            request.logprobs.append(logprob)
            request.token_versions.append(self.version)
            tokens.append(token)
            logprobs.append(logprob)
            reason = finish_reason(request.output_ids, self.eos_token_id, live.stop_ids,
                                   live.stop_seqs, request.params.max_new_tokens)
            if reason is not None:
                break
        if reason is None and completion.finish_reason is not None:
            reason = "length"  # vLLM stopped on its own (its max_tokens is the budget left)
        self.num_generated_tokens += len(tokens)
        if reason is not None:
            if completion.finish_reason is None:  # a stop sequence, seen here first
                self._withdraw([live])
            self._left_vllm(live)
            request.finish_reason = reason
            del self._live[request.request_id]
        return TokenDelta(request.request_id, tokens, logprobs, reason)

    def _finish_on_add(self, live: _Live) -> TokenDelta:
        """Finish a resumed request that arrived with nothing left to generate."""
        request = live.request
        reason = finish_reason(request.output_ids, self.eos_token_id, live.stop_ids,
                               live.stop_seqs, request.params.max_new_tokens) or "length"
        request.finish_reason = reason
        del self._live[request.request_id]
        return TokenDelta(request.request_id, [], [], reason)

    # -- weights and stats ------------------------------------------------------------------------

    def _started(self) -> set[str]:
        """vLLM ids of requests whose KV vLLM has begun to compute."""
        return {rid for rid, req in self._scheduler.requests.items() if req.num_computed_tokens}

    def load_weights(self, named_tensors: NamedTensors, version: int, force: bool = False) -> None:
        """Reload the model's weights in place (names as in the trainer's `state_dict()`), then
        stamp `version` on requests admitted from now on. Live requests leave vLLM for the
        load and come back as resumes, so none continues on KV of the older weights."""
        started = self._started()
        in_flight = [rid for rid, live in self._live.items()
                     if live.internal_id in started or live.request.version == self.version]
        if version != self.version and in_flight and not force:
            raise RuntimeError(
                f"load_weights(version={version}) refused: {len(in_flight)} request(s) are "
                f"generating with version {self.version} (e.g. '{in_flight[0]}'); let them "
                "finish, abort them, or pass force=True to continue them on the new weights")
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        items = self._complete(dict(items))
        waiting = [live for live in self._live.values() if live.internal_id is not None]
        self._withdraw(waiting)
        self._engine.collective_rpc("laminar_load_weights", args=(items,))
        if not self._engine.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight load")
        self.version = version
        for live in waiting:
            self._submit(live)

    def _complete(self, named: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        """The checkpoint's full tensor list for vLLM's `reload_weights`, which reloads whole
        layers: loaded without the tied head, the tiny preset's log-probs came back 0.47 off
        (measured). A trainer pushes `named_parameters()`, which names a tied head once (as the
        embedding), so the head is added back. A partial load (trainer.lora: the merged target
        modules only, the same ones every version) gets every other tensor from the starting
        checkpoint, as long as no earlier load changed it; one that did is an error."""
        tied = self._tied_head
        if tied and tied[0] not in named and tied[1] in named:
            named[tied[0]] = named[tied[1]]
        unknown = sorted(named.keys() - self._checkpoint_names)
        if unknown:
            raise KeyError(f"load_weights: '{unknown[0]}' is not a tensor of this model "
                           f"(expected names like '{min(self._checkpoint_names)}')")
        given = set(named)
        missing = self._checkpoint_names - given
        changed = sorted(missing & self._replaced)
        if changed:
            raise ValueError(f"load_weights: {len(changed)} tensor(s) an earlier version loaded "
                             f"are missing from this one (e.g. '{changed[0]}'); the vllm backend "
                             "reloads whole layers and keeps only the starting weights to fill "
                             "in, so pass every tensor that ever changed")
        if missing:
            named.update(read_tensors(self._start_path, missing, tied))
        self._replaced |= given
        return [(name, torch.as_tensor(tensor)) for name, tensor in named.items()]

    def _drafts(self) -> tuple[int, int]:
        """Drafted and accepted tokens since the start (vLLM's per-request counts, summed)."""
        drafted, accepted = self._past_drafts
        for live in self._live.values():
            if live.drafts is not None:
                d, a = _draft_counts(live.drafts)
                drafted, accepted = drafted + d, accepted + a
        return drafted, accepted

    @property
    def num_drafted_tokens(self) -> int:
        return self._drafts()[0]

    @property
    def num_accepted_tokens(self) -> int:
        return self._drafts()[1]

    def stats(self) -> EngineStats:
        """Counts and KV use from vLLM's scheduler (KV in whole blocks, as vLLM allocates it);
        with speculation, vLLM's drafted and accepted tokens and the steps that verified."""
        usage = self._scheduler.kv_cache_manager.usage
        drafted, accepted = self._drafts()
        return EngineStats(
            num_running=len(self._scheduler.running), num_waiting=len(self._scheduler.waiting),
            kv_used_tokens=round(usage * self.kv_capacity_tokens),
            kv_capacity_tokens=self.kv_capacity_tokens,
            num_generated_tokens=self.num_generated_tokens, version=self.version,
            num_drafted_tokens=drafted, num_accepted_tokens=accepted,
            num_spec_steps=self.num_spec_steps)

    def close(self) -> None:
        """Shut vLLM's engine down and delete the temporary model directory. The process-wide
        distributed state stays while another engine of this process is open."""
        engine = self.__dict__.pop("_engine", None)
        self.__dict__.pop("_scheduler", None)
        _OPEN.discard(self)
        if engine is not None:
            if _OPEN:
                shut_down_keeping_process_state(engine.engine_core)
            else:
                engine.engine_core.shutdown()
            del engine
            gc.collect()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __del__(self) -> None:
        if getattr(self, "_tmpdir", None) is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
