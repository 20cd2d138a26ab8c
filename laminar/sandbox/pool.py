"""`Sandbox`: a warm pool of one-shot sandbox processes (forked by a zygote, or each started on
its own); `resolve_backend`; `shared_sandbox`."""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import queue
import shutil
import threading
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from laminar.config import SandboxConfig
from laminar.sandbox.proc import SandboxProc
from laminar.sandbox.result import RunResult, SandboxError, SandboxSlow
from laminar.sandbox.zygote import Zygote

log = logging.getLogger(__name__)

ARUN_THREADS = 64  # arun() calls of one Sandbox waiting or running at once
_probe_lock = threading.Lock()
_probes: dict[str, str | None] = {}  # backend -> None (works) or why it does not
_slow: set[str] = set()  # backends whose latest test run was only slow to start (not cached)
_warned_unsafe = False


def probe(backend: str) -> str | None:
    """None when `backend` can start a sandbox here, else why not. Tried once per process (a
    real sandbox running `print('ok')`), then cached — except a test sandbox that was only slow
    to start (SandboxSlow: a busy machine says nothing about isolation), which is asked again at
    the next call instead of failing every later tool call of the process."""
    with _probe_lock:
        if backend in _probes:
            return _probes[backend]
        why: str | None
        if backend == "bwrap" and shutil.which("bwrap") is None:
            why = "bubblewrap (bwrap) is not installed"
        else:
            try:
                r = SandboxProc.start(backend, SandboxConfig()).run("print('ok')", 20.0)
                why = None if (r.status, r.stdout) == ("ok", "ok\n") else (
                    f"a test run gave status {r.status}: {r.observation().strip()[:300]}")
            except SandboxSlow as e:
                _slow.add(backend)
                log.warning("sandbox: the %s test run was slow to start (%s); asking again at "
                            "the next call", backend, e)
                return str(e)
            except SandboxError as e:
                why = str(e)
            except OSError as e:
                why = f"{type(e).__name__}: {e}"
        _slow.discard(backend)
        _probes[backend] = why
        return why


def resolve_backend(cfg: SandboxConfig) -> str:
    """The backend `cfg` means here: "bwrap", "unshare" or "unsafe". `auto` is bwrap when it is
    installed and works, else unshare when the kernel allows its namespaces, else unsafe when
    `allow_unsafe` (logged once), else SandboxError."""
    global _warned_unsafe
    b = cfg.backend
    if b == "unsafe":
        if not cfg.allow_unsafe:
            raise SandboxError("sandbox.backend=unsafe runs untrusted code without isolation and "
                               "is refused unless sandbox.allow_unsafe=true; set it only where the "
                               "code is trusted, else use sandbox.backend=auto")
        return "unsafe"
    if b in ("bwrap", "unshare"):
        why = probe(b)
        if why is not None:
            other = "unshare" if b == "bwrap" else "bwrap"
            raise SandboxError(f"sandbox.backend={b} cannot run here ({why}); try "
                               f"sandbox.backend={other} or auto, or (no isolation) "
                               "sandbox.backend=unsafe with sandbox.allow_unsafe=true")
        return b
    if b != "auto":
        raise SandboxError(f"sandbox.backend={b!r} is not one of auto, bwrap, unshare, unsafe")
    reasons = []
    for cand in ("bwrap", "unshare"):
        why = probe(cand)
        if why is None:
            return cand
        reasons.append(f"{cand}: {why}")
    slow = [c for c in ("bwrap", "unshare") if c in _slow]
    if slow:  # not a verdict on this machine: this call fails, the next one tries again
        raise SandboxSlow(f"sandbox.backend=auto: the {slow[0]} sandbox was slow to start on a "
                          f"busy machine ({'; '.join(reasons)}); this call fails and the next one "
                          "tries again")
    if cfg.allow_unsafe:
        if not _warned_unsafe:
            _warned_unsafe = True
            log.warning("sandbox: no isolation available (%s); sandbox.allow_unsafe=true, so "
                        "untrusted code runs as a plain subprocess with rlimits only",
                        "; ".join(reasons))
        return "unsafe"
    raise SandboxError("sandbox.backend=auto found no isolation here (" + "; ".join(reasons)
                       + "); run where namespaces are allowed (e.g. a container with "
                       "--security-opt seccomp=unconfined or user namespaces enabled) or install "
                       "bubblewrap, or accept no isolation with sandbox.allow_unsafe=true")


