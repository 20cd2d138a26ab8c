"""Reward functions in killable worker processes: a timeout per call, retries, and a reason
when a call fails for good.

    rewards = open_rewards(cfg.task)                  # a RewardPool or InlineRewards
    call = rewards.submit(prompt, response, answer)   # returns at once
    if call.done: call.reward, call.failed, call.error
    rewards.close()                                   # kills the workers

One try of a call fails for a reason in `FAILURES` (laminar/tasks/rewards.py): `error` (it
raised, returned something that is not a number, or its worker died), `timeout`, `nan` (NaN or
inf) or `out_of_range` (outside [0, 1]). It is tried again up to `task.reward_retries` times;
then the call is done with reward 0 and `failed` set to the last try's reason.

`RewardPool` runs the reward in up to `task.reward_workers` worker processes, started on demand
as fresh interpreters (the rollout runs in a threaded Ray actor, where fork is unsafe), each in
a process group of its own and on one call at a time. A thread of the pool's own hands calls to
idle workers and collects answers the moment they arrive (so the caller only reads `done`, and
no call waits behind another), and kills the process group of a worker whose call outlives
`task.reward_timeout_s`, reaping it; the call is then tried again in a new worker. A worker dies
with its parent: the kernel kills it when the pool's thread ends (PR_SET_PDEATHSIG; the thread
lives until `close`), and it exits at EOF on its pipe.

`InlineRewards` calls the reward in the caller's thread, with the same retries and reasons and
no timeout: for laminar's own rewards, which are fast and trusted (`task.reward_isolation`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe, wait

from laminar.config import TaskConfig
from laminar.tasks.rewards import RewardFn, call_reward, resolve_reward

START_TIMEOUT_S = 60.0  # a worker not ready by then (an import that hangs) is killed
# A worker: wait for the parent's path list, then serve (only the standard library before that).
BOOT = ("import sys; from multiprocessing.connection import Connection; "
        "conn = Connection(int(sys.argv[1])); sys.path[:] = conn.recv(); "
        "from laminar.tasks.reward_pool import serve; serve(conn, int(sys.argv[2]))")


@dataclass
class RewardCall:
    """One response to score; `done` (set last) once it has a reward or has failed for good."""

    args: tuple[str, str, str]  # prompt, response, answer
    tries: int = 0  # tries that ended
    reward: float = 0.0
    failed: str | None = None  # once done: the last try's reason (FAILURES) when every try failed
    error: str | None = None  # what went wrong on the last failed try
    done: bool = False


def end_try(call: RewardCall, reward: float, reason: str | None, error: str | None,
            retries: int) -> None:
    """Record one try's outcome: done when it worked or when it was the last one allowed."""
    call.tries += 1
    if reason is None:
        call.reward = reward
    else:
        call.error = error
        if call.tries <= retries:
            return
        call.failed = reason
    call.done = True


class InlineRewards:
    """The reward in the caller's thread: each call is done when `submit` returns."""

    def __init__(self, fn: RewardFn, retries: int = 0) -> None:
        self.fn, self.retries = fn, retries

    def submit(self, prompt: str, response: str, answer: str) -> RewardCall:
        call = RewardCall((prompt, response, answer))
        while not call.done:
            end_try(call, *call_reward(self.fn, *call.args), self.retries)
        return call

    def close(self) -> None:
        pass


class Worker:
    """One worker process and the call it is on."""

    def __init__(self, reward: str | None, timeout_s: float) -> None:
        ours, theirs = Pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", BOOT, str(theirs.fileno()), str(os.getpid())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self.conn = ours
        self.conn.send(list(sys.path))
        self.conn.send(reward)
        self.timeout_s = timeout_s
        self.ready = False
        self.call: RewardCall | None = None
        self.since = time.monotonic()  # when it was started, then when its call was sent

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def deadline(self) -> float | None:
        if not self.ready:
            return self.since + START_TIMEOUT_S
        return None if self.call is None else self.since + self.timeout_s

    def assign(self, call: RewardCall) -> None:
        self.call, self.since = call, time.monotonic()
        self.conn.send(call.args)

    def receive(self) -> tuple[list[tuple], bool]:
        """(messages waiting on the pipe, whether the worker is gone)."""
        out = []
        try:
            while self.conn.poll():
                out.append(self.conn.recv())
        except (EOFError, OSError):
            return out, True
        return out, False

    def kill(self) -> None:
        """SIGKILL the worker and whatever it started in its process group; reap it. (Not
        reaped before: its pid, the group's id, cannot have been reused.)"""
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.conn.close()


