"""The cost of one tool call, `Sandbox.run("print(1)")`, by path: `oneshot` (every call starts
its own sandbox: two interpreters) and `zygote` (forked by a warm zygote; unshare only), in one
run, as ratios zygote / oneshot.

    python -m laminar.sandbox.bench [--backend unshare] [--paths oneshot,zygote] [-n 200]
                                    [--repeats 2] [--out FILE]
    python -m laminar.sandbox.bench --backend bwrap --paths oneshot    # bwrap has no zygote

Per path and repeat:
  warm (ready)         latency with a ready sandbox waiting (the pool refilled between calls);
  warm (back to back)  latency of calls with no pause (the pool refills while calls come);
  cold (warm=0)        latency when every call starts its sandbox;
  sandbox CPU / call   CPU-seconds (user + system) of every sandbox process over the `warm
                       (ready)` calls, divided by the calls: one-shot, the host's reaped
                       children (getrusage RUSAGE_CHILDREN); zygote, the zygote with its reaped
                       children (/proc/PID/stat utime+stime+cutime+cstime). The kernel's own
                       work done elsewhere (namespaces torn down by kernel threads) is in
                       neither.
  host CPU / call      this process's CPU (all its threads) over the same calls.
The paths alternate within each repeat (oneshot then zygote, then the other order), so a
change in the machine's load hits both.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

from laminar.config import SandboxConfig
from laminar.provenance import provenance
from laminar.sandbox import Sandbox

CODE = "print(1)"
BATCHES = 4  # CPU is read per batch of the warm calls; the median batch is reported too


def _ms(xs: list[float]) -> dict:
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"median": statistics.median(xs), "p90": pick(0.9), "p99": pick(0.99), "min": xs[0],
            "n": len(xs)}


def _ready(sb: Sandbox) -> None:
    deadline = time.monotonic() + 30
    while len(sb._idle) < sb.cfg.warm and time.monotonic() < deadline:
        time.sleep(0.002)
    for p in list(sb._idle):
        p.wait_ready()


def _call(sb: Sandbox) -> float:
    t = time.perf_counter()
    r = sb.run(CODE)
    ms = (time.perf_counter() - t) * 1000
    assert (r.status, r.stdout) == ("ok", "1\n"), r
    return ms


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(path: str, backend: str, n: int) -> dict:
    """One path's rows: latencies (ms) and CPU per call (ms)."""
    base = dict(backend=backend, allow_unsafe=backend == "unsafe", zygote=path == "zygote")
    out: dict = {}
    with Sandbox(SandboxConfig(warm=2, **base)) as sb:
        if path == "zygote" and not sb.uses_zygote:
            raise SystemExit(f"the zygote path needs sandbox.backend=unshare, not {sb.backend}")
        sandbox_cpu = (lambda: sb.zygote().cpu_s()) if path == "zygote" else _children_cpu
        _ready(sb)
        _call(sb)  # the first call of a process pays one-off costs (imports, the probe)
        warm, cpu_batches, host_batches = [], [], []
        per = max(1, n // BATCHES)
        for _ in range(BATCHES):
            _ready(sb)
            c0, h0 = sandbox_cpu(), _self_cpu()
            for _ in range(per):
                _ready(sb)
                warm.append(_call(sb))
            _ready(sb)  # the replacements started during the batch are paid for in it
            if path == "zygote":
                time.sleep(0.05)  # the zygote reaps each program's init as it ends
            cpu_batches.append((sandbox_cpu() - c0) * 1000 / per)
            host_batches.append((_self_cpu() - h0) * 1000 / per)
        out["warm_ready_ms"] = _ms(warm)
        out["sandbox_cpu_ms_per_call"] = {"mean": statistics.fmean(cpu_batches),
                                          "median_batch": statistics.median(cpu_batches),
                                          "batches": cpu_batches}
        out["host_cpu_ms_per_call"] = {"mean": statistics.fmean(host_batches),
                                       "median_batch": statistics.median(host_batches)}
        _ready(sb)
        out["warm_back_to_back_ms"] = _ms([_call(sb) for _ in range(n // 2)])
    with Sandbox(SandboxConfig(warm=0, **base)) as sb:
        _call(sb)
        out["cold_ms"] = _ms([_call(sb) for _ in range(max(10, n // 10))])
    return out


ROWS = [("warm (ready) median ms", "warm_ready_ms", "median"),
        ("warm (ready) p99 ms", "warm_ready_ms", "p99"),
        ("back to back median ms", "warm_back_to_back_ms", "median"),
        ("back to back p99 ms", "warm_back_to_back_ms", "p99"),
        ("cold median ms", "cold_ms", "median"),
        ("sandbox CPU ms / call", "sandbox_cpu_ms_per_call", "mean"),
        ("host CPU ms / call", "host_cpu_ms_per_call", "mean")]


def report(repeats: list[dict], paths: list[str]) -> dict:
    """Per row: each path's median over repeats and, with both paths, the zygote / oneshot
    ratio paired per repeat (the median of the per-repeat ratios)."""
    rows = {}
    for label, key, stat in ROWS:
        vals = {p: [r[p][key][stat] for r in repeats] for p in paths}
        row = {p: statistics.median(v) for p, v in vals.items()}
        if len(paths) == 2:
            row["ratios"] = [z / o for z, o in zip(vals["zygote"], vals["oneshot"]) if o > 0]
            row["ratio"] = statistics.median(row["ratios"]) if row["ratios"] else None
        rows[label] = row
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="unshare", help="the zygote path needs unshare")
    ap.add_argument("--paths", default="oneshot,zygote", help="oneshot, zygote or both")
    ap.add_argument("-n", type=int, default=200, help="warm calls per path and repeat")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", help="write the rows as JSON (with provenance)")
    a = ap.parse_args(argv)
    paths = [p for p in ("oneshot", "zygote") if p in a.paths.split(",")]
    if not paths:
        raise SystemExit(f"--paths {a.paths!r}: give oneshot, zygote or oneshot,zygote")
    repeats = []
    for i in range(a.repeats):
        order = paths if i % 2 == 0 else paths[::-1]
        repeats.append({p: measure(p, a.backend, a.n) for p in order})
    rows = report(repeats, paths)
    print(f"backend {a.backend}, {a.n} warm calls per path, {a.repeats} repeats "
          "(medians over repeats; ratio = zygote / oneshot, paired per repeat)")
    head = "".join(f"{p:>10}" for p in paths)
    print(f"{'':26}{head}" + ("    ratio" if len(paths) == 2 else ""))
    for label, row in rows.items():
        ratio = "" if len(paths) < 2 else (
            f"{row['ratio']:8.2f}x" if row["ratio"] is not None else "       -")
        print(f"{label:26}" + "".join(f"{row[p]:10.2f}" for p in paths) + ratio)
    result = {"benchmark": "sandbox", "backend": a.backend, "code": CODE, "n": a.n,
              "paths": paths, "rows": rows, "repeats": repeats}
    if a.out:
        result["provenance"] = provenance({"backend": a.backend, "paths": paths, "n": a.n,
                                           "repeats": a.repeats})
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
