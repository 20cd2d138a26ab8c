"""The job's CPU cores, as the driver found them before `cluster.cpu_affinity` narrowed anything
(laminar/devices.py deals them out; this module imports nothing of laminar's, so the sandbox,
which must not import torch, reads them too).

    job_cores()    # the cores to deal out: $LAMINAR_JOB_CPUS where the driver set it, else ours
    tool_cores()   # for a sandbox's tool programs: the job's cores while it splits, else None
"""

from __future__ import annotations

import os

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