class _Spawner:
    """One long-lived thread that starts the warm sandboxes. Each sandbox's outer process dies
    with the thread that forked it (PR_SET_PDEATHSIG), so warm ones must come from a thread
    that lives as long as the process."""

    def __init__(self) -> None:
        self.q: queue.Queue[Callable[[], None]] = queue.Queue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._loop, name="sandbox-spawner",
                                               daemon=True)
                self.thread.start()
        self.q.put(job)

    def _loop(self) -> None:
        while True:
            job = self.q.get()
            try:
                job()
            except Exception:  # noqa: BLE001 - a failed spawn must not end the thread
                log.exception("sandbox: starting a warm sandbox failed")
            del job  # holds its Sandbox: let an unused one be collected (and closed)


_spawner = _Spawner()
_live: "weakref.WeakSet[Sandbox]" = weakref.WeakSet()


class Sandbox:
    """Runs untrusted Python, one fresh sandbox process per call, `cfg.warm` kept ready. With
    the `unshare` backend and `cfg.zygote`, the processes are forked by one zygote per Sandbox
    (laminar/sandbox/zygote.py), restarted when it dies; else each starts on its own.

    run() blocks and returns a RunResult whatever the code does; it raises SandboxError only
    when the sandbox cannot start (or after close()). Thread-safe. arun() is the asyncio form.
    close() kills the warm processes (a run in flight finishes); it is idempotent and also
    runs at exit and when the Sandbox is garbage-collected.
    """

    def __init__(self, cfg: SandboxConfig | None = None):
        self.cfg = cfg or SandboxConfig()
        self.backend = resolve_backend(self.cfg)
        self._lock = threading.Lock()
        self._idle: deque[SandboxProc] = deque()
        self._starting = 0
        self._closed = False
        self._failures = 0  # warm starts that failed in a row (no refill storm)
        self._executor: ThreadPoolExecutor | None = None  # arun's threads, made on first use
        self.max_concurrent = self.cfg.max_concurrent or os.cpu_count() or 1
        self._running = threading.BoundedSemaphore(self.max_concurrent)  # programs at once
        self.uses_zygote = self.backend == "unshare" and self.cfg.zygote
        self._zygote: Zygote | None = None
        self._zygote_lock = threading.Lock()
        self.zygote_starts = 0  # zygotes started so far (a restart after a death adds one)
        _live.add(self)
        self._refill()

    # ------------------------------------------------------------------ pool
    def _refill(self) -> None:
        with self._lock:
            if self._closed or self._failures >= 3:
                return
            need = self.cfg.warm - len(self._idle) - self._starting
            self._starting += max(0, need)
        for _ in range(max(0, need)):
            _spawner.submit(self._start_one)

    def _new_proc(self) -> SandboxProc:
        """A sandbox process that will run one program: forked by the zygote, else started."""
        if self.uses_zygote:
            try:
                return self.zygote().fork_program()
            except SandboxError as e:
                if self.zygote_starts or self._closed:
                    raise
                self.uses_zygote = False  # it never worked here: the one-shot path, for good
                log.warning("sandbox: the zygote cannot start here (%s); every call starts its "
                            "own sandbox instead (sandbox.zygote=false)", e)
        return SandboxProc.start(self.backend, self.cfg)

    def zygote(self) -> Zygote:
        """The live, ready zygote; a new one when there is none yet or the last one died."""
        with self._zygote_lock:
            z = self._zygote
            if z is not None and z.alive():
                return z
            if self._closed:
                raise SandboxError("this Sandbox is closed")
            if z is not None:
                log.warning("sandbox: the zygote (pid %s) ended; starting a new one", z._pid)
                z.kill()
            self._zygote = None
            z = Zygote.start(self.cfg)
            self.zygote_starts += 1
            z.wait_ready()
            self._zygote = z
            return z

    def _start_one(self) -> None:
        proc = None
        try:
            proc = self._new_proc()
        except Exception as e:  # noqa: BLE001
            if not self._closed:  # else: closed while this one was on its way, as it should
                log.warning("sandbox: a warm %s sandbox failed to start: %s", self.backend, e)
        with self._lock:
            self._starting -= 1
            if proc is None:
                self._failures += 1
                return
            if not self._closed:
                self._idle.append(proc)
                return
        proc.kill()

    def _take(self) -> SandboxProc | None:
        with self._lock:
            if self._closed:
                raise SandboxError("this Sandbox is closed")
            proc = self._idle.popleft() if self._idle else None
        self._refill()
        return proc

    # ------------------------------------------------------------------ run
    def run(self, code: str, timeout_s: float | None = None) -> RunResult:
        """Run `code` in a fresh sandbox; wall-clock limit `timeout_s` (default cfg.timeout_s)."""
        t = self.cfg.timeout_s if timeout_s is None else float(timeout_s)
        if not t > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        with self._running:  # at most max_concurrent programs at once; the rest wait here
            return self._run(code, t)

    def _run(self, code: str, t: float) -> RunResult:
        proc = self._take()
        if proc is not None:
            try:
                result = proc.run(code, t)
                with self._lock:
                    self._failures = 0
                return result
            except SandboxError as e:  # a warm one that broke: one cold try before giving up
                with self._lock:
                    self._failures += 1
                log.warning("sandbox: a warm sandbox was unusable (%s); starting a fresh one", e)
        try:
            return self._new_proc().run(code, t)
        except SandboxError as e:
            if not self.uses_zygote or self._closed:
                raise
            # the zygote died (killed, the OOM killer) before or during this program: it runs
            # once more, from a fresh zygote; its first try left nothing behind
            log.warning("sandbox: %s; running the program again from a new zygote", e)
            return self._new_proc().run(code, t)

    async def arun(self, code: str, timeout_s: float | None = None) -> RunResult:
        """run() in this Sandbox's thread pool (up to ARUN_THREADS runs at once; more wait).
        Not the loop's default pool: that one has min(32, cores + 4) threads, shared with every
        other `to_thread`, and would queue tool calls on a small machine."""
        with self._lock:
            if self._executor is None:
                if self._closed:
                    raise SandboxError("this Sandbox is closed")
                self._executor = ThreadPoolExecutor(ARUN_THREADS, "sandbox-run")
            ex = self._executor
        return await asyncio.get_running_loop().run_in_executor(ex, self.run, code, timeout_s)

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle), deque()
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=False)  # runs in flight finish; their threads end after
        for p in idle:
            p.kill()
        with self._zygote_lock:
            z, self._zygote = self._zygote, None
        if z is not None:
            z.retire()  # it exits once the runs in flight (their own limits bound them) end

    @property
    def closed(self) -> bool:
        return self._closed

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Sandbox(backend={self.backend!r}, warm={self.cfg.warm}, "
                f"idle={len(self._idle)}, closed={self._closed})")


