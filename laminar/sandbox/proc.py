"""One sandbox process: start it (per backend), wait until it is ready, run code once, end it.

    proc = SandboxProc.start("unshare", cfg)   # returns at once; the sandbox boots meanwhile
    result = proc.run(code, timeout_s)         # waits for ready, hands the code over, reads
    proc.kill()                                # idempotent; run() calls it when done

Every backend ends in the same stage-2 interpreter (`_stage2.py`): it lowers the rlimits,
installs a seccomp filter, forks the program's process (which writes `R` on the control pipe,
reads the code from stdin as `<length>\\n<bytes>` and runs it) and stays as its init. stdout and
stderr are one pipe. The host reads it with a bound and a wall-clock deadline.

Backends:
  unshare: `python -I -S _boot.py PLAN` (see `_boot.py`): namespaces, a minimal read-only root,
           an unprivileged uid, then stage 2 as pid 1 of its pid namespace.
  bwrap:   the same layout as a bubblewrap command line. When the host is root, bwrap runs
           privileged without a user namespace (which would map the sandbox to host root) and
           keeps only CAP_SETUID/CAP_SETGID, which stage 2 uses to drop to the sandbox's uid
           before anything else; otherwise bwrap's user namespace maps the sandbox to the host
           user.
  unshare with sandbox.zygote (the default): `zygote.py` subclasses this class twice, for the
           zygote's own sandbox and for each program it forks.
  unsafe:  stage 2 as a plain subprocess (new session, clean environment, rlimits, a temporary
           scratch directory as cwd; a separate uid when the host is root and the interpreter is
           reachable by it). No filesystem or network isolation.
"""

from __future__ import annotations

import functools
import logging
import marshal
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

from laminar.config import SandboxConfig
from laminar.cores import tool_cores
from laminar.sandbox.result import RunResult, SandboxError, SandboxSlow

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
BOOT = str(HERE / "_boot.py")
STAGE2 = (HERE / "_stage2.py").read_text()
BOOT_TIMEOUT_S = 30.0  # a sandbox that is not ready by then failed to start
DRAIN_S = 0.2  # after the program's process ended, how long stray writers may hold the pipe
UID_BASE, UID_SPAN = 1 << 30, 1 << 24  # per-sandbox uids (root host): rlimits are per uid
SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
TOP_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
ETC_FILES = ("ld.so.cache", "ld.so.conf", "localtime")


def python_executable() -> str:
    """The base interpreter (not a venv's launcher), as a real path."""
    exe = getattr(sys, "_base_executable", None) or sys.executable
    return os.path.realpath(exe)


