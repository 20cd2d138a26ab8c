"""One rollout replica on the simulator's clock: continuous batching with KV accounting.

The replica behaves like a vLLM-class engine (nano-vllm's scheduler, in closed form):
- Waiting trajectories are admitted FIFO while the decode batch is under `max_running` and
  their context (prompt + tokens already generated) fits under the KV capacity less a 1%
  watermark. Admission costs a prefill of that context (a re-prefill for resumed ones).
- Every decode step emits one token per running trajectory, so the KV grows by b per step.
  When the next step would overflow the KV, the newest trajectory is preempted (recompute:
  back to the front of the queue, its tokens kept, its KV dropped).
- Time advances in *segments* with a constant batch: from now to the next finish (or the
  step where the KV fills up), priced in closed form by `DecodeCurve.steps_s`. With
  `quantum` > 1 a segment runs at least that many steps and everything finishing inside it
  leaves at its end (a trajectory's freed slot is reused up to quantum steps late; its
  tokens are exact). This keeps a 1024-GPU run to a few events per trajectory.

- Optional tool calls (agentic workloads): at each of a trajectory's `tool_at` lengths it
  leaves the batch and frees its KV until the result is back, then queues again and its
  context is re-prefilled (no prefix cache: the pessimistic case). It still belongs to the
  replica (`num_reqs`, `is_idle`, `abort_all` count it).

Interface: `add`, `advance_to(t) -> finished`, `next_time`, `abort_all`, `kv_at`, `num_reqs`.
Token accounting: `generated` counts every decoded token once, at finish, abort or preempt;
`in_progress_tokens()` adds what running trajectories decoded since their admission.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable

from laminar.sim.costs import DecodeCurve
from laminar.sim.workload import Traj

WAITING, RUNNING, FINISHED, REMOVED, IN_TOOL = 0, 1, 2, 3, 4
PrefillFn = Callable[[float, float], float]  # (tokens, sum of squared lengths) -> seconds


class Replica:
    def __init__(self, rid: int, curve: DecodeCurve, kv_capacity: int, max_running: int,
                 prefill: PrefillFn, quantum: int = 1, watermark: float = 0.01) -> None:
        self.rid = rid
        self.curve = curve
        self.kv_capacity = kv_capacity
        self.max_running = max_running
        self.prefill = prefill
        self.quantum = max(1, quantum)
        self.admit_limit = kv_capacity * (1.0 - watermark)
        self.version = 0
        self.t = 0.0  # time of the state below
        self.step = 0  # decode steps done since the replica started
        self.kv = 0  # real tokens in the KV cache
        self.waiting: deque[Traj] = deque()
        self.running: list[tuple[int, Traj]] = []  # (serial, traj) in admission order; lazy
        self.n_running = 0
        self._heap: list[tuple[int, int, Traj]] = []  # (finish step, serial, traj), lazy
        self._tools: list[tuple[float, int, Traj]] = []  # (result back at, serial, traj)
        self._serial = 0
        self.generated = 0  # decoded tokens, counted when a trajectory leaves the batch
        self.busy_s = 0.0  # time spent prefilling or decoding
        self.num_preempted = 0
        self._debt = 0.0  # prefill seconds still owed by an interrupted segment
        self._seg: tuple[float, float, int, int, int] | None = None  # t0, prefill, b, kv0, n
        self._seg_end: float | None = None
        self.plan_id = 0  # bumped whenever next_time() changes (lazy event invalidation)

    # --- the interface ------------------------------------------------------------------

    @property
    def num_reqs(self) -> int:
        return self.n_running + len(self.waiting) + len(self._tools)

    @property
    def is_idle(self) -> bool:
        return self.n_running == 0 and not self.waiting and not self._tools

    @property
    def in_tool(self) -> list[Traj]:
        return [tr for _, _, tr in self._tools]

    def next_time(self) -> float | None:
        """When the current segment ends, or the next tool result returns to an idle batch
        (None: nothing to do)."""
        if self._seg_end is not None:
            return self._seg_end
        return self._tools[0][0] if self._tools else None

    def add(self, t: float, trajs: Iterable[Traj], front: bool = False) -> list[Traj]:
        """Queue trajectories at time t; returns those that finished up to t. A trajectory
        still in a tool call (moved by repack) waits for its result here."""
        done = self.advance_to(t)
        for tr in trajs:
            if tr.t_tool_return > t:
                tr.state = IN_TOOL
                self._serial += 1
                heapq.heappush(self._tools, (tr.t_tool_return, self._serial, tr))
                continue
            tr.state = WAITING
            if front:
                self.waiting.appendleft(tr)
            else:
                self.waiting.append(tr)
        self._plan()
        return done

    def advance_to(self, t: float) -> list[Traj]:
        """Run every segment (and tool return) due by t, then the whole steps before t."""
        finished: list[Traj] = []
        while (end := self.next_time()) is not None and end <= t:
            if self._seg is not None:
                t0, pre, b, kv0, n = self._seg
                self._apply_steps(b, n, finished, end)
                self.busy_s += end - t0
            self.t = max(self.t, end)
            self._plan()
        if self._seg is not None and t > self.t:
            t0, pre, b, kv0, n = self._seg
            m = min(self.curve.steps_within(b, kv0, t - t0 - pre), n - 1)
            self._debt = max(0.0, pre - (t - t0))
            self._apply_steps(b, m, finished, t)
            self.busy_s += t - t0
            self.t = t
            self._plan()
        elif t > self.t:
            self.t = t
        return finished

    def abort_all(self, t: float) -> tuple[list[Traj], list[Traj]]:
        """Remove every unfinished trajectory at time t (repack source, interrupt, failure).
        Returns (finished up to t, removed); removed ones keep their generated tokens."""
        finished = self.advance_to(t)
        removed = self.live()
        for tr in removed:
            self._stop(tr)
        removed += list(self.waiting) + self.in_tool  # those keep their return time
        for tr in removed:
            tr.state = REMOVED
        self.waiting.clear()
        self._tools.clear()
        self.running.clear()
        self._heap.clear()
        self.n_running = 0
        self._debt = 0.0
        self._plan()
        return finished, removed

    def kv_at(self, t: float) -> int:
        """KV tokens at time t, without changing the replica (for the repack check)."""
        if self._seg is None or t <= self.t:
            return self.kv
        t0, pre, b, kv0, n = self._seg
        return kv0 + b * min(self.curve.steps_within(b, kv0, t - t0 - pre), n)

    def live(self) -> list[Traj]:
        """The running trajectories, in admission order."""
        return [tr for s, tr in self.running if tr.state == RUNNING and tr.serial == s]

    def in_progress_tokens(self) -> int:
        return sum(min(self.step - tr.admit_step, tr.next_stop - tr.admit_done)
                   for tr in self.live())

    # --- internals ------------------------------------------------------------------------

    def _apply_steps(self, b: int, n: int, finished: list[Traj], now: float) -> None:
        self.step += n
        self.kv += b * n
        heap = self._heap
        while heap and heap[0][0] <= self.step:
            _, serial, tr = heapq.heappop(heap)
            if tr.state != RUNNING or tr.serial != serial:
                continue  # stale entry of a preempted, removed or re-admitted trajectory
            stop = tr.next_stop
            self.kv -= tr.prompt_len + tr.admit_done + (self.step - tr.admit_step)
            self.generated += stop - tr.admit_done
            tr.done = stop
            self.n_running -= 1
            if stop < tr.target:  # a tool call: out of the batch until its result is back
                tr.state = IN_TOOL
                tr.t_tool_return = now + tr.tool_s[tr.tool_i]
                tr.tool_i += 1
                self._serial += 1
                heapq.heappush(self._tools, (tr.t_tool_return, self._serial, tr))
                continue
            tr.state = FINISHED
            finished.append(tr)
        if len(self.running) > 2 * self.n_running + 8:
            self.running = [(s, tr) for s, tr in self.running
                            if tr.state == RUNNING and tr.serial == s]

    def _stop(self, tr: Traj) -> None:
        """Take a running trajectory out of the batch, keeping its tokens."""
        progress = self.step - tr.admit_step
        self.kv -= tr.prompt_len + tr.admit_done + progress
        self.generated += progress
        tr.done = tr.admit_done + progress
        tr.state = WAITING
        self.n_running -= 1

    def _plan(self) -> None:
        """Admit what fits, preempt if the next step would overflow, price the next segment."""
        tokens = sq = 0.0
        waiting = self.waiting
        q = self.quantum
        while self._tools and self._tools[0][0] <= self.t:  # tool results are back: requeue
            tr = heapq.heappop(self._tools)[2]
            tr.state = WAITING
            waiting.append(tr)
        while waiting and self.n_running < self.max_running:
            tr = waiting[0]
            ctx = tr.prompt_len + tr.done
            # Room for the prompt and for one quantum of growth of the whole batch.
            if self.n_running and self.kv + ctx + (self.n_running + 1) * q > self.admit_limit:
                break
            waiting.popleft()
            self._admit(tr)
            tokens += ctx
            sq += ctx * ctx
        if self.n_running == 0:
            self.plan_id += 1
            self._seg = self._seg_end = None
            return
        while self.n_running > 1 and self.kv + self.n_running * q > self.kv_capacity:
            serial, tr = self.running.pop()
            if tr.state != RUNNING or tr.serial != serial:
                continue
            self._stop(tr)
            waiting.appendleft(tr)
            self.num_preempted += 1
        b = self.n_running
        heap = self._heap
        while heap[0][2].state != RUNNING or heap[0][2].serial != heap[0][1]:
            heapq.heappop(heap)  # drop stale entries so that the next finish is a real one
        n = max(heap[0][0] - self.step, self.quantum)
        room = (self.kv_capacity - self.kv) // b
        n = max(1, min(n, room)) if room >= 1 else 1
        pre = self._debt + (self.prefill(tokens, sq) if tokens else 0.0)
        if self._tools:  # end the segment when the next tool result is back
            dt = self._tools[0][0] - self.t - pre
            n = max(1, min(n, self.curve.steps_within(b, self.kv, dt) + 1))
        self._debt = 0.0
        self.plan_id += 1
        self._seg = (self.t, pre, b, self.kv, n)
        self._seg_end = self.t + pre + self.curve.steps_s(b, self.kv, n)

    def _admit(self, tr: Traj) -> None:
        tr.state = RUNNING
        tr.admit_step = self.step
        tr.admit_done = tr.done
        tr.t_tool_return = -1.0
        tr.finish_step = self.step + tr.next_stop - tr.done
        self.kv += tr.prompt_len + tr.done
        self._serial += 1
        tr.serial = self._serial
        heapq.heappush(self._heap, (tr.finish_step, tr.serial, tr))
        self.running.append((tr.serial, tr))
        self.n_running += 1