class RewardPool:
    """A reward (a dotted path, None = the built-in) in up to `num_workers` killable processes,
    served by a thread of the pool's own from the first `submit` to `close`."""

    def __init__(self, reward: str | None, num_workers: int, timeout_s: float, retries: int) -> None:
        resolve_reward(reward)  # a bad path is a ConfigError here, not in every worker
        self.reward, self.num_workers = reward, num_workers
        self.timeout_s, self.retries = timeout_s, retries
        self.lock = threading.Lock()  # the queue and the workers: the caller's thread and the pool's
        self.queue: deque[RewardCall] = deque()  # to try (again), not sent to a worker yet
        self.workers: list[Worker] = []
        self.thread: threading.Thread | None = None
        self.closing = False
        self.crash: BaseException | None = None  # what ended the thread, if not `close`
        self.wake_r, self.wake_w = Pipe(duplex=False)  # a submit or close wakes the thread

    def submit(self, prompt: str, response: str, answer: str) -> RewardCall:
        call = RewardCall((prompt, response, answer))
        with self.lock:
            if self.crash is not None:
                raise RuntimeError(f"the reward pool's thread died: {self.crash!r}") from self.crash
            self.queue.append(call)
            if self.thread is None:
                self.thread = threading.Thread(target=self._serve, daemon=True, name="reward-pool")
                self.thread.start()
        self.wake_w.send_bytes(b"")
        return call

    def close(self) -> None:
        """Stop the thread and kill every worker; unanswered calls stay queued (a later
        `submit` starts the thread and new workers again)."""
        with self.lock:
            thread, self.closing = self.thread, True
        if thread is not None:
            self.wake_w.send_bytes(b"")
            thread.join()
        with self.lock:
            self.closing, self.thread = False, None

    @property
    def num_pending(self) -> int:
        """Calls not answered yet."""
        with self.lock:
            return len(self.queue) + sum(w.call is not None for w in self.workers)

    # ------------------------------------------------------------------------- the pool's thread

    def _serve(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # no caller to raise to here: the next submit raises it
            self.crash = e
        with self.lock:
            for w in self.workers:
                w.kill()
                if w.call is not None:
                    self.queue.appendleft(w.call)
            self.workers = []

    def _loop(self) -> None:
        while True:
            with self.lock:
                if self.closing:
                    return
                self._step()
                deadlines = [d for w in self.workers if (d := w.deadline) is not None]
                conns = [w.conn for w in self.workers]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            if self.wake_r in wait([*conns, self.wake_r], timeout):
                while self.wake_r.poll():
                    self.wake_r.recv_bytes()

    def _step(self) -> None:
        """Collect answers, kill workers past their deadline, retry, send queued calls."""
        for w in list(self.workers):
            messages, gone = w.receive()
            for msg in messages:
                if msg[0] == "ready":
                    w.ready = True
                else:
                    call, w.call = w.call, None
                    self._ended(call, *msg[1:])
            late = w.deadline is not None and time.monotonic() > w.deadline
            if gone:
                w.kill()  # reaped (its group too) before the exit code is read
                self._lose(w, "error", f"the reward worker (pid {w.pid}) died (exit code "
                                       f"{w.proc.returncode})")
            elif late and w.ready:
                self._lose(w, "timeout", f"no answer within task.reward_timeout_s="
                                         f"{self.timeout_s:g}s; worker pid {w.pid} killed")
            elif late:
                self._lose(w, "timeout", f"the reward worker did not start within "
                                         f"{START_TIMEOUT_S:.0f}s: does importing the reward hang?")
        while self.queue and len(self.workers) < self.num_workers:
            self.workers.append(Worker(self.reward, self.timeout_s))
        for w in self.workers:
            if self.queue and w.ready and w.call is None:
                w.assign(self.queue.popleft())

    def _ended(self, call: RewardCall, reward: float, reason: str | None, error: str | None) -> None:
        end_try(call, reward, reason, error, self.retries)
        if not call.done:
            self.queue.appendleft(call)  # its next try goes first

    def _lose(self, w: Worker, reason: str, error: str) -> None:
        """Kill `w`; the call it was on (or, if it never started, the next queued one, so that
        a reward that cannot start still ends) has failed a try."""
        w.kill()
        self.workers.remove(w)
        call = w.call if w.ready else (self.queue.popleft() if self.queue else None)
        if call is not None:
            self._ended(call, 0.0, reason, error)


def open_rewards(cfg: TaskConfig) -> RewardPool | InlineRewards:
    """The reward of `cfg`, isolated as `task.reward_isolation` says."""
    isolation = cfg.reward_isolation
    if isolation == "auto":
        own = cfg.reward is None or cfg.reward.startswith("laminar.tasks.rewards:")
        isolation = "inline" if own else "process"
    if isolation == "process":
        return RewardPool(cfg.reward, cfg.reward_workers, cfg.reward_timeout_s, cfg.reward_retries)
    return InlineRewards(resolve_reward(cfg.reward), cfg.reward_retries)


# ----------------------------------------------------------------------------- the worker side

def serve(conn: Connection, parent: int) -> None:
    """A worker's life: die with the parent, load the reward, answer calls until EOF."""
    die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    reward = conn.recv()
    try:
        fn, broken = resolve_reward(reward), None
    except Exception as e:  # answered as an `error` on every call, like a reward that raises
        fn, broken = None, f"cannot load task.reward='{reward}' in a worker process: {e}"
    conn.send(("ready",))
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        out = call_reward(fn, *args) if fn is not None else (0.0, "error", broken)
        conn.send(("answer", *out))


def die_with(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent goes (Linux); go now if it has."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: an idle worker still ends at EOF on its pipe
    if os.getppid() != parent:
        os._exit(0)
