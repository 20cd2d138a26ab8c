"""`laminar bench relay`: how long a weight version takes to reach every relay, three ways.

    laminar bench relay [--quick] [--out relay.json]
    LAMINAR_BENCH_RELAY_RATE_MBIT=1000 laminar bench relay     # link rate (default 400)

Eight relay processes, one per emulated node. Where the machine allows it (root, iproute2) every
node is a network namespace whose uplink and downlink are capped by `tc tbf` at the link rate, so
per-link bandwidth, not this machine's two shared cores, is the bottleneck as on a real cluster;
otherwise a per-connection rate limiter in the relays' transport stands in (links.ThrottledTcp;
the JSON says which).

For M = 64 MiB and 256 MiB and chain lengths p = 2, 4, 8 it measures
  (a) chain: the trainer pushes to the master, relays pass chunks down the chain, pipelined;
  (b) star: the master sends the whole version to each relay in turn;
  (c) Ray: one `ray.put` on node 0, every other node's actor `ray.get`s it (a real multi-node
      Ray cluster, one node per namespace);
and prints the Appendix D model next to the chain (and a star model next to the star). The
model's inputs are measured separately: T_byte from a raw TCP stream over one link, T_start from
a one-chunk version sent down the 8-relay chain. Also: the trainer's push stall vs p, and a
rollout's pull (map + copy into preallocated weights) vs a plain memcpy of the same bytes.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from laminar.bench.links import Netns
from laminar.provenance import provenance
from laminar.bench.relay_node import RelayProcess
from laminar.bench.relay_ray import ray_in_namespaces
from laminar.config import RelayConfig
from laminar.relay.client import Puller, Pusher
from laminar.relay.plan import ChainPlan, build_chain

MiB = 1 << 20
SECRET = uuid.uuid4().hex.encode()
NODES = 8


def main(quick: bool = False, out: str | None = None) -> dict[str, Any]:
    rate = float(os.environ.get("LAMINAR_BENCH_RELAY_RATE_MBIT", "400"))
    sizes = [64] if quick else [64, 256]
    ps = [2, 4, 8]
    reps = 1 if quick else 5
    ok, why = Netns.available()
    network = "netns+veth+tbf" if ok else "in-transport token bucket"
    print(f"relay bench: {NODES} relays, links {rate:g} Mbit/s via {network}"
          f"{'' if ok else f' (no namespaces: {why})'}", flush=True)
    res: dict[str, Any] = {"network": network, "network_note": why, "rate_mbit": rate,
                           "chunk_bytes": RelayConfig().chunk_bytes, "sizes_mib": sizes, "reps": reps}
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lam-bench-")))
        net = stack.enter_context(Netns(NODES, rate)) if ok else None
        phase = time.perf_counter()
        res.update(_relay_part(net, rate, tmp, sizes, ps, reps))
        print(f"  (relay part took {time.perf_counter() - phase:.0f}s)", flush=True)
        if net is not None:
            phase = time.perf_counter()
            ray_res = ray_in_namespaces(net, NODES, sizes, ps, [_slow_reps(m, reps) for m in sizes])
            print(f"  (Ray part took {time.perf_counter() - phase:.0f}s)", flush=True)
        else:
            ray_res = {"note": "Ray nodes need network namespaces to be a network broadcast; skipped"}
    for m in sizes:
        res["by_size"][f"{m}MiB"]["ray_s_by_p"] = ray_res.get(f"{m}MiB", {})
    res["ray_note"] = ray_res.get("note", "one Ray node per namespace, same links")
    _headline(res, f"{max(sizes)}MiB")
    res["provenance"] = provenance({"quick": quick, "nodes": NODES, "rate_mbit": rate,
                                    "sizes_mib": sizes, "chain_lengths": ps, "reps": reps})
    _print_table(res)
    if out:
        Path(out).write_text(json.dumps(res, indent=2))
        print(f"wrote {out}")
    return res


def _relay_part(net: Netns | None, rate: float, tmp: Path, sizes: list[int], ps: list[int],
                reps: int) -> dict[str, Any]:
    job = f"bench{uuid.uuid4().hex[:6]}"
    cfg = RelayConfig(timeout_s=20.0, heartbeat_s=1.0)
    with ExitStack() as stack:
        relays = [stack.enter_context(RelayProcess(
            f"n{i}", job, SECRET, cfg.model_copy(update={"host": net.address(i) if net else "127.0.0.1"}),
            prefix=net.prefix(i) if net else None, log_path=tmp / f"n{i}.log",
            rate_mbit=0.0 if net else rate)) for i in range(NODES)]
        bench = _Bench(relays, cfg)
        stack.callback(bench.pusher.close)
        res: dict[str, Any] = {"by_size": {}}
        res["T_byte_s"] = t_byte = _raw_link_seconds_per_byte(net, rate)
        res["T_start_s"] = t_start = bench.hop_latency()
        res["T_start_rtt_half_s"] = _raw_half_rtt(net)
        for m in sizes:
            res["by_size"][f"{m}MiB"] = bench.run_size(m * MiB, ps, reps, _slow_reps(m, reps),
                                                       t_byte, t_start)
        return res


class _Bench:
    def __init__(self, relays: list[RelayProcess], cfg: RelayConfig) -> None:
        self.relays, self.cfg = relays, cfg
        self.version = 0
        self.pusher = Pusher(build_chain([r.info for r in relays]), SECRET, cfg)

    def _plan(self, p: int) -> ChainPlan:
        plan = build_chain([r.info for r in self.relays[:p]], epoch=self.version)
        for r in self.relays:
            r.call("set_plan", plan=plan.to_dict())
        return plan

    def _wait(self, relays: list[RelayProcess], version: int, timeout: float = 300.0) -> list[dict]:
        """Heartbeats of `relays` once all hold `version`. Polls the tail first (it completes
        last) so that polling costs the relays almost no CPU while they work; the completion
        times come from the relays' own clocks, not from when the poll noticed."""
        end = time.time() + timeout
        for r in reversed(relays):
            while (r.heartbeat()["latest"] or -1) < version:
                if time.time() > end:
                    raise TimeoutError(f"relay {r.id} did not reach version {version} in {timeout}s")
                time.sleep(0.1)
        return [r.heartbeat() for r in relays]

    def _push(self, plan: ChainPlan, sd: dict[str, torch.Tensor]) -> tuple[float, int]:
        self.version += 1
        self.pusher.set_plan(plan)
        return self.pusher.push(sd, self.version).seconds, self.version

    def chain_once(self, p: int, sd: dict[str, torch.Tensor]) -> tuple[float, float]:
        """(broadcast seconds from the master holding it to the last relay holding it, stall)."""
        plan = self._plan(p)
        if self.version:
            self._wait(self.relays[:p], self.version)  # relays new to the chain catch up first
        stall, v = self._push(plan, sd)
        beats = self._wait(self.relays[:p], v)
        done = [b["completed_at"][str(v)] for b in beats]
        return max(done) - done[0], stall

    def star_once(self, p: int, sd: dict[str, torch.Tensor]) -> float:
        plan = self._plan(1)  # nobody forwards: the master alone sends
        _, v = self._push(plan, sd)
        targets = [r.info.to_dict() for r in self.relays[1:p]]
        per_target = self.relays[0].call("send_to", targets=targets, version=v, timeout_s=1800)
        return per_target[-1]

    def hop_latency(self) -> float:
        """T_start: per-hop cost of a one-chunk (4 KiB) version down all 8 relays."""
        tiny = {"w": torch.zeros(1024)}
        times = [self.chain_once(NODES, tiny)[0] for _ in range(5)]
        return statistics.median(times) / (NODES - 1)

    def pull_vs_memcpy(self, relay: RelayProcess, sd: dict[str, torch.Tensor], reps: int) -> dict[str, float]:
        """A rollout's pull (lock the newest version at its relay, copy it into preallocated
        weights) against a plain copy of the same bytes between two ordinary buffers. Caches
        are flushed before each timed copy so that neither side gets a warm last-level cache."""
        dst = {k: torch.empty_like(t) for k, t in sd.items()}
        scratch = torch.empty(512 * MiB, dtype=torch.uint8)

        class Preallocated:
            """A `WeightTarget` that copies each tensor into `dst` (a rollout's weights)."""

            def load_weights(self, named, version):
                for k, t in named.items():
                    dst[k].copy_(t)

        puller, target = Puller(relay.info, self.cfg), Preallocated()
        pulls, copies = [], []
        for _ in range(reps + 1):  # the first round maps the slots; it is not counted
            # (more rounds than the broadcasts get: a copy is short and the machine is noisy)
            scratch.add_(1)
            t0 = time.perf_counter()
            puller.pull_latest(target, force=True)
            pulls.append(time.perf_counter() - t0)
            scratch.add_(1)
            t0 = time.perf_counter()
            for k, t in sd.items():
                dst[k].copy_(t)
            copies.append(time.perf_counter() - t0)
        puller.close()
        pull, copy = statistics.median(pulls[1:]), statistics.median(copies[1:])
        return {"pull_s": pull, "memcpy_s": copy, "pull_over_memcpy": pull / copy}

    def run_size(self, nbytes: int, ps: list[int], reps: int, star_reps: int, t_byte: float,
                 t_start: float) -> dict[str, Any]:
        """Chain and star for every p. Repetitions go round all p in turn, so a change in the
        machine's background load hits every p alike instead of skewing the ratios."""
        label = f"{nbytes // MiB}MiB"
        sd = _state_dict(nbytes)
        k = math.ceil(nbytes / self.cfg.chunk_bytes)
        chain: dict[int, list[float]] = {p: [] for p in ps}
        stall: dict[int, list[float]] = {p: [] for p in ps}
        star: dict[int, list[float]] = {p: [] for p in ps}
        for _ in range(self.cfg.keep_versions):  # every relay allocates its slots at this size
            self.chain_once(NODES, sd)
        for rep in range(reps):
            for p in ps:
                c, st = self.chain_once(p, sd)
                chain[p].append(c)
                stall[p].append(st)
                print(f"  {label} rep {rep} p={p}: chain {c:.3f}s "
                      f"(model {chain_model(p, nbytes, k, t_byte, t_start):.3f}s), push stall {st:.3f}s",
                      flush=True)
        for rep in range(star_reps):
            for p in ps:
                star[p].append(self.star_once(p, sd))
                print(f"  {label} rep {rep} p={p}: star {star[p][-1]:.3f}s", flush=True)
        med = statistics.median
        r: dict[str, Any] = {
            "chain_s_by_p": {str(p): med(chain[p]) for p in ps},
            "star_s_by_p": {str(p): med(star[p]) for p in ps},
            "model_s_by_p": {str(p): chain_model(p, nbytes, k, t_byte, t_start) for p in ps},
            "star_model_s_by_p": {str(p): (p - 1) * (nbytes * t_byte + t_start) for p in ps},
            "push_stall_s_by_p": {str(p): med(stall[p]) for p in ps},
            "push_stall_min_s_by_p": {str(p): min(stall[p]) for p in ps},
            "samples": {"chain": chain, "star": star, "push_stall": stall},
            "chunks": k,
            "k_opt_by_p": {str(p): math.sqrt(max(p - 2, 0) * nbytes * t_byte / t_start) for p in ps},
        }
        r.update(self.pull_vs_memcpy(self.relays[max(ps) - 1], sd, 9))
        print(f"  {label} pull {r['pull_s']:.3f}s vs memcpy {r['memcpy_s']:.3f}s", flush=True)
        return r


