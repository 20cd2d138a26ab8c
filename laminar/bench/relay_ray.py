"""The Ray baseline of `laminar bench relay`: a real multi-node Ray cluster, one node per
network namespace (links.Netns), broadcasting a version with one `ray.put` on node 0 and a
`ray.get` on every other node. Runs as `python -m laminar.bench.relay_ray SPEC` inside node 0's
namespace and prints one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from laminar.bench.links import Netns

MiB = 1 << 20


def ray_in_namespaces(net: Netns, nodes: int, sizes: list[int], ps: list[int],
                      reps: list[int]) -> dict[str, Any]:
    """Seconds by size and p for `ray.get` of one `ray.put` on node 0, or {"note": why not}."""
    args = json.dumps({"addresses": [net.address(i) for i in range(nodes)],
                       "prefixes": [net.prefix(i) for i in range(nodes)],
                       "sizes": sizes, "ps": ps, "reps": reps})
    proc = subprocess.run([*net.prefix(0), sys.executable, "-m", "laminar.bench.relay_ray", args],
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"note": f"Ray baseline failed (rc {proc.returncode}): {proc.stderr[-1500:]}"}
    for ln in proc.stdout.splitlines():
        if ln.startswith("  "):
            print(ln, flush=True)
    return json.loads(lines[-1])


def _ray_part(spec: dict[str, Any]) -> None:
    """Runs inside node 0's namespace: start Ray nodes, broadcast with put/get, tear down.
    Prints one JSON line: seconds by size and p, or {"note": why it failed}."""
    import ray

    try:
        for attempt in (1, 2):  # on this shared machine a node now and then fails to come up
            nodes, temp = [], tempfile.mkdtemp(prefix="lamray-")
            try:
                _start_ray_cluster(spec["addresses"], spec["prefixes"], temp, nodes)
                print(json.dumps(_ray_broadcasts(spec)), flush=True)
                return
            except Exception as e:
                if attempt == 2:
                    raise
                print(f"  Ray cluster attempt failed ({e!s:.300}); retrying", flush=True)
            finally:
                ray.shutdown()
                for proc in reversed(nodes):  # our own process groups only, never `ray stop`
                    _kill_group(proc)
                shutil.rmtree(temp, ignore_errors=True)
    except Exception as e:  # reported in the results instead of failing the whole benchmark
        print(json.dumps({"note": f"Ray baseline failed: {type(e).__name__}: {str(e)[:1500]}"}), flush=True)


def _start_ray_cluster(addrs: list[str], prefixes: list[list[str]], temp: str,
                       nodes: list[subprocess.Popen]) -> None:
    import ray

    ray_bin = str(Path(sys.executable).with_name("ray"))
    common = ["--block", "--num-cpus", "1", "--disable-usage-stats",
              "--object-store-memory", str(1536 * MiB)]
    nodes.append(subprocess.Popen(
        [ray_bin, "start", "--head", "--port", "6379", "--node-ip-address", addrs[0],
         "--include-dashboard=false", "--temp-dir", temp, "--resources", json.dumps({"relay0": 1}), *common],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    _wait_port(addrs[0], 6379, 60)
    ray.init(address=f"{addrs[0]}:6379", logging_level="ERROR", log_to_driver=False)
    logs = []
    for i in range(1, len(addrs)):
        logs.append(Path(temp) / f"node{i}.log")
        with open(logs[-1], "wb") as log:
            nodes.append(subprocess.Popen(
                [*prefixes[i], ray_bin, "start", "--address", f"{addrs[0]}:6379", "--node-ip-address",
                 addrs[i], "--resources", json.dumps({f"relay{i}": 1}), *common],
                start_new_session=True, stdout=log, stderr=subprocess.STDOUT))
        time.sleep(1.5)  # staggered: nodes that register at the same instant on one host race
    end = time.time() + 180
    while sum(n["Alive"] for n in ray.nodes()) < len(addrs):
        dead = [i for i, n in enumerate(nodes[1:], 1) if n.poll() is not None]
        if time.time() > end or dead:
            exits = " | ".join(p.read_text()[-400:] for p in Path(temp).glob("session_*/logs/ray_process_exit.log"))
            raise RuntimeError(f"Ray nodes {dead or 'some'} did not join; process exits: {exits or 'none'}; "
                               + " | ".join(logs[i - 1].read_text()[-300:] for i in dead))
        time.sleep(0.3)
    print(f"  Ray cluster of {len(addrs)} nodes up", flush=True)


def _ray_broadcasts(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import ray

    @ray.remote(num_cpus=0)
    class Getter:
        def fetch(self, refs: list) -> int:
            return sum(a.nbytes for a in ray.get(refs[0]).values())

    n = len(spec["addresses"])
    actors = [Getter.options(resources={f"relay{i}": 0.01}).remote() for i in range(1, n)]
    ray.get([a.fetch.remote([ray.put({"w": np.zeros(8)})]) for a in actors])
    out: dict[str, Any] = {}
    for m, reps in zip(spec["sizes"], spec["reps"]):
        rng = np.random.default_rng(0)
        arrays = {f"layers.{j}.weight": rng.standard_normal(m * MiB // 32, dtype=np.float32) for j in range(8)}
        by_p = {}
        for p in spec["ps"]:
            times = []
            for _ in range(reps):
                ref = ray.put(arrays)
                t0 = time.perf_counter()
                ray.get([a.fetch.remote([ref]) for a in actors[:p - 1]])
                times.append(time.perf_counter() - t0)
                del ref
                time.sleep(1.0)  # let the copies on the other nodes be freed
            by_p[str(p)] = statistics.median(times)
            print(f"  {m}MiB p={p}: ray {by_p[str(p)]:.3f}s", flush=True)
        out[f"{m}MiB"] = by_p
    return out


def _wait_port(host: str, port: int, timeout: float) -> None:
    import socket

    end = time.time() + timeout
    while time.time() < end:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"Ray head at {host}:{port} did not come up within {timeout}s")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue


if __name__ == "__main__":
    _ray_part(json.loads(sys.argv[1]))
