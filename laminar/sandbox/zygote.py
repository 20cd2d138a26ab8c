"""The zygote path of the `unshare` backend (`sandbox.zygote`, the default): one long-lived
sandbox whose init, instead of running one program, forks one per request (`_boot.py: zygote`).

    z = Zygote.start(cfg)        # the outer process and the zygote; returns at once
    z.wait_ready()
    proc = z.fork_program()      # a ZygoteProc: one program, used like a SandboxProc
    result = proc.run(code, 2.0)
    z.pid                        # the zygote's host pid; z.alive(); z.cpu_s()
    z.retire()                   # no more programs: it exits once the runs in flight ended
    z.kill()                     # now, with every program in flight

A call then costs forks of a warm interpreter instead of two interpreter start-ups. Each
program still gets a process tree of its own: its own mount, pid, network, ipc and uts
namespaces, a fresh /proc and an empty /tmp, its own uid (root host), no capabilities, the
rlimits and the seccomp filter, pid 2 under an init that reports its end. The zygote never runs
program code: every program starts from the same state.

Per program, the host makes five pipes and hands the far ends to the zygote over a unix
SEQPACKET socket (SCM_RIGHTS): code, output, ctl (R / E / F lines), rep (X / W / F lines) and
life. The program's outer process (a fork of the zygote) SIGKILLs the program's init when the
host closes life: on a timeout, in kill(), or when the host process dies.
"""

from __future__ import annotations

import logging
import marshal
import os
import select
import socket
import threading
import time

from laminar.config import SandboxConfig
from laminar.sandbox.proc import SandboxProc, _new_uid, _uid_lock, _uids, host_is_root
from laminar.sandbox.result import RunResult, SandboxError

log = logging.getLogger(__name__)

END_WAIT_S = 10.0  # kill(): how long a program's tree may take to end after life closed


class Zygote(SandboxProc):
    """The zygote's sandbox: an `unshare` sandbox whose init serves fork requests."""

    def __init__(self, cfg: SandboxConfig):
        super().__init__("unshare", cfg)
        self.sock: socket.socket | None = None
        self._far = -1  # the zygote's end of the socket, until it is passed on
        self._send_lock = threading.Lock()
        self._pid: int | None = None

    @classmethod
    def start(cls, cfg: SandboxConfig) -> "Zygote":  # type: ignore[override]
        z = cls(cfg)
        try:
            z._start()
        except BaseException:
            z.kill()
            raise
        return z

    def _start(self) -> None:
        near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = near
        self._far = far.detach()
        self._fds.append(self._far)
        try:
            super()._start()
        finally:
            self._close(self._far)

    def _plan_extra(self) -> dict:
        # No parent-death signal for its outer process: it would end the zygote with the host
        # thread that happened to start it. The zygote ends when the host's socket closes
        # (the host's exit too), after killing the programs whose life pipe closed with it.
        return {"zygote": self._far, "pdeathsig": False}

    def _fds_to_pass(self) -> list[int]:
        return [self._far]

    # ------------------------------------------------------------------ state
    @property
    def pid(self) -> int:
        """The zygote's host pid (the sandbox's init), as its outer process reported it."""
        deadline = time.monotonic() + 5.0
        while self._pid is None:
            self._read_rep()
            for line in self._rep.decode("ascii", "replace").splitlines():
                if line.startswith("P "):
                    self._pid = int(line[2:])
            if self._pid is None:
                if time.monotonic() > deadline:
                    raise SandboxError("the sandbox zygote did not report its pid")
                select.select([self.rep_r], [], [], 0.05)
        return self._pid

    def alive(self) -> bool:
        """Ready for requests: started, not retired, its socket not hung up (the zygote's death
        closes its end at once) and its outer process not ended."""
        sock = self.sock
        if sock is None or self._done:
            return False
        p = select.poll()
        p.register(sock, select.POLLIN)  # POLLHUP / POLLERR are always reported
        if any(ev & (select.POLLHUP | select.POLLERR) for _, ev in p.poll(0)):
            return False
        return not self._exited()

    def cpu_s(self) -> float:
        """CPU-seconds of the zygote and of every program it has reaped (user + system)."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        return ticks / os.sysconf("SC_CLK_TCK")

    # ------------------------------------------------------------------ requests
    def fork_program(self) -> "ZygoteProc":
        """One program's sandbox, forked from the zygote (returns at once; ready soon)."""
        proc = ZygoteProc(self)
        try:
            proc._start()
        except BaseException:
            proc.kill()
            raise
        return proc

    def send(self, request: dict, fds: list[int]) -> None:
        with self._send_lock:
            if self.sock is None:
                raise SandboxError("the sandbox zygote was retired")
            try:
                socket.send_fds(self.sock, [marshal.dumps(request)], fds)
            except OSError as e:
                raise SandboxError(f"the sandbox zygote is gone ({e})") from e

    # ------------------------------------------------------------------ end
    def retire(self) -> None:
        """Take no more requests. The zygote exits once the programs in flight ended (their
        runs are bounded by their timeouts); a daemon thread reaps it then."""
        with self._send_lock:
            sock, self.sock = self.sock, None
        if sock is None:
            return
        sock.close()
        threading.Thread(target=self._reap, name="sandbox-zygote-reaper", daemon=True).start()

    def _reap(self) -> None:
        if self.popen is not None:
            self.popen.wait()
        self.kill()

    def _forget(self) -> None:
        if self.sock is not None:
            self.sock.close()  # our copy only: the parent's zygote keeps serving the parent
            self.sock = None
        super()._forget()

    def kill(self) -> None:
        with self._send_lock:
            sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()
        super().kill()