_shared_lock = threading.Lock()
_shared: dict[str, Sandbox] = {}


def shared_sandbox(cfg: SandboxConfig | None = None) -> Sandbox:
    """One Sandbox per process per configuration, for environments to share."""
    cfg = cfg or SandboxConfig()
    key = cfg.model_dump_json()
    with _shared_lock:
        sb = _shared.get(key)
        if sb is None or sb.closed:
            sb = _shared[key] = Sandbox(cfg)
        return sb


@atexit.register
def _close_all() -> None:
    for sb in list(_live):
        try:
            sb.close()
        except Exception:  # noqa: BLE001
            pass


def _after_fork_in_child() -> None:
    """A forked child (multiprocessing's fork) gets fresh locks, a fresh spawner and empty
    pools: the parent's warm sandboxes stay the parent's (proc.py closes our pipe copies)."""
    global _spawner, _shared_lock, _probe_lock
    _spawner = _Spawner()
    _shared_lock = threading.Lock()
    _probe_lock = threading.Lock()
    for sb in list(_live):
        sb._lock = threading.Lock()
        sb._idle = deque()
        sb._starting = 0
        sb._executor = None  # its threads did not survive the fork
        sb._zygote_lock = threading.Lock()
        sb._zygote = None  # the parent's (proc.py closed our copy of its socket)


os.register_at_fork(after_in_child=_after_fork_in_child)
