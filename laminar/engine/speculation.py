"""Lossless speculative decoding: drafts from a group's own history, verified by the target model.

    drafter = Drafter(max_draft=4)
    drafter.register(seq)                # at add: the sequence joins its prompt's index
    draft = drafter.propose(seq, limit)  # up to k tokens (maybe none), deterministic
    num = accept(draft, drawn)           # how many the target's own draws confirm
    drafter.feedback(seq, len(draft), num)

Drafts. A GRPO group's samples answer the same prompt, and a prompt comes back epoch after
epoch, so the tokens a sample is about to produce have often been produced already.
`PromptIndex` holds, per prompt, every output this engine has seen for it (running and finished
siblings, earlier epochs, resumed samples) and the prompt itself, as a table from n-grams
(orders `ORDERS`) to where they continued. A sequence's draft is the continuation of the most
recent occurrence of its context's last n tokens, longest order first. The index is bounded:
`max_prompts` prompts (least recently used dropped), `MAX_STREAMS` outputs per prompt.

Verification. The engine feeds each row its last token and its draft in one forward
(model_runner.py `verify`) and draws a token at every position exactly as a plain step would:
Gumbel-max with the counter-based noise of the token's own index (sampler.py). `accept` keeps
the draft's leading tokens that equal those draws, then the first draw that differs (or the
draw after a fully accepted draft). That is the standard rejection rule for a point-mass
drafter: P(draw = d) = p(d), so d is accepted with probability p(d), and a draw that is not d
is distributed as p with d removed and renormalised (the Gumbel-max argmax conditioned on not
being d). The sampling distribution is the target's (temperature, top-k, top-p applied), the
random numbers are the ones the token would have had without speculation, so a sequence comes
out token for token as without speculation (up to float rounding between the verify and the
decode forward), and the log-probs recorded are the target's for the emitted tokens.

Adaptive k (`SpecState`): after a fully accepted draft k grows by one (up to max_draft); after
a rejection it becomes the accepted count + 1. A sequence whose recent acceptance (an
exponential average) is below `MIN_ACCEPTANCE` drafts only every `PROBE_EVERY` steps, so
speculation costs almost nothing where no history helps (early in training, new prompts).

When to draft (`plan_drafts`, the engine's default rule). A step's cost grows with the tokens it
feeds (`StepCost`: the measured decode curve, knee.py). A row's i-th draft token adds p^i
expected tokens, p its per-token acceptance (`SpecState.p_accept`, from `PRIOR_P_ACCEPT`);
the step feeds the draft tokens of highest p^i that maximise expected tokens per unit cost, a
verifying step also paying `VERIFY_OVERHEAD` (and one more forward when it admits), none when
a plain step does better. Without the overhead, on an affine curve a + c·t (knee B = a / c) a
draft token pays when p^i > n / (B + n) for n rows: most in the tail, little in a full batch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping

ORDERS = (4, 2)  # n-gram orders matched, longest first
MAX_ENTRIES = 4  # occurrences kept per n-gram, most recent last
MAX_STREAMS = 64  # outputs kept per prompt (the oldest half dropped beyond this)
MIN_ACCEPTANCE = 0.3
PROBE_EVERY = 8
_EMA = 0.3  # weight of the newest verification in the acceptance average
PRIOR_P_ACCEPT = 0.5  # a sequence's per-token acceptance before its first verification
DEFAULT_KNEE = 32  # tokens at which a step costs twice a 1-token step, when none is measured
# what a verifying step costs beyond its tokens, in 1-token steps: the drafter's lookups, the
# attention layout, the acceptance bookkeeping (an estimate: the layout alone is 0.1-0.5 of a
# 1-token step here, docs/engine.md); a step that also admits pays one more forward (its
# prefills run in their own forward after the verify)
VERIFY_OVERHEAD = 0.4


class StepCost:
    """A step's cost as a function of the tokens it feeds: piecewise linear through a measured
    decode curve {tokens: ms} (knee.py's `curve_ms`: one token per row), extended along its last
    segment; without a curve, affine with the knee at `DEFAULT_KNEE` tokens (relative units)."""

    __slots__ = ("points", "_table")

    def __init__(self, curve: Mapping[int, float] | None = None) -> None:
        if curve is None:
            curve = {1: DEFAULT_KNEE + 1.0, 2 * DEFAULT_KNEE: 3.0 * DEFAULT_KNEE}
        points = sorted((int(t), float(ms)) for t, ms in curve.items())
        if len(points) < 2 or points[0][0] < 1 or any(ms <= 0 for _, ms in points):
            raise ValueError(f"a step cost curve needs 2+ points at tokens >= 1 with positive "
                             f"costs, got {dict(curve)}")
        self.points = points
        self._table: list[float] = []  # cost at 0, 1, 2, ... tokens, filled on demand

    def __call__(self, tokens: int) -> float:
        table = self._table
        if tokens >= len(table):
            table.extend(self._interpolate(t) for t in range(len(table), 2 * tokens + 64))
        return table[tokens]

    def knee_tokens(self) -> int:
        """The fewest tokens whose step costs twice a 1-token step, at most the curve's last
        point (a curve that never doubles is flat as far as it was measured)."""
        last, double = self.points[-1][0], 2.0 * self(1)
        return next((t for t in range(1, last + 1) if self(t) >= double), last)

    def _interpolate(self, tokens: int) -> float:
        pts = self.points
        for (t0, c0), (t1, c1) in zip(pts, pts[1:]):
            if tokens <= t1 or t1 == pts[-1][0]:
                return max(c0 + (c1 - c0) * (tokens - t0) / (t1 - t0), 1e-9 * c0)
        raise AssertionError("unreachable: the loop's last segment returns")


def plan_drafts(num_rows: int, offers: list[tuple[int, float]], cost: Callable[[int], float],
                overhead: float = 0.0) -> list[int]:
    """Draft tokens each row should feed this step. `offers[r]` = (up to how many row r may
    feed, its per-token acceptance p); `num_rows` decode rows feed one token each anyway.
    Row r's i-th draft token is worth p^i expected tokens (all before it accepted); the step
    takes the most valuable tokens while each raises expected tokens / (cost(num_rows + m) +
    overhead), `overhead` being what a verifying step costs beyond its tokens (on a cost curve
    whose slope does not fall, that rate rises then falls: the first fall is the best); then
    keeps them only if that beats a plain step's num_rows / cost(num_rows). Zeros otherwise."""
    plain = num_rows / cost(num_rows)
    likeliest = max((p for k, p in offers if k > 0), default=0.0)
    if not may_pay(num_rows, sum(k for k, _ in offers), likeliest, cost, overhead):
        return [0] * len(offers)  # the common case in a full batch, decided without sorting
    values = sorted(((p ** i, r) for r, (k, p) in enumerate(offers) for i in range(1, k + 1)),
                    reverse=True)
    lengths, expected = [0] * len(offers), float(num_rows)
    rate = num_rows / (cost(num_rows) + overhead)
    for m, (value, r) in enumerate(values, 1):
        expected += value
        with_it = expected / (cost(num_rows + m) + overhead)
        if with_it <= rate:
            break
        rate = with_it
        lengths[r] += 1
    return lengths if rate > plain else [0] * len(offers)


def may_pay(num_rows: int, num_drafts: int, p: float, cost: Callable[[int], float],
            overhead: float = 0.0) -> bool:
    """Whether any of `num_drafts` draft tokens, none accepted with more than probability p,
    could make a step beat a plain one (`plan_drafts`' rate with every value at p, checked at
    one token and at all of them: on an affine cost the rate is monotonic in between)."""
    plain = num_rows / cost(num_rows)
    return any((num_rows + m * p) / (cost(num_rows + m) + overhead) > plain
               for m in {1, num_drafts} if m > 0)


def accept(draft: list[int], drawn: list[int]) -> int:
    """Leading draft tokens confirmed: draft[i] is kept while it equals drawn[i], the token the
    target draws at that position given everything before it. `drawn` has len(draft) + 1."""
    num = 0
    while num < len(draft) and draft[num] == drawn[num]:
        num += 1
    return num


def _window(prompt: list[int], out: list[int], end: int, n: int) -> tuple[int, ...]:
    """The n tokens of prompt + out that end (exclusive) at `end`, without concatenating."""
    num_prompt = len(prompt)
    if end - n >= num_prompt:
        return tuple(out[end - n - num_prompt:end - num_prompt])
    if end <= num_prompt:
        return tuple(prompt[end - n:end])
    return tuple(prompt[end - n:]) + tuple(out[:end - num_prompt])


class PromptIndex:
    """One prompt's outputs (stream 0 is the prompt itself) and n-gram -> (stream, position of
    the token that followed). Output streams are the requests' own `output_ids` lists, read as
    they grow; `catch_up` indexes what they gained since last time."""

    __slots__ = ("prompt", "streams", "indexed", "table", "stamp")

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt
        self.streams: list[list[int]] = [prompt]
        self.indexed = [len(prompt)]
        self.table: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self.stamp = -1  # the drafter step that last caught up
        for end in range(1, len(prompt)):
            for n in ORDERS:
                if end >= n:
                    self._put(tuple(prompt[end - n:end]), 0, end)

    def _put(self, key: tuple[int, ...], stream: int, pos: int) -> None:
        entries = self.table.get(key)
        if entries is None:
            self.table[key] = [(stream, pos)]
        else:
            entries.append((stream, pos))
            if len(entries) > MAX_ENTRIES:
                del entries[0]

    def add_stream(self, out: list[int]) -> int:
        for sid, stream in enumerate(self.streams):
            if stream is out:
                return sid
        if len(self.streams) > MAX_STREAMS:
            self._rebuild(self.streams[len(self.streams) - MAX_STREAMS // 2:])
        self.streams.append(out)
        self.indexed.append(0)
        return len(self.streams) - 1

    def _rebuild(self, keep: list[list[int]]) -> None:
        fresh = PromptIndex(self.prompt)
        for out in keep:
            fresh.streams.append(out)
            fresh.indexed.append(0)
        fresh.catch_up()
        self.streams, self.indexed, self.table = fresh.streams, fresh.indexed, fresh.table

    def catch_up(self) -> None:
        prompt, num_prompt = self.prompt, len(self.prompt)
        for sid in range(1, len(self.streams)):
            out, pos = self.streams[sid], self.indexed[sid]
            while pos < len(out):  # the context up to out[pos] continued with out[pos]
                end = num_prompt + pos
                for n in ORDERS:
                    if end >= n:
                        self._put(_window(prompt, out, end, n), sid, pos)
                pos += 1
            self.indexed[sid] = pos

    def lookup(self, out: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent occurrence of the context's tail."""
        end = len(self.prompt) + len(out)
        for n in ORDERS:
            if end < n:
                continue
            for sid, pos in reversed(self.table.get(_window(self.prompt, out, end, n), ())):
                stream = self.streams[sid]
                if pos < len(stream):
                    return stream[pos:pos + k]
        return []


class SpecState:
    """A sequence's place in the drafter: its prompt's index, its stream, its adaptive k."""

    __slots__ = ("index", "stream", "k", "acceptance", "wait", "p_accept")

    def __init__(self, index: PromptIndex, stream: int, k: int) -> None:
        self.index, self.stream, self.k = index, stream, k
        self.acceptance = 1.0  # optimistic: a new sequence drafts at once
        # P(a draft token is accepted | the ones before it were): plan_drafts' p
        self.p_accept = PRIOR_P_ACCEPT
        self.wait = 0  # steps until the next probe while acceptance is low


class Drafter:
    def __init__(self, max_draft: int, max_prompts: int = 512) -> None:
        if max_draft < 1:
            raise ValueError(f"max_draft={max_draft} must be >= 1")
        self.max_draft = max_draft
        self.max_prompts = max_prompts
        self.prompts: OrderedDict[tuple[int, ...], PromptIndex] = OrderedDict()
        self.num_steps = 0

    def register(self, seq) -> None:
        """`seq` (sequence.py) joins its prompt's index; its output is a stream from now on."""
        key = tuple(seq.request.prompt_ids)
        index = self.prompts.get(key)
        if index is None:
            index = self.prompts[key] = PromptIndex(list(seq.request.prompt_ids))
            if len(self.prompts) > self.max_prompts:
                self.prompts.popitem(last=False)
        else:
            self.prompts.move_to_end(key)
        seq.spec = SpecState(index, index.add_stream(seq.request.output_ids),
                             max(1, self.max_draft // 2))

    def begin_step(self) -> None:
        self.num_steps += 1

    def propose(self, seq, limit: int) -> list[int]:
        """A draft of at most min(k, limit) tokens for `seq`'s next positions (maybe none)."""
        state = seq.spec
        if state.acceptance < MIN_ACCEPTANCE:
            if state.wait > 0:
                state.wait -= 1
                return []
            state.wait = PROBE_EVERY
        k = min(state.k, limit)
        if k <= 0:
            return []
        index = state.index
        if index.stamp != self.num_steps:
            index.catch_up()
            index.stamp = self.num_steps
        return index.lookup(seq.request.output_ids, k)

    def feedback(self, seq, num_drafted: int, num_accepted: int) -> None:
        state = seq.spec
        state.acceptance += _EMA * (num_accepted / num_drafted - state.acceptance)
        # tokens tested: the accepted ones and the first rejected one, if any
        p = num_accepted / (num_accepted + (num_accepted < num_drafted))
        state.p_accept += _EMA * (p - state.p_accept)
        state.k = (min(self.max_draft, state.k + 1) if num_accepted == num_drafted
                   else num_accepted + 1)