def _under(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def host_layout() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(symlinks, ro_binds) that make the sandbox root: the system directories as on the host,
    the Python install (at its own path), the loader cache. Cached: it does not change."""
    global _LAYOUT
    if _LAYOUT is not None:
        return _LAYOUT
    symlinks: list[tuple[str, str]] = []
    binds: list[tuple[str, str]] = []
    for top in TOP_DIRS:
        p = "/" + top
        if os.path.islink(p):
            symlinks.append((p, os.readlink(p)))
        elif os.path.isdir(p):
            binds.append((p, p))
    bound = [os.path.realpath(s) for s, _ in binds]
    exe = python_executable()
    for prefix in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.dirname(exe))):
        real = os.path.realpath(prefix)
        if os.path.isdir(real) and not _under(real, bound) and real != "/":
            binds.append((real, real))
            bound.append(real)
    if not _under(exe, bound):
        d = os.path.dirname(exe)
        binds.append((d, d))
    for name in ETC_FILES:
        p = "/etc/" + name
        if os.path.islink(p):
            target = os.path.realpath(p)
            if _under(target, bound):
                symlinks.append((p, target))
        elif os.path.isfile(p):
            binds.append((p, p))
    _LAYOUT = (symlinks, binds)
    return _LAYOUT


_LAYOUT: tuple[list[tuple[str, str]], list[tuple[str, str]]] | None = None


def _etc(uid: int, gid: int) -> dict[str, str]:
    return {"passwd": "root:x:0:0:root:/:/bin/false\n"
                      f"sandbox:x:{uid}:{gid}:sandbox:/tmp:/bin/false\n",
            "group": f"root:x:0:\nsandbox:x:{gid}:\n",
            "hosts": "127.0.0.1 localhost\n::1 localhost\n",
            "hostname": "sandbox\n"}


def _limits(cfg: SandboxConfig) -> list[tuple[str, int, int]]:
    mb = 1 << 20
    return [("RLIMIT_CPU", cfg.cpu_s, cfg.cpu_s + 1),
            ("RLIMIT_AS", cfg.memory_mb * mb, cfg.memory_mb * mb),
            ("RLIMIT_NPROC", cfg.max_procs, cfg.max_procs),
            ("RLIMIT_FSIZE", cfg.max_file_mb * mb, cfg.max_file_mb * mb),
            ("RLIMIT_CORE", 0, 0),
            ("RLIMIT_NOFILE", 1024, 1024)]


def _stage_dir(binds: list[tuple[str, str]]) -> str:
    """A host directory to mount the new root's tmpfs on (inside the private mount namespace
    only): one that no bind source lies under."""
    sources = [os.path.realpath(s) for s, _ in binds]
    for cand in ("/tmp", "/mnt", "/media", "/srv", "/var/tmp", "/opt", "/home"):
        if os.path.isdir(cand) and not os.path.islink(cand) and not any(
                _under(s, [cand]) for s in sources):
            return cand
    raise SandboxError("sandbox: no directory to stage the sandbox root on (tried /tmp, /mnt, "
                       "/media, /srv, /var/tmp, /opt, /home)")


_uid_lock = threading.Lock()
_uids: set[int] = set()  # in use by this process's sandboxes


@functools.lru_cache(maxsize=1)
def host_is_root() -> bool:
    """Root of the initial user namespace (all uids mapped): the sandbox can get a uid of its
    own without a user namespace. Root inside a container's user namespace is not."""
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/self/uid_map") as f:
            return f.read().split() == ["0", "0", "4294967295"]
    except OSError:
        return False


def _new_uid() -> int:
    """A random uid from [UID_BASE, UID_BASE + UID_SPAN) that none of this process's live
    sandboxes has (another process on the host picks its own: a clash is unlikely, not
    impossible, and only shares the process limit and the stray sweep between the two)."""
    with _uid_lock:
        while True:
            uid = UID_BASE + secrets.randbelow(UID_SPAN)
            if uid not in _uids:
                _uids.add(uid)
                return uid


def _reachable_by_others(path: str) -> bool:
    """Every directory above `path` is world-searchable and `path` world-readable+executable."""
    p = Path(path)
    try:
        for d in list(p.parents):
            if not os.stat(d).st_mode & 0o001:
                return False
        return bool(os.stat(p).st_mode & 0o005 == 0o005)
    except OSError:
        return False


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