class ZygoteProc(SandboxProc):
    """One program forked by a Zygote. Its end is the end of file on rep: the program's init
    and its outer process both hold rep and nothing else does."""

    def __init__(self, zygote: Zygote):
        super().__init__("unshare", zygote.cfg)
        self.zygote = zygote
        self.life_w = -1

    def _start(self) -> None:
        code_r, self.code_w = self._pipe()
        self.out_r, out_w = self._pipe()
        self.ctl_r, ctl_w = self._pipe()
        self.rep_r, rep_w = self._pipe()
        life_r, self.life_w = self._pipe()
        far = [code_r, out_w, ctl_w, rep_w, life_r]
        root = host_is_root()
        uid = gid = _new_uid() if root else 65534
        if root:
            self.uid = uid  # released in kill()
        try:
            self.zygote.send({"uid": uid, "gid": gid}, far)
        finally:
            for fd in far:
                self._close(fd)
        for fd in (self.out_r, self.ctl_r, self.rep_r):
            os.set_blocking(fd, False)

    def _end_fds(self) -> list[int]:
        return [] if self._rep_eof or self.rep_r < 0 else [self.rep_r]

    def _exited(self, wait_s: float = 0.0) -> bool:
        if self._rep_eof or self.rep_r < 0:
            return True
        if wait_s:
            select.select([self.rep_r], [], [], wait_s)
        self._read_rep()
        return self._rep_eof

    def _run(self, code: str, timeout_s: float) -> RunResult:
        r = super()._run(code, timeout_s)
        if r.status == "killed" and not self._rep.strip():
            # the zygote reports every end of a program it started (W), killed or not:
            # nothing on rep means the zygote itself died and took the program with it
            raise SandboxError("the sandbox zygote ended during the run")
        return r

    def _failure(self) -> str:
        why = super()._failure()
        return ("the sandbox zygote ended before the program started"
                if why == "did not start" else why)

    def kill(self) -> None:
        """Close life (the program's outer process then SIGKILLs its init, which ends the
        program's pid namespace), wait for rep's end of file, close everything. Idempotent."""
        with self._lock:
            if self._done:
                return
            self._done = True
        self._close(self.life_w)
        self._close(self.code_w)
        deadline = time.monotonic() + END_WAIT_S
        while not self._exited(0.0):
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("sandbox: a zygote program did not end %g s after its kill",
                            END_WAIT_S)
                break
            self._exited(left)
        if self.ctl_r >= 0:
            for _ in range(64):
                if not self._read_ctl() or not select.select([self.ctl_r], [], [], 0)[0]:
                    break
        for fd in list(self._fds):
            self._close(fd)
        if self.uid is not None:
            with _uid_lock:
                _uids.discard(self.uid)
