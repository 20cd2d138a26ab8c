"""Where tensors live: the `device` settings (`trainer.device`, `rollout.device`) and the copies
between a device and the relay's host memory.

    device = resolve_device(cfg.trainer.device, "trainer.device")   # torch.device, or ConfigError
    check_devices(cfg)                                # at start: `cuda` without CUDA is one line
    staging = StagingBuffer.for_device(device)        # pinned host memory (None-like on CPU)
    stage_copy(dst_named, src_named, staging)         # relay shared memory -> device tensors
    load_into_module(module, src_named, staging)      # the same, into a module's state_dict

`auto` is CUDA when this process sees a CUDA device, else the CPU. `cuda` on a machine without
one is a `ConfigError` naming the key, the value and the fix (never a CUDA traceback).

Host -> device: the relay's version lives in shared memory (pageable), which a GPU cannot read
asynchronously; `stage_copy` packs the tensors into a pinned staging buffer (two halves used in
turn: while the GPU reads one half, the CPU fills the other) and issues non-blocking copies from
it, then waits for them all. On the CPU (no staging buffer) it is a plain `copy_` per tensor.
Device -> host (the trainer's push) needs nothing here: the relay's writer copies every tensor
straight into the master relay's slot (`write_version`: `copy_` from a CUDA tensor is the
device-to-host copy), so the trainer hands its parameters as they are, with no host copy between.

This module imports only torch, laminar.config and laminar.cores.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from laminar.config import ConfigError
from laminar.cores import (CPUS_ENV, Borrower, TrainerLoan, claim_trainer_cores, job_cores, loan_path,
                           other_trainer_cores)

SETTINGS = ("auto", "cpu", "cuda")
DEVICE_KEYS = ("trainer.device", "rollout.device")
STAGING_BYTES = 64 << 20  # default pinned staging buffer: two 32 MiB halves
_ALIGN = 64  # each tensor's slice of the staging buffer starts on this many bytes


def cuda_available() -> bool:
    """Whether this process sees a CUDA device (False when torch is a CPU build)."""
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver install: no usable device
        return False


def torch_build() -> str:
    """What torch was built for: `cpu`, `cuda 12.8` or `rocm 6.2`."""
    if getattr(torch.version, "cuda", None):
        return f"cuda {torch.version.cuda}"
    if getattr(torch.version, "hip", None):
        return f"rocm {torch.version.hip}"
    return "cpu"


def no_cuda_reason() -> str:
    """Why this process has no CUDA device, in words (for the ConfigError)."""
    build = torch_build()
    if build == "cpu":
        return (f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch "
                "(docs/devices.md)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    return f"torch {torch.__version__} ({build}) finds no CUDA device (driver or GPU missing)"


def resolve_device(setting: str, key: str = "device") -> torch.device:
    """The torch device `setting` (auto | cpu | cuda, the value of config key `key`) means in
    this process. ConfigError when it is `cuda` and there is none, or not a setting at all."""
    if setting == "cpu":
        return torch.device("cpu")
    if setting == "auto":
        return _current_cuda() if cuda_available() else torch.device("cpu")
    if setting == "cuda":
        if not cuda_available():
            raise ConfigError(f"{key}=cuda but this machine has no CUDA device: {no_cuda_reason()}; "
                              f"or set {key}=auto (CUDA when present, else the CPU) or {key}=cpu")
        return _current_cuda()
    raise ConfigError(f"{key}={setting!r} is not a device setting; use one of {', '.join(SETTINGS)}")


def _current_cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def check_devices(cfg: Any) -> dict[str, str]:
    """At the start of a job: resolve every `device` key of `cfg` (a laminar Config) here, so a
    `cuda` on a machine without CUDA is one ConfigError before anything starts. On a cluster
    (`cluster.address` set) the trainer and the rollouts may run on other machines than the
    driver, so that is left to each process at its start. (That Ray actors reserve the GPUs
    they use is checked where they start: runtime/assembly.py, check_gpu_reservations.) Returns
    key -> device type as resolved here."""
    out = {}
    if not getattr(cfg.cluster, "address", None):
        for key in DEVICE_KEYS:
            section, name = key.split(".")
            setting = getattr(getattr(cfg, section), name, None)
            if setting is not None:
                out[key] = resolve_device(setting, key).type
        cpu_affinity(cfg)  # split with a trainer_cpus that leaves none: one error now
    return out


def to_host(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached host copies of device tensors (host tensors pass through as detached views):
    for a weight sink that keeps the tensors it is handed (the one-process runtime's board)
    rather than copying them into host memory itself, as the relay's writer does."""
    return {k: v.detach() if v.device.type == "cpu" else v.detach().to("cpu")
            for k, v in named.items()}