def _slow_reps(mib: int, reps: int) -> int:
    """Rounds of the star and Ray baselines: they are bandwidth-bound and steady, and one round
    at 256 MiB already takes minutes."""
    return 2 if reps > 1 and mib <= 64 else 1


def chain_model(p: int, m: int, k: int, t_byte: float, t_start: float) -> float:
    """Appendix D, Eq. 1: T(p, k) = (p + k - 2) * (M/k * T_byte + T_start)."""
    return (p + k - 2) * (m / k * t_byte + t_start)


def _state_dict(nbytes: int) -> dict[str, torch.Tensor]:
    """Eight float32 tensors of random weights summing to `nbytes`."""
    g = torch.Generator().manual_seed(0)
    n = nbytes // 4 // 8
    return {f"layers.{i}.weight": torch.randn(n // 1024, 1024, generator=g) for i in range(8)}


# ---------------------------------------------------------------------------------------------
# Raw link calibration (no relay code involved)

_SINK = """
import socket, sys, time
s = socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); n = 0; t0 = None
while (k := c.recv_into(buf)):
    t0 = t0 or time.perf_counter(); n += k
print(n, time.perf_counter() - t0, flush=True)
"""

_ECHO = """
import socket, sys
s = socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (d := c.recv(64)):
    c.sendall(d)
"""

_SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
if sys.argv[3] == "blast":
    data = b"x" * (1 << 20)
    for _ in range(int(sys.argv[4])): c.sendall(data)
else:
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); rtts = []
    for _ in range(int(sys.argv[4])):
        t0 = time.perf_counter(); c.sendall(b"p"); c.recv(64); rtts.append(time.perf_counter() - t0)
    rtts.sort(); print(rtts[len(rtts) // 2], flush=True)
c.close()
"""


def _pair(net: Netns | None, server: str, mode: str, count: int) -> tuple[str, str]:
    host = net.address(1) if net else "127.0.0.1"
    srv = subprocess.Popen([*(net.prefix(1) if net else []), sys.executable, "-c", server, host],
                           stdout=subprocess.PIPE, text=True)
    port = srv.stdout.readline().strip()
    cli = subprocess.run([*(net.prefix(0) if net else []), sys.executable, "-c", _SOURCE, host, port,
                          mode, str(count)], capture_output=True, text=True, check=True)
    srv_out = srv.communicate(timeout=120)[0]
    return srv_out, cli.stdout


def _raw_link_seconds_per_byte(net: Netns | None, rate_mbit: float) -> float:
    if net is None:  # the limiter is exact by construction
        return 8 / (rate_mbit * 1e6)
    srv_out, _ = _pair(net, _SINK, "blast", 64)
    n, secs = srv_out.split()
    return float(secs) / int(n)


def _raw_half_rtt(net: Netns | None) -> float:
    _, cli_out = _pair(net, _ECHO, "ping", 500)
    return float(cli_out) / 2


# ---------------------------------------------------------------------------------------------
# Report


def _headline(res: dict[str, Any], label: str) -> None:
    big = res["by_size"][label]
    for key in ("chain_s_by_p", "star_s_by_p", "ray_s_by_p", "model_s_by_p", "push_stall_s_by_p"):
        res[key] = big.get(key, {})
    chain, star, stall = res["chain_s_by_p"], res["star_s_by_p"], res["push_stall_s_by_p"]
    res["headline_size"] = label
    res["chain_ratio_p8_p2"] = chain["8"] / chain["2"]
    res["star_over_chain_p8"] = star["8"] / chain["8"]
    res["push_stall_ratio_p8_p2"] = stall["8"] / stall["2"]
    res["pull_over_memcpy"] = big["pull_over_memcpy"]
    res["chain_over_model_by_p"] = {p: chain[p] / res["model_s_by_p"][p] for p in chain}


def _print_table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"relay broadcast, {res['rate_mbit']:g} Mbit/s links ({res['network']}), "
                    f"chunk {res['chunk_bytes'] // 1024} KiB")
    for col in ("size", "p", "chain s", "model s", "chain/model", "star s", "star model s", "ray s",
                "push stall s"):
        t.add_column(col, justify="right")
    for label, r in res["by_size"].items():
        for p in r["chain_s_by_p"]:
            ray_s = r.get("ray_s_by_p", {}).get(p)
            t.add_row(label, p, f"{r['chain_s_by_p'][p]:.3f}", f"{r['model_s_by_p'][p]:.3f}",
                      f"{r['chain_s_by_p'][p] / r['model_s_by_p'][p]:.2f}", f"{r['star_s_by_p'][p]:.3f}",
                      f"{r['star_model_s_by_p'][p]:.3f}", f"{ray_s:.3f}" if ray_s else "-",
                      f"{r['push_stall_s_by_p'][p]:.3f}")
    console = Console()
    console.print(t)
    console.print(f"T_byte {res['T_byte_s'] * 1e9:.2f} ns/B ({8 / res['T_byte_s'] / 1e6:.0f} Mbit/s "
                  f"measured), T_start {res['T_start_s'] * 1e3:.2f} ms/hop (raw RTT/2 "
                  f"{res['T_start_rtt_half_s'] * 1e3:.3f} ms)")
    console.print(f"chain p8/p2 {res['chain_ratio_p8_p2']:.2f} (target <= 1.3), star/chain p8 "
                  f"{res['star_over_chain_p8']:.2f} (>= 4), push stall p8/p2 "
                  f"{res['push_stall_ratio_p8_p2']:.2f} (<= 1.2), pull/memcpy "
                  f"{res['pull_over_memcpy']:.2f} (<= 2), chain/model "
                  + ", ".join(f"p{p} {v:.2f}" for p, v in res["chain_over_model_by_p"].items())
                  + " (within 25%)")


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
