"""`laminar bench multinode`: the relay tier and a training job on a real multi-node Ray cluster.

    laminar bench multinode [--quick] [--out multinode.json]

A head raylet and 4 worker raylets, each worker in its own network and mount namespace with a
1 Gbit/s link (laminar/devcluster/nscluster.py: `laminar cluster up --nodes 5 --bandwidth-mbit
1000`). Two parts:

1. **Broadcast across nodes.** Relays are Ray actors, one per node, started the way a job starts
   them (master on the head, relay.host=auto resolving to each node's own address). For the
   tiny model's weights and a ~100 MB state dict, and k = 2, 3, 4 worker nodes: the *chain*
   (the driver pushes to the master on its node; relays forward chunk by chunk down the chain)
   against the *star* (the master sends the whole version to each worker's relay in turn).
   Time = from the moment the master holds the version until the last relay holds it complete
   (one host clock), for both; the trainer-side push into the master is reported apart
   (`push_s_by_nodes`).
   `chain_over_bandwidth_bound` = chain time at 4 nodes / (bytes / link rate).
2. **Training across nodes.** `laminar train` with `cluster.address` on the same cluster, four
   rollouts (one per worker node), laminar mode against sync, on the `bench modes` workload
   (emulated long-tailed tool latency; no warm start: throughput only). Training tokens/s
   after warm-up, as `bench modes` computes it.

JSON keys: `nodes`, `link_mbit`, `sizes_mb`, `chain_s_by_nodes`, `star_s_by_nodes` (by size,
then by worker count), `chain_over_bandwidth_bound`, `star_over_chain`, `tokens_per_s`,
`ratio_laminar_vs_sync`. Targets (issue): chain within 1.3x of size/bandwidth, flat (<= 1.3x)
from 2 to 4 nodes, star/chain >= 3 at 4 nodes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from laminar.actor import alive_nodes, pin
from laminar.bench.modes import WARMUP_STEPS, WORKLOAD, throughput
from laminar.bench.relay_node import BenchRelay
from laminar.config import RelayConfig
from laminar.devcluster.nscluster import NamespacedCluster
from laminar.models.builder import build_preset
from laminar.provenance import provenance
from laminar.relay.client import Pusher
from laminar.relay.plan import ChainPlan, RelayInfo

NODES = 5  # head + 4 workers
LINK_MBIT = 1000.0
MB = 1_000_000


def main(quick: bool = False, out: str | None = None) -> dict[str, Any]:
    ok, why = NamespacedCluster.available()
    report: dict[str, Any] = {"benchmark": "multinode", "nodes": NODES, "link_mbit": LINK_MBIT,
                              "quick": quick, **provenance()}
    if not ok:
        report["note"] = f"not run: {why}"
        print(f"bench multinode: {report['note']}")
        return _write(report, out)
    reps = 2 if quick else 5
    with NamespacedCluster(NODES, bandwidth_mbit=LINK_MBIT, name=f"bench-{os.getpid()}") as c:
        print(f"cluster up: head {c.node_ips[0]}, workers {', '.join(c.node_ips[1:])}, "
              f"{LINK_MBIT:g} Mbit/s links", flush=True)
        spec = {"address": c.address, "reps": reps, "big_mb": 100}
        proc = subprocess.run([sys.executable, "-m", "laminar.bench.multinode", json.dumps(spec)],
                              capture_output=True, text=True, timeout=1800,
                              env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        for ln in proc.stdout.splitlines():
            if ln.startswith("  "):
                print(ln, flush=True)
        if not lines:
            raise RuntimeError(f"broadcast part failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
        report.update(json.loads(lines[-1]))
        report.update(_training(c, quick))
    _summarize(report)
    print_table(report)
    return _write(report, out)


def _write(report: dict[str, Any], out: str | None) -> dict[str, Any]:
    if out:
        Path(out).write_text(json.dumps(report, indent=1))
        print(f"wrote {out}")
    return report


def _summarize(r: dict[str, Any]) -> None:
    chain, star = r.get("chain_s_by_nodes", {}), r.get("star_s_by_nodes", {})
    big = max(chain, key=lambda k: r["sizes_mb"][k]) if chain else None
    if big is None:
        return
    bound = r["sizes_mb"][big] * MB * 8 / (LINK_MBIT * 1e6)
    r["bandwidth_bound_s"] = bound
    r["chain_over_bandwidth_bound"] = chain[big]["4"] / bound
    r["chain_ratio_4_over_2"] = chain[big]["4"] / chain[big]["2"]
    r["star_over_chain"] = {size: star[size]["4"] / chain[size]["4"] for size in chain}
    tps = r.get("tokens_per_s", {})
    if tps.get("laminar") and tps.get("sync"):
        r["ratio_laminar_vs_sync"] = tps["laminar"] / tps["sync"]


def print_table(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"broadcast across nodes ({LINK_MBIT:g} Mbit/s links), median seconds")
    for col in ("state dict", "MB", "chain k=2", "k=3", "k=4", "star k=2", "k=3", "k=4", "star/chain k=4"):
        t.add_column(col)
    for size, by in r.get("chain_s_by_nodes", {}).items():
        star = r["star_s_by_nodes"][size]
        t.add_row(size, f"{r['sizes_mb'][size]:.1f}", *(f"{by[k]:.3f}" for k in ("2", "3", "4")),
                  *(f"{star[k]:.3f}" for k in ("2", "3", "4")), f"{star['4'] / by['4']:.2f}")
    console = Console()
    console.print(t)
    if "chain_over_bandwidth_bound" in r:
        console.print(f"chain at 4 nodes / (size / link rate) = {r['chain_over_bandwidth_bound']:.2f} "
                      f"(bound {r['bandwidth_bound_s']:.3f} s); chain 4/2 nodes = "
                      f"{r['chain_ratio_4_over_2']:.2f}")
    tps = r.get("tokens_per_s", {})
    if tps:
        console.print("training tokens/s across nodes: " + ", ".join(f"{m} {v:.0f}" for m, v in tps.items())
                      + (f"; laminar/sync = {r['ratio_laminar_vs_sync']:.2f}"
                         if "ratio_laminar_vs_sync" in r else ""))


# ----------------------------------------------------------------------------- training part


def _training(c: Any, quick: bool) -> dict[str, Any]:
    steps = 12 if quick else 30
    out: dict[str, Any] = {"tokens_per_s": {}, "train_steps": steps, "train_runs": {}}
    workload = [o for o in WORKLOAD if not o.startswith(("cluster.virtual_nodes", "rollout.num_workers",
                                                         "sft."))]
    for mode in ("laminar", "sync"):
        run = Path(tempfile.mkdtemp(prefix=f"lam-mn-{mode}-"))
        cmd = [sys.executable, "-m", "laminar.cli", "train", "examples/reverse.yaml", *workload,
               f"cluster.address={c.address}", "rollout.num_workers=4", "sft.enabled=false",
               f"mode={mode}", f"trainer.total_steps={steps}", f"run_dir={run}",
               "cluster.wait_timeout_s=300"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                              cwd=Path(__file__).resolve().parents[2])
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            out["train_runs"][mode] = {"error": proc.stderr[-1500:]}
            print(f"  {mode}: failed: {proc.stderr[-500:]}", flush=True)
            continue
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        rows = [x for x in rows if x.get("kind", "step") == "step" and "batch_tokens" in x]
        out["tokens_per_s"][mode] = throughput(rows)
        out["train_runs"][mode] = {"wall_s": round(wall, 1), "steps": len(rows),
                                   "warmup_steps": WARMUP_STEPS, "run_dir": str(run)}
        print(f"  {mode}: {out['tokens_per_s'][mode]:.0f} training tokens/s ({len(rows)} steps, "
              f"{wall:.0f} s)", flush=True)
    return out


# ----------------------------------------------------------------------------- broadcast part
# Runs as `python -m laminar.bench.multinode SPEC`: a driver joined to the cluster.


def _broadcast(spec: dict[str, Any]) -> dict[str, Any]:
    import ray
    import torch

    ray.init(address=spec["address"], include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    head = ray.get_runtime_context().get_node_id()
    nodes = alive_nodes()
    workers = sorted((n for n in nodes if n != head), key=lambda n: tuple(map(int, nodes[n].split("."))))
    cfg = RelayConfig(timeout_s=30.0, heartbeat_s=1.0)
    secret, job = os.urandom(16).hex().encode(), f"mn{os.getpid()}"
    relays = []
    for k, node in enumerate([head, *workers]):
        relays.append(ray.remote(BenchRelay).options(num_cpus=0, max_concurrency=8, **pin(node)).remote(
            f"r{k}", job, secret, cfg, node_ip=nodes[node]))
    infos = [RelayInfo.from_dict(h["info"]) for h in ray.get([r.heartbeat.remote() for r in relays])]
    ids = [i.id for i in infos]
    by_id = {i.id: i for i in infos}

    tiny = {k: v.detach().clone() for k, v in build_preset("tiny").state_dict().items()}
    g = torch.Generator().manual_seed(0)
    per = spec["big_mb"] * MB // 25 // 4
    big = {f"layers.{j}.weight": torch.randn(per, generator=g) for j in range(25)}
    sizes = {"tiny": tiny, f"{spec['big_mb']}MB": big}
    pusher = Pusher(ChainPlan((ids[0],), {ids[0]: by_id[ids[0]]}, 1), secret, cfg)
    version = 0
    chain_s: dict[str, dict[str, float]] = {}
    star_s: dict[str, dict[str, float]] = {}
    push_s: dict[str, dict[str, float]] = {}  # the driver's push into the master (before either)
    sizes_mb: dict[str, float] = {}

    def set_plan(order: list[str], epoch: int) -> None:
        plan = ChainPlan(tuple(order), {i: by_id[i] for i in ids}, epoch)
        ray.get([r.set_plan.remote(plan.to_dict()) for r in relays])
        pusher.set_plan(plan)

    def wait_complete(targets: list[str], v: int, timeout: float = 120.0) -> dict[str, float]:
        end = time.time() + timeout
        while time.time() < end:
            beats = ray.get([relays[ids.index(t)].heartbeat.remote() for t in targets])
            done = {b["id"]: b["completed_at"].get(str(v)) for b in beats}
            if all(done.values()):
                return done
            time.sleep(0.02)
        raise TimeoutError(f"version {v} did not reach {targets} within {timeout}s")

    epoch = 2
    for name, state in sizes.items():
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        sizes_mb[name] = nbytes / MB
        chain_s[name], star_s[name], push_s[name] = {}, {}, {}
        for k in (2, 3, 4):
            chain_t, star_t, push_t = [], [], []
            for _ in range(spec["reps"]):
                version += 1
                epoch += 1
                set_plan(ids[:k + 1], epoch)  # master + k workers, in order
                t0 = time.time()
                pusher.push(state, version)
                done = wait_complete(ids[:k + 1], version)
                # from the moment the master holds it, as the star's time is measured
                chain_t.append(max(done.values()) - done[ids[0]])
                push_t.append(done[ids[0]] - t0)
                version += 1
                epoch += 1
                set_plan(ids[:1], epoch)  # the master alone: nothing forwards this version
                pusher.push(state, version)
                targets = [by_id[i].to_dict() for i in ids[1:k + 1]]
                star_t.append(ray.get(relays[0].send_to.remote(targets, version))[-1])
                time.sleep(0.5)
            chain_s[name][str(k)] = statistics.median(chain_t)
            push_s[name][str(k)] = statistics.median(push_t)
            star_s[name][str(k)] = statistics.median(star_t)
            print(f"  {name} ({sizes_mb[name]:.1f} MB) k={k}: chain {chain_s[name][str(k)]:.3f}s "
                  f"star {star_s[name][str(k)]:.3f}s  (chain samples "
                  f"{', '.join(f'{x:.3f}' for x in chain_t)})", flush=True)
    pusher.close()
    ray.get([r.stop.remote() for r in relays])
    return {"sizes_mb": sizes_mb, "chain_s_by_nodes": chain_s, "star_s_by_nodes": star_s,
            "push_s_by_nodes": push_s,
            "relay_hosts": [i.host for i in infos], "reps": spec["reps"]}


if __name__ == "__main__":
    print(json.dumps(_broadcast(json.loads(sys.argv[1]))), flush=True)