# ------------------------------------------------------------------------ host -> device copies


@dataclass
class StagingBuffer:
    """Pinned host memory for host -> device copies, used in two halves. Keep one per engine
    (pinning is slow: allocate once, reuse for every version). On the CPU, `buffer` may be an
    ordinary tensor (the tests exercise the packing logic that way) or the staging skipped."""

    buffer: torch.Tensor  # uint8, 1-D
    events: list[Any]  # per half: the CUDA event recorded after its last copy was issued, or None

    @classmethod
    def allocate(cls, nbytes: int = STAGING_BYTES, pin: bool = True) -> "StagingBuffer":
        nbytes = max(2 * _ALIGN, nbytes - nbytes % (2 * _ALIGN))
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin and cuda_available())
        return cls(buf, [None, None])

    @classmethod
    def for_device(cls, device: torch.device, nbytes: int = STAGING_BYTES) -> "StagingBuffer | None":
        """A pinned buffer when `device` is a GPU; None on the CPU (copies need no staging)."""
        return cls.allocate(nbytes) if device.type == "cuda" else None

    @property
    def half(self) -> int:
        return self.buffer.numel() // 2

    @property
    def pinned(self) -> bool:
        return self.buffer.is_pinned() if self.buffer.device.type == "cpu" else False


def stage_copy(dst: Mapping[str, torch.Tensor], src: Mapping[str, torch.Tensor],
               staging: StagingBuffer | None = None) -> int:
    """Copy every `src[name]` (host tensors, e.g. the zero-copy views of a pulled relay version)
    into `dst[name]` (tensors on any device, same shapes; dtypes may differ: copy_ converts);
    returns the bytes read. With `staging`, bytes go host -> pinned half -> device by
    non-blocking copies, the halves taking turns; without it, one `copy_` per tensor. Returns
    after every copy is complete, so `src` may be released then."""
    missing = sorted(set(dst) - set(src))
    if missing:
        raise ValueError(f"weights to copy lack {missing[:5]} ({len(missing)} in all)")
    total = 0
    with torch.no_grad():
        if staging is None:
            for name, d in dst.items():
                s = _checked(name, d, src[name])
                d.copy_(s)
                total += s.numel() * s.element_size()
            return total
        state = _Cursor(staging)
        for name, d in dst.items():
            s = _checked(name, d, src[name])
            total += s.numel() * s.element_size()
            if not d.is_contiguous() or s.numel() == 0:
                d.copy_(s)
                continue
            _stage_one(d.view(-1), s.reshape(-1), state)
        state.finish()
    return total