class SandboxProc:
    """One sandbox process; runs one program."""

    def __init__(self, backend: str, cfg: SandboxConfig):
        self.backend, self.cfg = backend, cfg
        self.popen: subprocess.Popen | None = None
        self.pidfd: int | None = None
        self.uid: int | None = None  # the sandbox's host uid when it has its own
        self.scratch: str | None = None
        self._ctl = b""
        self._rep = b""
        self._rep_eof = False
        self._ready = False
        self._done = False
        self._lock = threading.Lock()
        self._fds: list[int] = []
        self.code_w = self.out_r = self.ctl_r = self.rep_r = -1
        self.started = time.monotonic()
        _procs.add(self)

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, backend: str, cfg: SandboxConfig) -> "SandboxProc":
        p = cls(backend, cfg)
        try:
            p._start()
        except BaseException:
            p.kill()
            raise
        return p

    def _pipe(self) -> tuple[int, int]:
        r, w = os.pipe()
        self._fds += [r, w]
        return r, w

    def _start(self) -> None:
        code_r, self.code_w = self._pipe()
        self.out_r, out_w = self._pipe()
        self.ctl_r, ctl_w = self._pipe()
        child_fds = [code_r, out_w, ctl_w]
        kw: dict = {}
        extra_close: list[int] = []
        if self.backend == "unshare":
            self.rep_r, rep_w = self._pipe()
            child_fds.append(rep_w)
            argv, pass_fds = self._unshare_argv(ctl_w, rep_w)
        elif self.backend == "bwrap":
            self.rep_r, rep_w = self._pipe()
            child_fds.append(rep_w)
            argv, pass_fds, extra_close, kw = self._bwrap_argv(ctl_w, rep_w)
        elif self.backend == "unsafe":
            argv, pass_fds, kw = self._unsafe_argv(ctl_w)
        else:
            raise SandboxError(f"sandbox.backend={self.backend!r} is not a backend; use auto, "
                               "bwrap, unshare or unsafe")
        try:
            self.popen = subprocess.Popen(
                argv, stdin=code_r, stdout=out_w, stderr=out_w, pass_fds=pass_fds,
                close_fds=True, start_new_session=True,
                env=kw.pop("env", {}), cwd=kw.pop("cwd", "/"), **kw)
        finally:
            for fd in child_fds + extra_close:
                self._close(fd)
        try:
            self.pidfd = os.pidfd_open(self.popen.pid)
        except (AttributeError, OSError):
            self.pidfd = None
        for fd in (self.out_r, self.ctl_r, self.rep_r):
            if fd >= 0:
                os.set_blocking(fd, False)

    def _unshare_argv(self, ctl_w: int, rep_w: int) -> tuple[list[str], tuple[int, ...]]:
        symlinks, binds = host_layout()
        root = host_is_root()
        uid = gid = _new_uid() if root else 65534
        if root:
            self.uid = uid  # released in kill()
        plan = {"ctl": ctl_w, "rep": rep_w, "host_pid": os.getpid(), "userns": not root,
                "uid": uid, "gid": gid, "stage": _stage_dir(binds), "symlinks": symlinks,
                "ro_binds": binds, "etc": _etc(uid, gid), "scratch_mb": self.cfg.scratch_mb,
                "python": python_executable(), "stage2": STAGE2, "limits": _limits(self.cfg),
                "env": SANDBOX_ENV, "nice": self.cfg.nice, "cpus": tool_cores()}
        plan.update(self._plan_extra())
        pass_fds = (ctl_w, rep_w) + tuple(self._fds_to_pass())
        return [python_executable(), "-I", "-S", BOOT, marshal.dumps(plan).hex()], pass_fds

    def _plan_extra(self) -> dict:
        """More keys for the unshare plan (the zygote's socket)."""
        return {}

    def _fds_to_pass(self) -> list[int]:
        """More descriptors for the unshare outer process to inherit."""
        return []

    def _bwrap_argv(self, ctl_w: int, rep_w: int):
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxError("sandbox.backend=bwrap but bubblewrap (bwrap) is not installed; "
                               "install it or set sandbox.backend=unshare")
        symlinks, binds = host_layout()
        root = host_is_root()
        uid = gid = _new_uid() if root else 65534
        if root:
            self.uid = uid  # released in kill()
            # Privileged bwrap, no user namespace (one would map the sandbox to host root);
            # stage 2 drops to the sandbox uid itself with the two capabilities kept for that.
            argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                    "--unshare-cgroup-try", "--cap-drop", "ALL", "--cap-add", "CAP_SETUID",
                    "--cap-add", "CAP_SETGID"]
            drop = [uid, gid]
        else:
            argv = [bwrap, "--unshare-all", "--uid", str(uid), "--gid", str(gid)]
            drop = None
        argv += ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
        for k, v in SANDBOX_ENV.items():
            argv += ["--setenv", k, v]
        opened: list[int] = []
        etc = _etc(uid, gid)
        dests = [link for link, _ in symlinks] + [dst for _, dst in binds] + [
            "/etc/" + name for name in etc]
        parents = sorted({str(p) for d in dests for p in Path(d).parents} - {"/"} - set(dests),
                         key=lambda d: d.count("/"))
        for parent in parents:  # 0755, traversable by the sandbox uid (bwrap copies nothing)
            argv += ["--perms", "0755", "--dir", parent]
        for link, target in symlinks:
            argv += ["--symlink", target, link]
        for src, dst in binds:
            argv += ["--ro-bind", src, dst]
        for name, text in etc.items():
            fd = os.memfd_create("sandbox-etc", os.MFD_CLOEXEC)
            opened.append(fd)
            os.write(fd, text.encode())
            os.lseek(fd, 0, os.SEEK_SET)
            argv += ["--perms", "0644", "--ro-bind-data", str(fd), "/etc/" + name]
        argv += ["--dev", "/dev", "--proc", "/proc",
                 "--perms", "0700", "--size", str(self.cfg.scratch_mb << 20), "--tmpfs", "/tmp"]
        if root:
            argv += ["--chmod", "1777", "/tmp"]  # stage 2 is root until it drops
        spec = {"ctl": ctl_w, "rep": rep_w, "limits": _limits(self.cfg), "drop": drop,
                "nice": self.cfg.nice, "cpus": tool_cores()}
        argv += ["--remount-ro", "/", "--chdir", "/tmp", "--", python_executable(), "-I", "-S",
                 "-c", STAGE2, marshal.dumps(spec).hex()]
        return argv, tuple([ctl_w, rep_w] + opened), opened, {}

    def _unsafe_argv(self, ctl_w: int):
        exe = python_executable()
        self.scratch = tempfile.mkdtemp(prefix="laminar-sandbox-")
        kw: dict = {"cwd": self.scratch}
        if host_is_root() and _reachable_by_others(exe):
            self.uid = _new_uid()
            os.chown(self.scratch, self.uid, self.uid)
            kw.update(user=self.uid, group=self.uid, extra_groups=[])
        elif os.geteuid() == 0:
            _warn_once("sandbox: the unsafe backend runs untrusted code as root here (the Python "
                       f"at {exe} is not reachable by another uid), with no process limit")
        env = dict(SANDBOX_ENV, HOME=self.scratch, TMPDIR=self.scratch)
        kw["env"] = env
        spec = {"ctl": ctl_w, "rep": None, "limits": _limits(self.cfg), "drop": None,
                "nice": self.cfg.nice, "cpus": tool_cores()}
        argv = [exe, "-I", "-S", "-c", STAGE2, marshal.dumps(spec).hex()]
        return argv, (ctl_w,), kw

    # ------------------------------------------------------------------ helpers
    def _close(self, fd: int) -> None:
        if fd in self._fds:
            self._fds.remove(fd)
            try:
                os.close(fd)
            except OSError:
                pass

    def _exited(self, wait_s: float = 0.0) -> bool:
        """Has the process ended? With a pidfd this does not reap it (so its pid, which is
        also its process group's id, cannot be reused before kill() is done with it)."""
        p = self.popen
        if p is None or p.returncode is not None:
            return True
        if self.pidfd is not None:
            r, _, _ = select.select([self.pidfd], [], [], wait_s)
            return bool(r)
        try:
            p.wait(timeout=wait_s or None) if wait_s else p.poll()
        except subprocess.TimeoutExpired:
            pass
        return p.returncode is not None

    def _end_fds(self) -> list[int]:
        """Descriptors that turn readable when the sandbox has ended (none: poll)."""
        return [self.pidfd] if self.pidfd is not None else []

    def _read_ctl(self) -> bool:
        """Read what the control pipe has; False at end of file."""
        try:
            b = os.read(self.ctl_r, 4096)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not b:
            return False
        self._ctl = (self._ctl + b)[-65536:]  # the tail: the program's `E` line comes last
        return True

    def _read_rep(self) -> None:
        if self.rep_r < 0:
            return
        while True:
            try:
                b = os.read(self.rep_r, 4096)
            except (BlockingIOError, OSError):
                return
            if not b:
                self._rep_eof = True
                return
            self._rep += b[:4096]

    def _failure(self) -> str:
        """Why a sandbox did not start, from what it and its outer process said."""
        self._read_rep()
        for line in (self._ctl + b"\n" + self._rep).decode("utf-8", "replace").splitlines():
            if line.startswith("F "):
                return line[2:]
        out = b""
        try:
            out = os.read(self.out_r, 4000)
        except OSError:
            pass
        rc = self.popen.poll() if self.popen else None
        text = out.decode("utf-8", "replace").strip()
        return (f"exited with {rc}" if rc is not None else "did not start") + (
            f": {text}" if text else "")

    # ------------------------------------------------------------------ ready
    def wait_ready(self, timeout_s: float = BOOT_TIMEOUT_S) -> None:
        """Block until stage 2 said R; SandboxError if the sandbox failed to start."""
        if self._ready:
            return
        deadline = time.monotonic() + timeout_s
        fds = [self.ctl_r] + self._end_fds()
        while b"R\n" not in self._ctl and b"F " not in self._ctl:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise SandboxSlow(f"sandbox ({self.backend}) not ready after {timeout_s:g} s")
            wait = left if self._end_fds() else min(left, 0.05)
            r, _, _ = select.select(fds, [], [], wait)
            if self.ctl_r in r and not self._read_ctl():
                break
            if self.ctl_r not in r and self._exited():
                self._read_ctl()
                break
        if b"R\n" not in self._ctl:
            why = self._failure()
            self.kill()
            raise SandboxError(f"sandbox ({self.backend}) failed to start: {why}")
        self._ready = True

    # ------------------------------------------------------------------ run
    def run(self, code: str, timeout_s: float) -> RunResult:
        """Run `code` once (the process is spent afterwards). Raises SandboxError only when
        the sandbox did not start."""
        try:
            self.wait_ready()
            if self._exited():  # a warm one that died while it waited (the OOM killer, a kill)
                raise SandboxError(f"sandbox ({self.backend}) ended before it got any code")
            return self._run(code, timeout_s)
        finally:
            self.kill()

    def _run(self, code: str, timeout_s: float) -> RunResult:
        keep = self.cfg.max_output_bytes
        stop_at = 16 * keep
        out = bytearray()
        total = 0
        reason = None  # "timeout" | "output_limit"
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        try:
            body = code.encode("utf-8", "surrogatepass")
            data = b"%d\n" % len(body) + body
            view = memoryview(data)
            os.set_blocking(self.code_w, False)
            while view:
                try:
                    n = os.write(self.code_w, view[:65536])
                    view = view[n:]
                except BlockingIOError:
                    if time.monotonic() > deadline or self._exited():
                        break
                    select.select([], [self.code_w], [], 0.05)
        except (BrokenPipeError, OSError):
            pass
        self._close(self.code_w)
        out_open, ended_at = True, None
        ends = self._end_fds()
        poll_fds = [self.out_r, self.ctl_r] + ends
        ctl_open = True
        while True:
            now = time.monotonic()
            if now >= deadline:
                reason = "timeout"
                break
            if ended_at is None and (self._exited()):
                ended_at = now
            if ended_at is not None:
                if not out_open:
                    break
                if now - ended_at > DRAIN_S:
                    break  # descendants still hold the pipe: they are killed below
            wait = deadline - now
            if ended_at is not None:
                wait = min(wait, DRAIN_S)
            elif not self._end_fds():
                wait = min(wait, 0.05)
            fds = [fd for fd in poll_fds if fd >= 0 and (fd != self.ctl_r or ctl_open)
                   and (fd != self.out_r or out_open) and not (fd in ends and ended_at)]
            if not fds:
                time.sleep(min(wait, 0.01))
                continue
            r, _, _ = select.select(fds, [], [], wait)
            if self.out_r in r:
                try:
                    b = os.read(self.out_r, 65536)
                except BlockingIOError:
                    b = None
                except OSError:
                    b = b""
                if b == b"":
                    out_open = False
                elif b:
                    total += len(b)
                    if len(out) < keep:
                        out += b[:keep - len(out)]
                    if total > stop_at:
                        reason = "output_limit"
                        break
            if self.ctl_r in r and not self._read_ctl():
                ctl_open = False
        wall = time.monotonic() - t0
        self.kill()  # reads what the control and report pipes still hold before closing them
        stdout = out.decode("utf-8", "replace")
        truncated = total > keep
        if reason == "timeout":
            return RunResult(stdout, "timeout", None, f"timeout after {timeout_s:g} s", wall,
                             truncated)
        if reason == "output_limit":
            return RunResult(stdout, "output_limit", None, f"output over {stop_at} bytes", wall,
                             True)
        code_ = self._exit_code()
        if code_ is None:
            return RunResult(stdout, "killed", None, "killed (no exit status)", wall, truncated)
        if code_ < 0:
            sig = -code_
            why = f"killed by signal {sig} ({_signame(sig)})"
            if sig == signal.SIGXCPU:
                why += f": over the CPU limit of {self.cfg.cpu_s} s"
            return RunResult(stdout, "killed", code_, why, wall, truncated)
        if code_ != 0:
            return RunResult(stdout, "error", code_, self._exception() or f"exit code {code_}",
                             wall, truncated)
        return RunResult(stdout, "ok", 0, None, wall, truncated)

    def _exception(self) -> str | None:
        last = None
        for line in self._ctl.decode("utf-8", "replace").splitlines():
            if line.startswith("E "):
                last = line[2:].strip()
        return last

    def _exit_code(self) -> int | None:
        """The program's exit code, minus the signal that ended it: as the sandbox's init saw
        it (X), else as the outer process saw the init (W), else the process's own code."""
        lines = self._rep.decode("ascii", "replace").splitlines()
        for tag in ("X ", "W "):
            for line in lines:
                if line.startswith(tag):
                    try:
                        return os.waitstatus_to_exitcode(int(line[2:]))
                    except ValueError:
                        return None
        if self.backend == "unshare":
            return None
        rc = self.popen.returncode if self.popen else None
        if rc is not None and self.backend == "bwrap" and rc > 128 and not self._exception():
            return -(rc - 128)  # bwrap reports a signal as 128 + its number
        return rc

    # ------------------------------------------------------------------ end
    def _forget(self) -> None:
        """In a forked child: close our copies of the descriptors, never kill (the parent's)."""
        for fd in self._fds + ([self.pidfd] if self.pidfd is not None else []):
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds, self.pidfd, self.popen, self._done, self.scratch = [], None, None, True, None

    def kill(self) -> None:
        """End the sandbox and everything it started; reap; close the pipes. Idempotent."""
        with self._lock:
            if self._done:
                return
            self._done = True
        p = self.popen
        ran_on = p is not None and p.returncode is None and not self._exited()
        if p is not None and p.returncode is None:
            if self.backend == "unshare" and ran_on:
                try:  # the outer SIGKILLs the namespace's init, which ends the namespace
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                self._exited(2.0)
            if p.returncode is None:  # not reaped yet: its pid is still its group's id
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                p.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                log.warning("sandbox process %d did not end after SIGKILL", p.pid)
        if self.uid is not None and (self.backend == "unsafe" or (self.backend == "bwrap"
                                                                  and ran_on)):
            # unsafe: strays that left the session. bwrap stopped early: its namespace's init
            # dies by its parent-death signal, asynchronously; make sure now.
            _kill_uid(self.uid)
        self._read_rep()
        if self.ctl_r >= 0:
            for _ in range(64):  # everything is dead: what is left ends in EOF
                if not self._read_ctl() or not select.select([self.ctl_r], [], [], 0)[0]:
                    break
        for fd in list(self._fds):
            self._close(fd)
        if self.pidfd is not None:
            try:
                os.close(self.pidfd)
            except OSError:
                pass
            self.pidfd = None
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None
        if self.uid is not None:
            with _uid_lock:
                _uids.discard(self.uid)


_procs: "weakref.WeakSet[SandboxProc]" = weakref.WeakSet()
_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


def _forget_after_fork() -> None:
    """In a forked child: drop (never kill) the parent's sandboxes and close our copies of
    their pipes, so that the parent's runs see their pipes end as if we did not exist."""
    for p in list(_procs):
        p._forget()
    _procs.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of this (per-sandbox, unique) uid, as root."""
    if not host_is_root():
        return
    for _ in range(3):
        found = False
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                st = os.stat(f"/proc/{d}")
            except OSError:
                continue
            if st.st_uid == uid:
                found = True
                try:
                    os.kill(int(d), signal.SIGKILL)
                except OSError:
                    pass
        if not found:
            return
        time.sleep(0.01)
