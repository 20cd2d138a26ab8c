"""The job's CPU cores, as the driver found them before `cluster.cpu_affinity` narrowed anything
(laminar/devices.py deals them out; this module imports nothing of laminar's, so the sandbox,
which must not import torch, reads them too).

    job_cores()    # the cores to deal out: $LAMINAR_JOB_CPUS where the driver set it, else ours
    tool_cores()   # for a sandbox's tool programs: the job's cores while it splits, else None
    TrainerLoan(loan_path(run_dir)).lend(True)          # cluster.cpu_affinity=lend, the trainer
    Borrower(loan_path(run_dir), own, wide).poll()      # ... and each rollout, from its loop
    claim_trainer_cores(cores) / other_trainer_cores()  # the trainer cores of the jobs here
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time

# Set by the driver (or the first pinned process) before anything narrows its affinity; every
# process started afterwards inherits it.
CPUS_ENV = "LAMINAR_JOB_CPUS"


def job_cores() -> list[int]:
    """The cores `cpu_plan` deals out: $LAMINAR_JOB_CPUS where the driver set it, else the ones
    this process may use."""
    listed = os.environ.get(CPUS_ENV, "")
    return [int(c) for c in listed.split(",")] if listed else sorted(os.sched_getaffinity(0))


def tool_cores() -> list[int] | None:
    """The cores a sandbox's tool programs run on while the job's processes are pinned: all of
    the job's, not the calling rollout's own (on a cluster tools run on CPU hosts, not on the
    devices of the rollout that called them, and pinned to a rollout's one core they halved
    calc's throughput: docs/performance.md). None when nothing is pinned: they inherit."""
    return job_cores() if os.environ.get(CPUS_ENV) else None


# ----------------------------------------------------------------------------- lending

# `cluster.cpu_affinity: lend`: the trainer's cores are the rollouts' while the trainer waits for
# data. One byte in shared memory says which: b"1" lent, b"0" (or no file) the trainer's. The
# trainer writes it where it starts and stops waiting; each rollout reads it from its loop and
# moves its own threads. Nothing but affinity depends on it: a trainer killed mid-loan leaves
# the rollouts on every core (the unpinned layout), one killed while training leaves them on
# their own cores (the split layout); the next trainer of the job writes it afresh.
LEND_POLL_S = 0.001


def loan_path(run_dir: str | os.PathLike) -> str:
    """The job's flag: in /dev/shm (a tmpfs) where there is one, named by its run directory."""
    key = hashlib.sha1(os.fsencode(os.path.abspath(run_dir))).hexdigest()[:16]
    return os.path.join(_shm(), f"laminar-cores-{key}")


def _shm() -> str:
    """Shared memory (a tmpfs) where there is one, else the temporary folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class TrainerLoan:
    """The trainer's side: `lend(True)` as it starts waiting for data, `lend(False)` before it
    trains; `close()` at its end removes the flag."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.lent: bool | None = None
        self.lend(False)

    def lend(self, lent: bool) -> None:
        if lent != self.lent and self.fd >= 0:
            os.pwrite(self.fd, b"1" if lent else b"0", 0)
            self.lent = lent

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            with contextlib.suppress(OSError):
                os.unlink(self.path)


class Borrower:
    """A rollout's side: `poll()` from its loop (it reads the flag at most every
    LEND_POLL_S) moves every thread of this process to `wide` (its own cores and the trainer's)
    while the trainer lends them, back to `own` when it trains again."""

    def __init__(self, path: str, own: list[int], wide: list[int]) -> None:
        self.path, self.own, self.wide = path, own, wide
        self.fd = -1
        self.on: list[int] | None = None  # the first move takes every thread, old ones too
        self.next = 0.0
        self.moves = 0

    def poll(self) -> None:
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + LEND_POLL_S
        if self.fd < 0:
            try:
                self.fd = os.open(self.path, os.O_RDONLY)
            except OSError:
                return  # no trainer yet: stay on our own cores
        want = self.wide if os.pread(self.fd, 1, 0) == b"1" else self.own
        if want != self.on:
            for tid in map(int, os.listdir("/proc/self/task")):
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    os.sched_setaffinity(tid, want)
            self.on = want
            self.moves += 1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ----------------------------------------------------------------------------- other jobs

# The trainer cores each pinned job on this machine uses, so that a second job does not put its
# trainer on the first one's (`cluster.cpu_affinity: auto` deals the first cores to the trainer,
# on every job alike). One file per driver process, named by its pid and holding its start time
# too, so a driver killed without cleaning up (or a reused pid) is not taken for a live job.
CLAIMS_ENV = "LAMINAR_TRAINER_CLAIMS"  # the folder, where a test session isolates its own


def claims_dir() -> str:
    return os.environ.get(CLAIMS_ENV) or os.path.join(_shm(), "laminar-trainer-cores")


def _started(pid: int) -> str | None:
    """A process's start time (clock ticks since boot, /proc/PID/stat), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def claim_trainer_cores(cores: list[int]) -> str:
    """This process's job pins its trainer to `cores`: recorded until `release_trainer_cores`."""
    folder = claims_dir()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, str(os.getpid()))
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{_started(os.getpid())} {','.join(map(str, cores))}\n")
    os.replace(tmp, path)
    return path


def release_trainer_cores() -> None:
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(claims_dir(), str(os.getpid())))


def other_trainer_cores() -> dict[int, list[int]]:
    """pid -> trainer cores of every other live job's claim on this machine."""
    out: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(claims_dir()):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                with open(os.path.join(claims_dir(), name)) as f:
                    started, cores = f.read().split()
            except (OSError, ValueError):
                continue  # being written, or not ours
            if _started(int(name)) == started:
                out[int(name)] = [int(c) for c in cores.split(",") if c]
    return out