def _checked(name: str, d: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    if tuple(s.shape) != tuple(d.shape):
        raise ValueError(f"tensor '{name}' has shape {tuple(s.shape)}, the destination "
                         f"{tuple(d.shape)}")
    return s


class _Cursor:
    """Which half of the staging buffer is being filled, and how far."""

    def __init__(self, staging: StagingBuffer) -> None:
        self.staging = staging
        self.which = 0
        self.pos = 0
        self.wait(0)

    def wait(self, which: int) -> None:
        ev = self.staging.events[which]
        if ev is not None:
            ev.synchronize()  # the GPU has read everything issued from this half
            self.staging.events[which] = None

    def room(self) -> int:
        return self.staging.half - self.pos

    def take(self, nbytes: int) -> torch.Tensor:
        start = self.which * self.staging.half + self.pos
        self.pos += -(-nbytes // _ALIGN) * _ALIGN
        return self.staging.buffer[start:start + nbytes]

    def flip(self, used_cuda: bool) -> None:
        if used_cuda:
            ev = torch.cuda.Event()
            ev.record()
            self.staging.events[self.which] = ev
        self.which ^= 1
        self.pos = 0
        self.wait(self.which)

    def finish(self) -> None:
        for which in (0, 1):
            self.wait(which)
        if cuda_available():
            torch.cuda.current_stream().synchronize()


def _stage_one(d: torch.Tensor, s: torch.Tensor, cur: _Cursor) -> None:
    """Copy flat `s` into flat `d` through the staging halves, in pieces that fit."""
    size = s.element_size()
    cuda = d.device.type == "cuda"
    done = 0
    n = s.numel()
    while done < n:
        if cur.room() < size:
            cur.flip(cuda)
        count = min(n - done, cur.room() // size)
        piece = cur.take(count * size).view(s.dtype)
        piece.copy_(s[done:done + count])
        d[done:done + count].copy_(piece, non_blocking=cuda)
        done += count
        if cur.room() < size:
            cur.flip(cuda)


def load_into_module(module: torch.nn.Module, src: Mapping[str, torch.Tensor],
                     staging: StagingBuffer | None = None) -> int:
    """`stage_copy` into a module's state_dict (its parameters and buffers, on their device);
    the names must match exactly (the error lists the first differences)."""
    state = module.state_dict()
    missing, extra = sorted(set(state) - set(src)), sorted(set(src) - set(state))
    if missing or extra:
        raise ValueError(f"weights do not match the model: missing {missing[:5]} ({len(missing)} "
                         f"in all), unexpected {extra[:5]} ({len(extra)} in all)")
    return stage_copy(state, src, staging)


# ----------------------------------------------------------------------------- CPU cores

def cpu_plan(cores: list[int], trainer_cpus: int | None, rollout_index: int | None,
             num_rollouts: int) -> list[int]:
    """`cluster.cpu_affinity: split`, pure: the cores the trainer (`rollout_index` None) or
    rollout `rollout_index` runs on, out of `cores` (this machine's, in order). The trainer
    takes the first `trainer_cpus` (default: half, at least one, leaving one); the rest are
    dealt to the rollouts in contiguous slices, the first ones taking one more where they do
    not divide; with more rollouts than cores left, rollout i shares core i mod the rest. A
    rollout that joins later (index >= num_rollouts) gets the slot of index mod num_rollouts.
    A `trainer_cpus` that leaves no core for the rollouts is a ConfigError."""
    n = len(cores)
    t = trainer_cpus if trainer_cpus is not None else max(1, n // 2)
    if n < 2 or t >= n:
        raise ConfigError(
            f"cluster.trainer_cpus={t}: cluster.cpu_affinity=split needs at least one core for the "
            f"trainer and one for the rollouts, and this process may use {n} core(s) "
            f"({cores}); lower cluster.trainer_cpus or set cluster.cpu_affinity=off")
    if rollout_index is None:
        return cores[:t]
    rest = cores[t:]
    r = max(1, num_rollouts)
    i = rollout_index % r
    if r >= len(rest):
        return [rest[i % len(rest)]]
    size, extra = divmod(len(rest), r)
    start = i * size + min(i, extra)
    return rest[start:start + size + (1 if i < extra else 0)]


def rollout_index(rollout_id: str) -> int:
    """`rollout3` and its re-created incarnations `rollout3.1`, `rollout3.2`: 3."""
    digits = rollout_id.removeprefix("rollout").split(".")[0]
    return int(digits) if digits.isdigit() else 0


LENT = " and on the trainer's while it waits for data"
PINNED = ("split", "lend")  # the `cluster.cpu_affinity` choices that pin the trainer and rollouts


def affinity_plan(cfg: Any, cores: list[int], on_cpu: bool, can_pin: bool,
                  others: Mapping[int, list[int]] | None = None) -> tuple[str, str]:
    """`cluster.cpu_affinity`, pure: `split`, `lend` or `off` for this job, and why. `auto` lends
    (splits, and lets the rollouts use the trainer's cores while it waits for data) where
    a cluster would have given the trainer devices of its own: the schedule trains while the
    rollouts generate (every mode but sync, whose trainer and rollouts take every core in
    turn), both compute on this machine's CPU (`on_cpu`; on GPUs the devices are already
    disjoint) with the native engine (vLLM's CPU backend binds its own threads), Ray runs here
    (not `cluster.backend=local`, not `cluster.address`), the trainer's cores
    (`auto_trainer_cpus`) leave at least one for the rollouts, and no other laminar job on
    this machine pins its trainer to them (`others`: pid -> that job's trainer cores)."""
    c = cfg.cluster
    if c.cpu_affinity == "off":
        return "off", "cluster.cpu_affinity=off"
    if c.cpu_affinity in PINNED and can_pin:
        return c.cpu_affinity, _pinned_why(cfg, cores, c.cpu_affinity, c.trainer_cpus)
    threads = cfg.trainer.threads * cfg.trainer.world_size
    share = auto_trainer_cpus(cfg)
    why_off = (
        "this OS cannot pin processes to cores" if not can_pin else
        "the job runs on a Ray cluster (cluster.address)" if c.address else
        "the job runs in one process (cluster.backend=local)" if c.backend == "local" else
        "sync mode never trains while the rollouts generate" if cfg.mode == "sync" else
        "the trainer or the rollouts compute on a GPU" if not on_cpu else
        f"rollout.engine.backend={cfg.rollout.engine.backend} places its own threads"
        if cfg.rollout.engine.backend != "native" else
        f"the trainer's {threads} thread(s) (trainer.threads x trainer.world_size) need more "
        f"than its cluster.trainer_cpus={share}" if threads > share else
        f"the trainer's {share} core(s) would leave none of this process's {len(cores)} for the "
        f"rollouts" + ("" if c.trainer_cpus is not None else
                       " (trainer.threads x trainer.world_size; set trainer.threads lower)")
        if share >= len(cores) else
        _shared_with(others, cpu_plan(cores, share, None, cfg.rollout.num_workers)))
    if why_off:
        return "off", f"cluster.cpu_affinity={c.cpu_affinity}: off, {why_off}"
    return "lend", _pinned_why(cfg, cores, "auto: lend", share)


def _shared_with(others: Mapping[int, list[int]] | None, trainer: list[int]) -> str | None:
    """Why `auto` stays off when another job's trainer is pinned to this one's cores."""
    for pid, cores in sorted((others or {}).items()):
        if set(cores) & set(trainer):
            return (f"the trainer's core(s) {trainer} are already the trainer's of another "
                    f"laminar job (pid {pid}, core(s) {cores}); two trainers would share them: "
                    "give each job its own cores (taskset -c) to pin both")
    return None


def auto_trainer_cpus(cfg: Any) -> int:
    """The trainer's cores under `cluster.cpu_affinity=auto`: `cluster.trainer_cpus`, or as
    many as its threads (trainer.threads x trainer.world_size), as a cluster gives a trainer
    the devices it uses and no more; the rest are the rollouts'."""
    c = cfg.cluster
    return c.trainer_cpus if c.trainer_cpus is not None else cfg.trainer.threads * cfg.trainer.world_size


def _pinned_why(cfg: Any, cores: list[int], what: str, trainer_cpus: int | None) -> str:
    trainer = cpu_plan(cores, trainer_cpus, None, cfg.rollout.num_workers)
    return (f"cluster.cpu_affinity={what}: the trainer on core(s) {trainer}, the rollouts on the "
            f"rest{LENT if what.endswith('lend') else ''}")


def cpu_affinity(cfg: Any) -> tuple[str, str]:
    """`affinity_plan` for this machine and this process's view of the devices."""
    can_pin = hasattr(os, "sched_setaffinity")
    if cfg.cluster.cpu_affinity == "off" or not can_pin:
        return affinity_plan(cfg, [], True, can_pin)
    if cfg.cluster.cpu_affinity in PINNED:
        return affinity_plan(cfg, job_cores(), True, can_pin)
    on_cpu = all(resolve_device(getattr(getattr(cfg, k.split(".")[0]), "device"), k).type == "cpu"
                 for k in DEVICE_KEYS)
    return affinity_plan(cfg, job_cores(), on_cpu, can_pin, other_trainer_cores())


def settle_affinity(cfg: Any) -> tuple[Any, str]:
    """In the driver, before anything starts: `cfg` with `cluster.cpu_affinity` decided
    (`split`, `lend` or `off`; a copy where `auto` changed), so every process of the job acts on the
    driver's one decision rather than on its own view of the devices; and why."""
    choice, why = cpu_affinity(cfg)
    if choice == cfg.cluster.cpu_affinity:
        return cfg, why
    out = cfg.model_copy(deep=True)
    out.cluster.cpu_affinity = choice
    if choice in PINNED:  # `auto`: the trainer's share decided here, for every process
        out.cluster.trainer_cpus = auto_trainer_cpus(cfg)
    return out, why


def claim_cores(cfg: Any) -> bool:
    """In the driver of a job that pins (its settled `cfg`): record its trainer's cores for the
    other jobs of this machine (`auto` keeps off them); `cores.release_trainer_cores` at its end."""
    if cfg.cluster.cpu_affinity not in PINNED:
        return False
    claim_trainer_cores(cpu_plan(job_cores(), cfg.cluster.trainer_cpus, None, cfg.rollout.num_workers))
    return True


def _splits(cfg: Any) -> bool:
    return cpu_affinity(cfg)[0] in PINNED


def leave_trainer_cores(cfg: Any) -> list[int] | None:
    """When the job splits (`cpu_affinity`), in the driver before it starts Ray: this process
    and all it starts from now on (Ray's daemons, the pools, manager and relays) run on the
    cores that are not the trainer's, as nothing else runs on a trainer's GPU; the trainer and
    each rollout then pin themselves (`pin_cpus`). Without this, the light but frequent
    wake-ups of those processes preempted the pinned trainer hundreds of times a second.
    Returns the cores left to the rest, or None when the job does not split.
    `restore_cores` undoes it."""
    if not _splits(cfg):
        return None
    cores = job_cores()
    trainer = cpu_plan(cores, cfg.cluster.trainer_cpus, None, cfg.rollout.num_workers)
    rest = [c for c in cores if c not in trainer]
    os.environ[CPUS_ENV] = ",".join(map(str, cores))
    os.sched_setaffinity(0, rest)
    return rest


def restore_cores() -> None:
    """Undo `leave_trainer_cores` in a driver that goes on after its job (a notebook, a test
    session, `laminar bench`): every core of the job again, and no $LAMINAR_JOB_CPUS."""
    if os.environ.get(CPUS_ENV) and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, job_cores())
    os.environ.pop(CPUS_ENV, None)


def pin_cpus(cfg: Any, rollout_index: int | None) -> list[int] | None:
    """The trainer (`rollout_index` None) or a rollout, at its start: pin this process as
    `cpu_plan` says when the job splits (`cpu_affinity`), first recording the job's cores in
    $LAMINAR_JOB_CPUS for what it starts later (a sandbox's tool programs run on all of them:
    `laminar.cores.tool_cores`). A job that does not split but runs on a cluster whose driver
    left the trainer's cores (`laminar bench modes` runs sync beside split schedules) gets every
    core of the job back. Returns the cores pinned to, or None."""
    if not _splits(cfg):
        if os.environ.get(CPUS_ENV) and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, job_cores())
        return None
    cores = job_cores()
    os.environ[CPUS_ENV] = ",".join(map(str, cores))
    mine = cpu_plan(cores, cfg.cluster.trainer_cpus, rollout_index, cfg.rollout.num_workers)
    os.sched_setaffinity(0, mine)
    return mine


def borrower(cfg: Any, own: list[int] | None) -> Borrower | None:
    """A rollout pinned to `own` under `cluster.cpu_affinity: lend`: its side of the loan."""
    if own is None or cfg.cluster.cpu_affinity != "lend":
        return None
    return Borrower(loan_path(cfg.resolved_run_dir), own,
                    sorted(set(own) | set(cpu_plan(job_cores(), cfg.cluster.trainer_cpus, None,
                                                   cfg.rollout.num_workers))))


def trainer_loan(cfg: Any) -> TrainerLoan | None:
    """The trainer's side of the loan under `cluster.cpu_affinity: lend` (None otherwise)."""
    if cfg.cluster.cpu_affinity != "lend" or not hasattr(os, "sched_setaffinity"):
        return None
    return TrainerLoan(loan_path(cfg.resolved_run_dir))


def yield_cpu(nice: int, policy: str) -> int:
    """In a rollout process (rollout.cpu_nice, rollout.cpu_sched): raise its nice value by
    `nice` and, for policy `idle`, put every thread it has under Linux's SCHED_IDLE (threads
    started later inherit it from the thread that starts them). SCHED_IDLE runs a thread only
    on CPU time no normal-policy thread wants: the trainer's training thread is never
    preempted by a rollout on a core they share, which `nice` alone does not give
    (docs/performance.md, "Rollouts under SCHED_IDLE"), but it yields as much to any other
    busy process of the machine.
    Returns how many threads went under SCHED_IDLE (0 where the OS has no SCHED_IDLE)."""
    if nice:
        os.nice(nice)
    idle = getattr(os, "SCHED_IDLE", None)
    if policy != "idle" or idle is None:
        return 0
    done = 0
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            os.sched_setscheduler(tid, idle, os.sched_param(0))
            done += 1
        except (ProcessLookupError, FileNotFoundError):
            continue  # a thread that ended meanwhile
    return done
