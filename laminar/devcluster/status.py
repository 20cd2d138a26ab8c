"""`laminar cluster status`: a cluster's nodes and the relay chains of the jobs running on it.

    laminar cluster status                      # the namespaced cluster `laminar cluster up` made
    laminar cluster status --address HOST:PORT  # any Ray cluster

Joins the cluster as a driver (`ray.init(address=...)`), lists the nodes from the GCS and finds
every laminar relay by name (relays are named actors `laminar-<job>-relay-<id>` in the Ray
namespace `laminar`), asks each for a heartbeat and prints, per job, the chain in order: where
each relay listens, the versions it holds, its newest, and the speed at which the last versions
arrived over its incoming link (bytes / (complete - offered)); a relay that does not answer is
shown as such.
"""

from __future__ import annotations

import os
from typing import Any

from laminar.config import ConfigError
from laminar.devcluster.nscluster import find_state, node_rows

RELAY_NAMESPACE = "laminar"


def gather(address: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """{nodes: [...], jobs: {job: [relay heartbeat or {id, error}]}} of the cluster at
    `address`."""
    import ray  # heavy: `laminar cluster up | down` never needs it

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=address, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             namespace=RELAY_NAMESPACE)
    try:
        nodes = node_rows()
        named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == RELAY_NAMESPACE and "-relay-" in a["name"]]
        refs = {}
        for name in named:
            try:
                refs[name] = ray.get_actor(name, namespace=RELAY_NAMESPACE).heartbeat.remote()
            except ValueError:
                continue  # gone between the listing and now
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        jobs: dict[str, list[dict[str, Any]]] = {}
        for name, ref in refs.items():
            job, _, rid = name.removeprefix("laminar-").partition("-relay-")
            try:
                if ref not in ready:
                    raise TimeoutError(f"no heartbeat within {timeout_s:.0f}s")
                entry = ray.get(ref)
            except Exception as e:  # dead or hung: shown, not fatal
                entry = {"id": rid, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
            jobs.setdefault(job, []).append(entry)
        for job, relays in jobs.items():
            relays.sort(key=lambda r: _chain_position(r, relays))
        return {"address": address, "nodes": nodes, "jobs": jobs}
    finally:
        ray.shutdown()


def _chain_position(relay: dict[str, Any], relays: list[dict[str, Any]]) -> tuple[int, str]:
    """Order relays along the chain: follow successors from the one nobody feeds."""
    succ = {r["id"]: r.get("successor") for r in relays if "error" not in r}
    fed = {s for s in succ.values() if s}
    order, seen = [], set()
    for start in sorted(r for r in succ if r not in fed):
        cur = start
        while cur and cur not in seen:
            order.append(cur)
            seen.add(cur)
            cur = succ.get(cur)
    rid = relay["id"]
    return (order.index(rid) if rid in order else len(order), rid)


def link_speed_gbit(relay: dict[str, Any]) -> float | None:
    """Median arrival speed (Gbit/s) of the versions this relay received (None: none yet)."""
    # the bytes that crossed the link: a delta version's encoding, else the version's size
    speeds = sorted((a.get("wire_bytes") or a["bytes"]) * 8 / a["seconds"] / 1e9
                    for a in relay.get("arrivals", {}).values()
                    if a.get("seconds", 0) > 0 and a.get("bytes", 0) > 0)
    return speeds[len(speeds) // 2] if speeds else None


def render(status: dict[str, Any]) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    console = Console(record=True, width=120, file=io.StringIO())
    nodes = Table(title=f"nodes of {status['address']}")
    for col in ("node", "address", "alive", "CPUs", "role"):
        nodes.add_column(col)
    for n in sorted(status["nodes"], key=lambda n: (not n["head"], n["ip"])):
        nodes.add_row(n["id"][:12], n["ip"], "yes" if n["alive"] else "DEAD", f"{n['cpus']:g}",
                      "head" if n["head"] else "worker")
    console.print(nodes)
    if not status["jobs"]:
        console.print("no laminar job is running on this cluster (no relays found)")
    for job, relays in status["jobs"].items():
        t = Table(title=f"job {job}: relay chain, master first")
        for col in ("relay", "listens on", "successor", "newest", "versions held", "in-link Gbit/s",
                    "failures"):
            t.add_column(col)
        for k, r in enumerate(relays):
            if "error" in r:
                t.add_row(r["id"], "-", "-", "-", "-", "-", r["error"])
                continue
            speed = link_speed_gbit(r) if k else None  # the master's versions come from the trainer
            info = r["info"]
            t.add_row(r["id"] + (" (master)" if k == 0 else ""), f"{info['host']}:{info['port']}",
                      r.get("successor") or "-", str(r.get("latest")),
                      ",".join(map(str, r.get("versions", []))) or "-",
                      f"{speed:.2f}" if speed is not None else "-", str(len(r.get("failures", []))))
        console.print(t)
    return console.export_text()


def main(address: str | None, name: str) -> int:
    if address is None:
        state = find_state(name)
        if state is None:
            raise ConfigError(f"no --address given and no cluster named '{name}' is up on this "
                              "machine (`laminar cluster up`); pass --address HEAD_IP:PORT of a "
                              "running Ray cluster")
        address = state.address
    print(render(gather(address)), end="")
    return 0
