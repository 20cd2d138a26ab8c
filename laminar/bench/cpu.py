"""CPU seconds per component while a benchmark runs: where a shared machine's cores go.

Samples every process of the embedded Ray cluster (and the driver) twice a second and groups
their CPU time by component: Ray actors by class (`ray::RolloutActor...` → `RolloutActor`),
Ray's own daemons by name, the driver as `driver`. A process that exits between samples keeps
the CPU time of its last sample. `machine_s` is the whole machine's busy CPU over the same
time (all cores, from the kernel's counters); what the components do not explain, `rest`, is
mostly the sandbox's programs (short-lived processes the sampling misses) and anything else
running on the machine.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import psutil

RAY_DAEMONS = ("gcs_server", "raylet", "dashboard", "log_monitor", "monitor.py", "runtime_env")


def component(cmdline: list[str], pid: int, driver: int) -> str | None:
    """The component a process belongs to, or None if it is not part of the run."""
    if pid == driver:
        return "driver"
    cmd = " ".join(cmdline)
    if cmd.startswith("ray::"):
        name = cmd[5:].split()[0] if len(cmd) > 5 else "ray worker"
        return name.split(".")[0] or "ray worker"
    if "ray" in cmd and any(d in cmd for d in RAY_DAEMONS):
        return "ray daemons"
    return None


class CpuMeter:
    """`with CpuMeter() as m: ...` then `m.seconds` (component → CPU s) and `m.wall_s`."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s = period_s
        self.driver = os.getpid()
        self.start: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.seconds: dict[str, float] = {}
        self.wall_s = 0.0
        self.machine_s = 0.0  # busy CPU seconds of the whole machine (every core)

    def _sample(self, first: bool = False) -> None:
        for p in psutil.process_iter(["cmdline", "cpu_times"]):
            try:
                name = component(p.info["cmdline"] or [], p.pid, self.driver)
                if name is None:
                    continue
                t = p.info["cpu_times"]
                used = t.user + t.system
                if first:
                    self.start[p.pid] = used
                self.last[p.pid] = (name, used)
            except (psutil.Error, TypeError):
                continue

    def _loop(self) -> None:
        while not self.stop.wait(self.period_s):
            self._sample()

    def __enter__(self) -> "CpuMeter":
        self._sample(first=True)
        self.t0, self.busy0 = time.monotonic(), _busy_s()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self._sample()
        self.wall_s = time.monotonic() - self.t0
        self.machine_s = round(_busy_s() - self.busy0, 2)
        total: Counter = Counter()
        for pid, (name, used) in self.last.items():
            total[name] += used - self.start.get(pid, 0.0)
        self.seconds = {k: round(v, 2) for k, v in total.most_common() if v > 0.05}

    @property
    def rest_s(self) -> float:
        """Busy CPU of the machine that no component's processes account for."""
        return round(max(0.0, self.machine_s - sum(self.seconds.values())), 2)


def _busy_s() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)
