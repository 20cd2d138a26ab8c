"""The native rollout engine: continuous batching with KV accounting, log-probs, abort/resume,
and in-place weight swaps.

    engine = Engine(model, eos_token_id=EOS_ID, pad_token_id=PAD_ID, max_batch_size=64)
    engine.add(GenerationRequest("t0", prompt_ids, SamplingParams(temperature=1.0)))
    while engine.has_unfinished():
        for delta in engine.step(): ...          # new tokens, their log-probs, finish reasons

`step()` is schedule (scheduler.py: preempt or admit against the KV capacity), share (`_share`:
a fresh sample whose prompt another sequence holds copies its keys and values instead of
prefilling them), run (one forward over decode and newly admitted rows, model_runner.py; with
`speculation`, decode rows also feed drafts, `_drafts`, verified in the same forward),
sample (sampler.py, all rows at once; `_verified` keeps the confirmed drafts, speculation.py),
then postprocess: append to each request, finish on EOS / stop token / budget, and free the
finished rows at once. The `GenerationRequest` objects are the state: the engine appends to
`output_ids` / `logprobs` in place, `abort` hands them back unfinished, and `add` of a request
with tokens already generated resumes it by re-prefilling prompt + prefix (the KV is rebuilt,
the sampling noise is counter-based, so the continuation is the one an uninterrupted run
would have produced). `num_reprefill_tokens` and `reprefill_s` count what those re-prefills
cost: the resumed contexts' tokens and their token share of the steps that prefilled them.

Seeds: a request's draws depend only on its seed and token index (sampler.py). `params.seed`
pins them (two requests with the same seed and prompt draw the same tokens, so give each sample
of a GRPO group its own seed, or None); without one the engine's seeded RNG picks one at `add`.

Versions: `load_weights` copies tensors into the model in place; a request admitted afterwards
gets its version (`request.version`, kept from then on) and every token it generates is stamped
with the version that made it (`request.token_versions`, parallel to `output_ids`). It refuses while a
request that already has tokens from the loaded weights is in the engine, unless forced; a forced
swap lets in-flight requests continue on their cached keys and values. The engine runs where
its model is (the caller places it: laminar/rollout/build.py moves it to `rollout.device`); on a
GPU, loads go host -> device through a pinned staging buffer allocated once per engine
(`laminar/devices.py: stage_copy`), on the CPU they are one `copy_` per tensor.

`Engine` is the reference `RolloutEngine` (protocol.py). Its `model`, `runner` and `scheduler`
are internals: engine-side code and engine tests may read them; nothing outside
`laminar/engine/` does.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Mapping

import torch

from laminar.devices import StagingBuffer, stage_copy
from laminar.engine import speculation as speculative
from laminar.engine.model_runner import ModelRunner
from laminar.engine.protocol import check_request
from laminar.engine.sampler import SamplingRows, sample
from laminar.engine.scheduler import Scheduler, running_costs
from laminar.engine.sequence import Sequence
from laminar.types import EngineStats, GenerationRequest, TokenDelta

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class Engine:
    backend = "native"

    def __init__(self, model: torch.nn.Module, eos_token_id: int, pad_token_id: int,
                 max_batch_size: int = 64, kv_capacity_tokens: int = 16384, version: int = 0,
                 seed: int = 0, share_prefixes: bool = True, speculation: int = 0,
                 speculation_tokens: int | None = None,
                 step_cost_ms: Mapping[int, float] | None = None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        if kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens={kv_capacity_tokens} must be >= 1")
        self.runner = ModelRunner(model, num_slots=max_batch_size)
        self.model = self.runner.model
        # pinned host memory for loads into a GPU model, allocated once (None on the CPU)
        self.staging = StagingBuffer.for_device(self.runner.device)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id  # unused: no padding is ever fed; kept for parity
        self.max_batch_size = max_batch_size
        self.kv_capacity_tokens = kv_capacity_tokens
        self.version = version
        self.scheduler = Scheduler(max_batch_size, kv_capacity_tokens)
        self.num_generated_tokens = 0
        self.num_reprefill_tokens = 0  # contexts of resumed requests prefilled again
        self.reprefill_s = 0.0  # their share of the steps that did it (see step)
        self.share_prefixes = share_prefixes
        self.num_prefill_tokens = 0  # prompt/context tokens computed by prefills (and forks)
        self.num_prefix_lookups = 0  # fresh admissions of a shareable prompt
        self.num_prefix_hits = 0  # ... that shared another sequence's prompt KV
        # speculative decoding: up to `speculation` drafted tokens per row and step (0: off)
        self.drafter = speculative.Drafter(speculation) if speculation else None
        # what a step costs for the tokens it feeds (knee.py's measured decode curve, or an
        # affine default): which drafts to verify is decided on it (speculation.plan_drafts)
        self.step_cost = speculative.StepCost(step_cost_ms)
        # a verifying step feeds at most this many tokens (rows + drafts): by default twice the
        # measured curve's knee, at least 64 (this CPU's: 64, where drafts in a full batch do not
        # pay; a GPU whose steps stay flat to 256 rows: 512, so full batches may draft too)
        self.speculation_tokens = speculation_tokens or (
            max(64, 2 * self.step_cost.knee_tokens()) if step_cost_ms else 64)
        # None: that cost rule decides; a number: the fixed rule instead, verify whatever is
        # drafted when the drafts are at least this many per row (0: always; the tests' hook)
        self.speculation_min_drafts: float | None = None
        self.num_spec_steps = 0  # steps that verified drafts
        self.num_drafted_tokens = 0
        self.num_accepted_tokens = 0
        self._rng = random.Random(seed)  # seeds for requests that bring none
        self._live: dict[str, Sequence] = {}
        self._done_on_add: list[Sequence] = []  # resumed with nothing left to do: finish next step

    # -- requests ---------------------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> None:
        """Queue a request (new, or a resume when `output_ids` is non-empty)."""
        check_request(request, self._live)
        rid, params = request.request_id, request.params
        longest = len(request.prompt_ids) + params.max_new_tokens
        if longest > self.runner.max_positions:
            raise ValueError(f"request '{rid}': prompt ({len(request.prompt_ids)} tokens) + "
                             f"max_new_tokens ({params.max_new_tokens}) exceeds the model's "
                             f"max_position_embeddings={self.runner.max_positions}")
        if longest > self.kv_capacity_tokens:  # admission also reserves the next token's slot
            raise ValueError(f"request '{rid}' may need {longest} KV tokens but "
                             f"kv_capacity_tokens={self.kv_capacity_tokens}; raise the capacity "
                             "or lower max_new_tokens")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(request, seed, self.eos_token_id, self.share_prefixes)
        if self.drafter is not None:
            self.drafter.register(seq)
        self._live[rid] = seq
        last = request.output_ids[-1] if request.output_ids else None
        if seq.budget_left <= 0 or last in seq.stop_ids:
            self._done_on_add.append(seq)  # nothing left to generate: finishes next step
        else:
            self.scheduler.add(seq)

    def abort(self, ids: list[str]) -> list[GenerationRequest]:
        """Remove requests (running or waiting); returns their state, unfinished. Unknown ids
        (for example requests that already finished) are skipped."""
        found = [self._live.pop(rid) for rid in ids if rid in self._live]
        self._apply_moves(self.scheduler.discard(found))
        gone = {id(seq) for seq in found}
        self._done_on_add = [seq for seq in self._done_on_add if id(seq) not in gone]
        return [seq.request for seq in found]

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
        """One scheduling step: admit (prefill or fork) and decode together, one token per row."""
        deltas = [self._finish(seq) for seq in self._done_on_add]
        self._done_on_add = []
        admitted, moves = self.scheduler.schedule()
        self._apply_moves(moves)
        rows = self.scheduler.running
        if not rows:
            return deltas
        for seq in admitted:
            if seq.request.version is None:
                seq.request.version = self.version
        num_decode = len(rows) - len(admitted)
        forks, prefills, followers = self._share(admitted, num_decode)
        num_decode += len(forks)  # a fork decodes its prompt's last token
        decoding = rows[:num_decode]
        drafts = (self._drafts(decoding, bool(prefills))
                  if self.drafter is not None and decoding else None)
        t0 = time.perf_counter()
        if drafts is None:
            widths = None
            logits = self.runner.run([seq.last_token() for seq in decoding],
                                     [seq.num_tokens - 1 for seq in decoding],
                                     [seq.context() for seq in prefills])
        else:  # every decode row's last token and draft, then the prefills after them
            feeds = [[seq.last_token()] + draft for seq, draft in zip(decoding, drafts)]
            widths = [len(feed) for feed in feeds] + [1] * (len(rows) - num_decode)
            logits = self.runner.verify(feeds, [seq.num_tokens - 1 for seq in decoding])
            if prefills:
                logits = torch.cat((logits, self.runner.run(
                    [], [], [seq.context() for seq in prefills], first_slot=num_decode)))
        if followers:  # same prompt, same logits; the leader's keys and values are written now
            self.runner.kv.move([slot for slot, _ in followers], [lead for _, lead in followers],
                                max(rows[slot].num_prompt for slot, _ in followers))
            shift = len(logits) - (num_decode + len(prefills))  # the drafts' extra rows
            logits = logits[list(range(len(logits))) + [lead + shift for _, lead in followers]]
        if widths is None:
            sampling_rows, counters = rows, [len(seq.request.output_ids) for seq in rows]
        else:
            sampling_rows = [seq for seq, w in zip(rows, widths) for _ in range(w)]
            counters = [len(seq.request.output_ids) + j for seq, w in zip(rows, widths)
                        for j in range(w)]
        sampling = SamplingRows.from_rows(
            [seq.sampling_row for seq in sampling_rows],
            [(seq.seed, c) for seq, c in zip(sampling_rows, counters)],
            all(seq.is_greedy for seq in rows), any(seq.is_filtered for seq in rows),
            self.runner.device)
        tokens, logprobs = sample(logits, sampling)
        tokens, logprobs = tokens.tolist(), logprobs.tolist()  # waits for the device
        reprefill = sum(seq.num_tokens for seq in prefills if seq.is_resumed)
        if reprefill:
            self._count_reprefill(prefills, reprefill, num_decode, time.perf_counter() - t0)
        if widths is None:
            return deltas + self._postprocess(rows, [[t] for t in tokens],
                                              [[x] for x in logprobs])
        return deltas + self._postprocess(rows, *self._verified(rows, drafts, widths, tokens,
                                                                logprobs))

    def _drafts(self, decoding: list[Sequence], admits: bool) -> list[list[int]] | None:
        """A draft per decode row (speculation.py) within `speculation_tokens` fed tokens and
        the KV capacity, or None for a plain step. Which rows draft and how far is
        `plan_drafts` on the step cost curve: first whether drafts could pay at all (`may_pay`,
        from the best row's acceptance), then before the lookups from each row's k and
        acceptance, and after them on what was drafted."""
        fixed = self.speculation_min_drafts is not None
        budget = self.speculation_tokens - len(decoding)
        if budget < (len(decoding) if fixed else 1):
            return None  # the fixed rule: worth it only where every row could have a draft
        cost = self.step_cost
        overhead = cost(1) * (speculative.VERIFY_OVERHEAD + admits)
        if not fixed and not speculative.may_pay(  # a full batch on a CPU stops here
                len(decoding), len(decoding) * self.drafter.max_draft,
                max(seq.spec.p_accept for seq in decoding), cost, overhead):
            return None
        drafter = self.drafter
        drafter.begin_step()
        room = self.kv_capacity_tokens - sum(running_costs(self.scheduler.running))
        max_positions = self.runner.max_positions
        limits = [max(0, min(seq.budget_left - 1, max_positions - seq.num_tokens, seq.spec.k))
                  for seq in decoding]
        if not fixed:
            limits = speculative.plan_drafts(
                len(decoding), [(k, seq.spec.p_accept) for k, seq in zip(limits, decoding)],
                cost, overhead)
            if not any(limits):
                return None
        drafts: list[list[int]] = [[] for _ in decoding]
        for i in sorted(range(len(decoding)), key=lambda i: -decoding[i].spec.acceptance):
            limit = min(limits[i], room, budget)
            if limit > 0:
                drafts[i] = drafter.propose(decoding[i], limit)
                room -= len(drafts[i])
                budget -= len(drafts[i])
        if fixed:
            enough = sum(len(d) for d in drafts) >= self.speculation_min_drafts * len(decoding)
            return drafts if enough and any(drafts) else None
        keep = speculative.plan_drafts(
            len(decoding), [(len(d), seq.spec.p_accept) for d, seq in zip(drafts, decoding)],
            cost, overhead)
        drafts = [d[:n] for d, n in zip(drafts, keep)]
        return drafts if any(drafts) else None

    def _verified(self, rows: list[Sequence], drafts: list[list[int]], widths: list[int],
                  drawn: list[int], drawn_logprobs: list[float]
                  ) -> tuple[list[list[int]], list[list[float]]]:
        """Each row's new tokens: its draft's confirmed prefix and the first differing draw
        (speculation.accept), with the target's log-probs of those tokens."""
        tokens, logprobs, offset = [], [], 0
        for i, (seq, width) in enumerate(zip(rows, widths)):
            draft = drafts[i] if i < len(drafts) else []
            here = drawn[offset:offset + width]
            num = speculative.accept(draft, here)
            tokens.append(draft[:num] + [here[num]])
            logprobs.append(drawn_logprobs[offset:offset + num + 1])
            offset += width
            if draft:
                self.drafter.feedback(seq, len(draft), num)
                self.num_drafted_tokens += len(draft)
                self.num_accepted_tokens += num
        self.num_spec_steps += 1
        return tokens, logprobs

    def _share(self, admitted: list[Sequence], num_decode: int
               ) -> tuple[list[Sequence], list[Sequence], list[tuple[int, int]]]:
        """Split this step's admissions by how their KV is built and order their slots so:
        forks (a running sequence holds their prompt: copy its keys and values but the last
        position, then decode the prompt's last token), prefills (computed), followers (a
        prefill of this step has the same prompt: copy its KV afterwards and reuse its logits).
        Returns (forks, prefills, [(follower slot, leader slot)])."""
        prefills = [seq for seq in admitted if seq.prompt_key is None or not seq.is_fresh]
        self.num_prefill_tokens += sum(seq.num_tokens for seq in prefills)
        if len(prefills) == len(admitted):
            return [], admitted, []
        rows = self.scheduler.running
        holders = {seq.prefix: slot for slot, seq in enumerate(rows[:num_decode])
                   if seq.prefix is not None}
        forks, followers, leaders = [], [], {}
        for seq in admitted:
            if seq.prompt_key is None or not seq.is_fresh:
                continue
            seq.prefix = key = (seq.prompt_key, self.version)
            if key in holders:
                forks.append((seq, holders[key]))
            elif key in leaders:
                followers.append((seq, leaders[key]))
            else:
                leaders[key] = seq
                prefills.append(seq)
                self.num_prefill_tokens += seq.num_tokens
        self.num_prefix_lookups += len(forks) + len(followers) + len(leaders)
        self.num_prefix_hits += len(forks) + len(followers)
        self.num_prefill_tokens += len(forks)
        rows[num_decode:] = [seq for seq, _ in forks] + prefills + [seq for seq, _ in followers]
        if forks:
            self.runner.kv.move(list(range(num_decode, num_decode + len(forks))),
                                [donor for _, donor in forks],
                                max(seq.num_prompt for seq, _ in forks) - 1)
        slot_of = {id(seq): slot for slot, seq in enumerate(rows)}
        return ([seq for seq, _ in forks], prefills,
                [(slot_of[id(seq)], slot_of[id(lead)]) for seq, lead in followers])

    def _count_reprefill(self, admitted: list[Sequence], reprefill: int, num_decode: int,
                         seconds: float) -> None:
        """A re-prefill shares its step with other rows: it is charged the step's time in
        proportion to its tokens (every token-wise op runs over the step's flat token list;
        attention, the one op that is not, is small at these contexts)."""
        step_tokens = num_decode + sum(seq.num_tokens for seq in admitted)
        self.num_reprefill_tokens += reprefill
        self.reprefill_s += seconds * reprefill / step_tokens
        for seq in admitted:
            seq.is_resumed = False

    def _postprocess(self, rows: list[Sequence], tokens: list[list[int]],
                     logprobs: list[list[float]]) -> list[TokenDelta]:
        """Append each row's new tokens (one, or an accepted draft and a draw) up to the first
        that finishes it."""
        deltas, finished, num_new = [], [], 0
        eos, version = self.eos_token_id, self.version
        for slot, (seq, new, new_logprobs) in enumerate(zip(rows, tokens, logprobs)):
            request = seq.request
            output, max_new = request.output_ids, request.params.max_new_tokens
            reason = None
            for i, token in enumerate(new):
                output.append(token)
                if token == eos:
                    reason = "eos"
                elif token in seq.stop_ids or (seq.stop_seqs and seq.stops_at_end(output)):
                    reason = "stop"
                elif len(output) >= max_new:
                    reason = "length"
                if reason is not None:
                    new, new_logprobs = new[:i + 1], new_logprobs[:i + 1]
                    break
            request.logprobs.extend(new_logprobs)
            request.token_versions.extend([version] * len(new))
            seq.num_tokens += len(new)
            num_new += len(new)
            deltas.append(TokenDelta(request.request_id, new, new_logprobs, reason))
            if reason is not None:
                request.finish_reason = reason
                del self._live[request.request_id]
                finished.append(slot)
        self.num_generated_tokens += num_new
        if finished:
            self._apply_moves(self.scheduler.remove_slots(finished))
        return deltas

    def _finish(self, seq: Sequence) -> TokenDelta:
        """Finish a resumed request that arrived with nothing left to generate."""
        last = seq.request.output_ids[-1]
        reason = ("eos" if last == self.eos_token_id else "stop" if last in seq.stop_ids
                  else "length")
        seq.request.finish_reason = reason
        del self._live[seq.request_id]
        return TokenDelta(seq.request_id, [], [], reason)

    def _apply_moves(self, moves: list[tuple[int, int]]) -> None:
        if moves:
            running = self.scheduler.running
            length = max(running[dst].num_cached_tokens for dst, _ in moves)
            self.runner.kv.move([d for d, _ in moves], [s for _, s in moves], length)

    # -- weights and stats ------------------------------------------------------------------------

    def load_weights(self, named_tensors: NamedTensors, version: int, force: bool = False) -> None:
        """Copy tensors into the model in place (names as in `model.state_dict()`), then stamp
        `version` on requests admitted from now on."""
        in_flight = [seq.request_id for seq in self._live.values()
                     if seq in self.scheduler.running or seq.request.version == self.version]
        if version != self.version and in_flight and not force:
            raise RuntimeError(
                f"load_weights(version={version}) refused: {len(in_flight)} request(s) are "
                f"generating with version {self.version} (e.g. '{in_flight[0]}'); let them "
                "finish, abort them, or pass force=True to continue them on the new weights")
        targets = dict(self.model.state_dict(keep_vars=True))
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        dst, src = {}, {}
        for name, tensor in items:
            target = targets.get(name)
            if target is None:
                raise KeyError(f"load_weights: '{name}' is not a tensor of this model "
                               f"(expected names like '{next(iter(targets))}')")
            tensor = torch.as_tensor(tensor)
            if tensor.shape != target.shape:
                raise ValueError(f"load_weights: '{name}' has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(target.shape)}")
            dst[name], src[name] = target, tensor
        # host -> device through the staging buffer on a GPU; one copy_ per tensor on the CPU
        stage_copy(dst, src, self.staging)
        self.runner.refresh()
        self.version = self.scheduler.version = version

    def close(self) -> None:
        """Nothing to free beyond what garbage collection does (the protocol's close)."""

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_used_tokens=self.scheduler.kv_used_tokens(),
            kv_capacity_tokens=self.kv_capacity_tokens,
            num_generated_tokens=self.num_generated_tokens, version=self.version,
            num_drafted_tokens=self.num_drafted_tokens,
            num_accepted_tokens=self.num_accepted_tokens, num_spec_steps=self.num_spec_steps,
            num_prefix_lookups=self.num_prefix_lookups, num_prefix_hits=self.num_prefix_hits)
