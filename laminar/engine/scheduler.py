"""Who runs this step: admission against the KV capacity, preemption of the newest, slot order.

    plan_step(running, waiting, capacity, max_batch) -> (num_preempt, num_admit)   # pure
    scheduler.schedule() -> admitted sequences (and the slot moves it made)

KV accounting is in real tokens. A running sequence holds `num_tokens - 1` cached tokens and
grows by one each decode step, so the step needs `sum(num_tokens)` over running sequences; a
waiting sequence needs its whole context (prompt + tokens already generated) at prefill.
- Decode growth that would overflow preempts the newest running sequences (latest admitted)
  back to the front of the waiting queue; they are re-prefilled later, nothing is lost.
- Admission is FIFO: the head of the queue is admitted when a batch slot is free and its
  context fits with room for its next token; nothing overtakes it. A step that preempts
  admits nobody.

Shared prompts (sequence.py: `prefix`) are counted once: the oldest running holder of a prefix
carries its tokens, the others only their own. Preempting newest first frees exactly what the
plan subtracts (a prefix's tokens go with its last holder), and a fresh waiting sequence whose
prompt a running sequence (or one ahead of it in the queue) holds costs only its own tokens:
the engine forks it from that holder instead of prefilling it (engine.py).

Running sequences sit in KV slots 0..n-1 without holes: `running[i]` is slot i. Removing
sequences fills each hole with a survivor from the end (`compact`), and the caller copies
those slots' KV once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence as Seq

from laminar.engine.sequence import Sequence


def plan_step(running: Seq[int], waiting: Seq[int], capacity: int, max_batch: int
              ) -> tuple[int, int]:
    """Decide one step. `running`: num_tokens of running sequences, oldest admission first;
    `waiting`: context lengths in queue order. Returns (preempt this many of the newest
    running, admit this many from the head of the queue)."""
    need = sum(running)
    num_preempt = 0
    while need > capacity and num_preempt < len(running):
        num_preempt += 1
        need -= running[-num_preempt]
    if num_preempt:
        return num_preempt, 0
    num_admit, free_slots = 0, max_batch - len(running)
    # an admitted context must also leave room for its first decode token, or the next step
    # would preempt it straight away and its prefill would be wasted
    while (num_admit < len(waiting) and num_admit < free_slots
           and need + waiting[num_admit] + 1 <= capacity):
        need += waiting[num_admit] + 1
        num_admit += 1
    return 0, num_admit


def compact(num_running: int, removed: Iterable[int]) -> list[tuple[int, int]]:
    """Slot moves (dst, src) that close the holes left by `removed` among slots 0..n-1."""
    removed = set(removed)
    survivors = num_running - len(removed)
    holes = sorted(s for s in removed if s < survivors)
    movers = [s for s in range(survivors, num_running) if s not in removed]
    return list(zip(holes, movers))


def running_costs(running: Seq[Sequence]) -> list[int]:
    """Tokens each running sequence needs this step (`num_tokens`: cache and next token), a
    shared prefix charged to its first holder in `running` order only."""
    held: set = set()
    costs = []
    for seq in running:
        cost = seq.num_tokens
        if seq.prefix is not None:
            if seq.prefix in held:
                cost -= seq.num_prompt
            else:
                held.add(seq.prefix)
        costs.append(cost)
    return costs


def waiting_costs(running: Seq[Sequence], waiting: Iterable[Sequence], version: int) -> list[int]:
    """Context lengths to prefill, in queue order; a fresh sequence whose prompt a running
    sequence or an earlier waiting one will hold costs nothing (plan_step adds its next
    token)."""
    held = {seq.prefix for seq in running if seq.prefix is not None}
    costs = []
    for seq in waiting:
        cost = seq.num_tokens
        if seq.prompt_key is not None and seq.is_fresh:
            key = (seq.prompt_key, version)
            if key in held:
                cost -= seq.num_prompt
            else:
                held.add(key)
        costs.append(cost)
    return costs


class Scheduler:
    def __init__(self, max_batch_size: int, kv_capacity_tokens: int) -> None:
        self.max_batch_size = max_batch_size
        self.kv_capacity_tokens = kv_capacity_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preempted = 0
        self.version = 0  # weight version a prefix shared from now on is keyed with
        self._admissions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def kv_used_tokens(self) -> int:
        """Real tokens in the KV cache, a shared prompt counted once."""
        return sum(running_costs(self.running)) - len(self.running)

    def schedule(self) -> tuple[list[Sequence], list[tuple[int, int]]]:
        """Preempt or admit for the coming step. Returns (admitted sequences, now in the last
        slots; slot moves (dst, src) the caller must apply to the KV buffer first)."""
        if not self.waiting or len(self.running) >= self.max_batch_size:
            if sum(running_costs(self.running)) <= self.kv_capacity_tokens:
                return [], []  # the common decode-only step: skip the sort and the plan
        by_age = sorted(self.running, key=lambda seq: seq.admitted_at)
        num_preempt, num_admit = plan_step(
            running_costs(by_age), waiting_costs(by_age, self.waiting, self.version),
            self.kv_capacity_tokens, self.max_batch_size)
        moves: list[tuple[int, int]] = []
        if num_preempt:
            victims = by_age[-num_preempt:]
            moves = self.remove(victims)
            for seq in victims:
                seq.prefix = None  # re-admitted with tokens generated: a full re-prefill
            self.waiting.extendleft(reversed(victims))  # oldest victim ends up first
            self.num_preempted += num_preempt
        admitted = [self.waiting.popleft() for _ in range(num_admit)]
        for seq in admitted:
            seq.admitted_at = self._admissions
            self._admissions += 1
        self.running.extend(admitted)
        return admitted, moves

    def discard(self, seqs: Iterable[Sequence]) -> list[tuple[int, int]]:
        """Drop sequences wherever they are (running or waiting); returns the slot moves."""
        gone = {id(seq) for seq in seqs}
        self.waiting = deque(seq for seq in self.waiting if id(seq) not in gone)
        return self.remove([seq for seq in self.running if id(seq) in gone])

    def remove(self, seqs: Iterable[Sequence]) -> list[tuple[int, int]]:
        """Take running sequences out; returns the slot moves that keep slots dense."""
        slot_of = {id(seq): slot for slot, seq in enumerate(self.running)}
        return self.remove_slots([slot_of[id(seq)] for seq in seqs])

    def remove_slots(self, slots: list[int]) -> list[tuple[int, int]]:
        moves = compact(len(self.running), slots)
        for dst, src in moves:
            self.running[dst] = self.running[src]
        del self.running[len(self.running) - len(slots):]
        return moves
