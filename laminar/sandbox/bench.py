"""Latency of `Sandbox.run("print(1)")`: warm (a ready sandbox waiting), warm back to back (the
pool refilling while calls keep coming), and cold (warm=0: every call starts a sandbox).

    python -m laminar.sandbox.bench [--backend unshare|bwrap|unsafe|auto] [-n 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

from laminar.config import SandboxConfig
from laminar.sandbox import Sandbox


def _stats(ms: list[float]) -> str:
    ms = sorted(ms)
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    return f"median {statistics.median(ms):6.1f} ms  p90 {p90:6.1f} ms  min {ms[0]:6.1f} ms"


def _ready(sb: Sandbox) -> None:
    deadline = time.monotonic() + 30
    while len(sb._idle) < sb.cfg.warm and time.monotonic() < deadline:
        time.sleep(0.005)
    for p in list(sb._idle):
        p.wait_ready()


def _time(sb: Sandbox, n: int, settle: bool) -> list[float]:
    out = []
    for _ in range(n):
        if settle:
            _ready(sb)
        t = time.perf_counter()
        r = sb.run("print(1)")
        out.append((time.perf_counter() - t) * 1000)
        assert r.stdout == "1\n", r
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="unshare")
    ap.add_argument("-n", type=int, default=30)
    a = ap.parse_args(argv)
    cfg = dict(backend=a.backend, allow_unsafe=a.backend == "unsafe")
    with Sandbox(SandboxConfig(warm=2, **cfg)) as sb:
        _ready(sb)
        print(f"backend {sb.backend}")
        print(f"warm (ready)          {_stats(_time(sb, a.n, settle=True))}")
        _ready(sb)
        print(f"warm (back to back)   {_stats(_time(sb, a.n, settle=False))}")
    with Sandbox(SandboxConfig(warm=0, **cfg)) as sb:
        print(f"cold (warm=0)         {_stats(_time(sb, a.n, settle=False))}")


if __name__ == "__main__":
    main()
