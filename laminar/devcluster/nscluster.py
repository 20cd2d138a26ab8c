"""A real multi-node Ray cluster on one machine: a head raylet plus N worker raylets, each worker
in its own network namespace and its own mount namespace.

    with NamespacedCluster(nodes=3, bandwidth_mbit=1000) as c:   # head + 2 workers
        c.address          # "10.77.X.254:PORT": cluster.address of a job run on this machine
        c.node_ips         # [head, worker1, worker2]
        c.kill_node(1)     # SIGKILL every process of worker 1 (its raylet included)

    laminar cluster up --nodes 3 [--bandwidth-mbit 1000] [--latency-ms 1]   # the same, kept up
    laminar cluster down

What each worker node is, and why it makes the test real:
- its own **network namespace**, joined to the host by a veth pair on a bridge, with its own IP
  (10.77.X.i); `--bandwidth-mbit` caps both directions of its link with `tc tbf`, `--latency-ms`
  adds a `netem` delay. A relay that binds or advertises the wrong address is unreachable, and
  every byte between nodes crosses a veth.
- its own **mount namespace** with a private tmpfs at `/dev/shm` (a rollout cannot read another
  node's weights) and a private `/tmp` (a reward file in the driver's temporary folder is not
  there: user code has to travel, as on a real cluster). The rest of the filesystem (the
  installed laminar, the Python environment) is shared, as an image is on real nodes.
- Ray is started with `ray start`, exactly as a user starts a real cluster; the head runs in the
  host's namespaces at the bridge's address, so a driver started on this machine
  (`laminar train ... cluster.address=<address>`) joins it as it would join a real head.

Traffic goes only to the addresses of the namespaces this module creates (10.77.X.0/24 on its own
bridge) and to loopback. Root and iproute2 are needed: `NamespacedCluster.available()` says why
not. Everything created is named with a random tag and removed by `down()`, also after a crash
of the command that created it (`laminar cluster down` reads the state file).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

import laminar
from laminar.devcluster.netns import Netns
from laminar.runtime import RAY_ENV

STATE_ROOT = Path(os.environ.get("LAMINAR_CLUSTER_DIR", "/var/tmp/laminar-clusters"))
MiB = 1 << 20


class ClusterError(RuntimeError):
    """A cluster that cannot be created, joined or found; the message says what to do."""


@dataclass
class ClusterState:
    """What `up` made, so that `down` (another process, maybe after a crash) can remove it."""

    name: str
    tag: str
    subnet: int
    bridge: str
    namespaces: list[str]  # worker nodes' network namespaces, node 1.. in order
    head_ip: str
    port: int
    temp_dir: str  # the head's Ray temp dir: every head process names it on its command line
    node_ips: list[str]  # head first
    bandwidth_mbit: float | None = None
    latency_ms: float | None = None
    created: float = field(default_factory=time.time)

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.port}"

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> "ClusterState":
        return cls(**json.loads(path.read_text()))


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ray_bin() -> str:
    near = Path(sys.executable).with_name("ray")
    return str(near) if near.exists() else (shutil.which("ray") or "ray")


class NamespacedCluster:
    def __init__(self, nodes: int = 3, bandwidth_mbit: float | None = None,
                 latency_ms: float | None = None, name: str = "default",
                 cpus_per_node: int = 1, object_store_mb: int = 256) -> None:
        if nodes < 1:
            raise ClusterError(f"--nodes {nodes}: a cluster needs at least the head (nodes >= 1)")
        self.nodes, self.name = nodes, name
        self.cpus, self.object_store = cpus_per_node, object_store_mb * MiB
        self.net = Netns(nodes - 1, rate_mbit=bandwidth_mbit, latency_ms=latency_ms)
        self.dir = STATE_ROOT / name
        self.state: ClusterState | None = None

    @classmethod
    def attach(cls, name: str = "default") -> "NamespacedCluster":
        """The cluster `up` made (in this or another process), to add or kill nodes."""
        state = find_state(name)
        if state is None:
            raise ClusterError(f"no cluster named '{name}' is up on this machine (`laminar cluster up`)")
        c = cls(len(state.node_ips), state.bandwidth_mbit, state.latency_ms, name=name)
        c.net.tag, c.net.subnet, c.net.bridge = state.tag, state.subnet, state.bridge
        c.net.names = list(state.namespaces)
        c.state = state
        return c

    # -------------------------------------------------------------------------------- set-up

    @staticmethod
    def available() -> tuple[bool, str]:
        ok, why = Netns.available()
        if ok and not shutil.which("unshare"):
            return False, "util-linux `unshare` is not installed"
        return ok, why

    @property
    def address(self) -> str:
        assert self.state is not None, "the cluster is not up"
        return self.state.address

    @property
    def node_ips(self) -> list[str]:
        assert self.state is not None, "the cluster is not up"
        return list(self.state.node_ips)

    def __enter__(self) -> "NamespacedCluster":
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self, timeout_s: float = 120.0) -> ClusterState:
        ok, why = self.available()
        if not ok:
            raise ClusterError(f"cannot create a namespaced cluster here: {why} (it needs root, "
                               "iproute2 and util-linux; run as root, or join a real cluster with "
                               "cluster.address)")
        state_file = self.dir / "state.json"
        if state_file.exists():
            raise ClusterError(f"a cluster named '{self.name}' is already up (state in {state_file}); "
                               f"`laminar cluster down --name {self.name}` first, or pick another --name")
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            try:
                self.net.__enter__()
            except RuntimeError as e:  # e.g. no netem for --latency-ms
                raise ClusterError(str(e)) from None
            head_ip = self.net.host_address
            self.state = ClusterState(
                self.name, self.net.tag, self.net.subnet, self.net.bridge, list(self.net.names),
                head_ip, _free_port(head_ip), str(self.dir / "head"),
                [head_ip] + [self.net.address(i) for i in range(self.nodes - 1)],
                self.net.rate_mbit, self.net.latency_ms)
            self.state.save(state_file)  # from here on `down` can remove whatever exists
            self._start_head()
            for i in range(1, self.nodes):
                self._start_worker(i)
            self._wait_nodes(timeout_s)
        except BaseException:
            self.down()
            raise
        return self.state

    def _ray_env(self) -> dict[str, str]:
        return {**RAY_ENV, **os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}

    def _common(self) -> list[str]:
        return ["--num-cpus", str(self.cpus), "--object-store-memory", str(self.object_store),
                "--disable-usage-stats"]

    def _start_head(self) -> None:
        s = self.state
        log = self.dir / "head.log"
        cmd = [_ray_bin(), "start", "--head", "--node-ip-address", s.head_ip, "--port", str(s.port),
               "--include-dashboard=false", "--temp-dir", s.temp_dir, *self._common()]
        with open(log, "wb") as out:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=self._ray_env(),
                                timeout=120).returncode
        if rc != 0:
            raise ClusterError(f"`ray start --head` failed (exit {rc}): {log.read_text()[-800:]}")

    def _start_worker(self, i: int) -> None:
        """`ray start` inside worker i's namespaces: network (its veth and IP), mount (a private
        /dev/shm and a private /tmp bound from this cluster's folder)."""
        s = self.state
        ns, ip = s.namespaces[i - 1], s.node_ips[i]
        tmp, session = self.dir / f"node{i}-tmp", self.dir / f"node{i}-ray"
        tmp.mkdir(parents=True, exist_ok=True)
        session.mkdir(parents=True, exist_ok=True)
        ray_cmd = " ".join([_ray_bin(), "start", "--address", s.address, "--node-ip-address", ip,
                            *self._common()])
        # The installation (Python, the environment, laminar) stays visible where it lies under
        # /tmp (a clone in /tmp): bound aside first, then back into the private /tmp
        keep = [(f"{self.dir}/node{i}-keep{k}", d) for k, d in enumerate(_installed_under_tmp())]
        aside = " && ".join(f"mkdir -p {a} && mount --bind {d} {a}" for a, d in keep)
        back = " && ".join(f"mkdir -p {d} && mount --bind {a} {d}" for a, d in keep)
        # Ray puts every node's session files under the head's temp dir path: each worker gets
        # its own folder there, as it would have on its own disk
        script = " && ".join(x for x in (
            "mount -t tmpfs -o size=8g,mode=1777 laminar-shm /dev/shm", aside,
            f"mount --bind {tmp} /tmp", back, f"mkdir -p {s.temp_dir}",
            f"mount --bind {session} {s.temp_dir}", f"exec {ray_cmd}") if x)
        log = self.dir / f"node{i}.log"
        with open(log, "wb") as out:
            rc = subprocess.run(["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation",
                                 "private", "sh", "-c", script], stdout=out, stderr=subprocess.STDOUT,
                                env=self._ray_env(), timeout=120).returncode
        if rc != 0:
            raise ClusterError(f"`ray start` on node {i} ({ip}) failed (exit {rc}): "
                               f"{log.read_text()[-800:]}")

    def _wait_nodes(self, timeout_s: float) -> None:
        alive = [n["ip"] for n in self.node_table(self.state.node_ips, timeout_s) if n["alive"]]
        if set(self.state.node_ips) <= set(alive):
            return
        missing = sorted(set(self.state.node_ips) - set(alive))
        raise ClusterError(f"nodes {missing} did not join the head at {self.state.address} within "
                           f"{timeout_s:.0f}s; their logs: {self.dir}/node*.log")

    def node_table(self, expect: list[str] | None = None, timeout_s: float = 0.0) -> list[dict[str, Any]]:
        return node_table(self.state.address, expect, timeout_s)

    def add_node(self, timeout_s: float = 120.0) -> str:
        """A machine joins the running cluster: one more worker namespace and raylet. Its IP."""
        s = self.state
        if s is None:
            raise ClusterError("the cluster is not up")
        i = self.net.add() + 1  # node index (the head is 0)
        s.namespaces.append(self.net.names[i - 1])
        s.node_ips.append(self.net.address(i - 1))
        s.save(self.dir / "state.json")
        self._start_worker(i)
        alive = [n["ip"] for n in self.node_table([s.node_ips[i]], timeout_s) if n["alive"]]
        if s.node_ips[i] not in alive:
            raise ClusterError(f"node {s.node_ips[i]} did not join within {timeout_s:.0f}s; its "
                               f"log: {self.dir}/node{i}.log")
        self.nodes += 1
        return s.node_ips[i]

    # -------------------------------------------------------------------------------- faults

    def node_pids(self, i: int) -> list[int]:
        """Every process of node i (its raylet, workers and actors)."""
        s = self.state
        if i == 0:
            return _pids_naming(s.temp_dir)
        out = subprocess.run(["ip", "netns", "pids", s.namespaces[i - 1]], capture_output=True,
                             text=True)
        return [int(p) for p in out.stdout.split()]

    def kill_node(self, i: int) -> list[int]:
        """SIGKILL every process of worker node i: the machine is gone."""
        if i == 0:
            raise ClusterError("kill_node(0) would kill the head; kill a worker node (1..)")
        pids = self.node_pids(i)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    # -------------------------------------------------------------------------------- tear-down

    def down(self) -> None:
        state_file = self.dir / "state.json"
        if self.state is None and state_file.exists():
            self.state = ClusterState.load(state_file)
        if self.state is not None:
            teardown(self.state)
        else:
            self.net.close()
        self.net._made.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.state = None


def teardown(s: ClusterState) -> None:
    """Kill every process of the cluster (worker namespaces' processes, the head's processes, by
    its temp dir), then remove the namespaces, the veths and the bridge. Never `ray stop`: that
    kills every Ray process on the machine, other jobs' included."""
    for _ in range(3):
        pids = _pids_naming(s.temp_dir)
        for ns in s.namespaces:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            pids += [int(p) for p in out.stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.3)
    for ns in s.namespaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for line in out.splitlines():  # the host ends of the veths, then the bridge
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(f"lv{s.tag}"):
            subprocess.run(["ip", "link", "del", name], capture_output=True)
    subprocess.run(["ip", "link", "del", s.bridge], capture_output=True)


def _installed_under_tmp() -> list[str]:
    """Top folders under /tmp that hold this Python, its environment or laminar itself: a
    worker node's private /tmp must still show them (every node has the installation)."""
    tmp = Path("/tmp").resolve()
    tops = set()
    for p in (sys.prefix, sys.base_prefix, sys.executable, Path(laminar.__file__).resolve().parents[1]):
        p = Path(p).resolve()
        if p.is_relative_to(tmp) and p != tmp:
            tops.add(str(tmp / p.relative_to(tmp).parts[0]))
    return sorted(tops)


def _pids_naming(text: str) -> list[int]:
    pids = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(text in a for a in (p.info["cmdline"] or [])) and p.pid != os.getpid():
                pids.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return pids


def node_table(address: str, expect: list[str] | None = None,
               timeout_s: float = 0.0) -> list[dict[str, Any]]:
    """The cluster's nodes as the head's GCS lists them ({id, ip, alive, cpus}), waiting up to
    `timeout_s` for every IP in `expect` to be alive. Asked from a child process, so this
    process never joins the cluster."""
    out = subprocess.run([sys.executable, "-m", "laminar.devcluster.nscluster", "nodes", address,
                          ",".join(expect or []), str(timeout_s)], capture_output=True, text=True,
                         timeout=timeout_s + 60,
                         env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ClusterError(f"cannot read the node table of {address}: {out.stderr[-600:]}") from None


def find_state(name: str = "default") -> ClusterState | None:
    path = STATE_ROOT / name / "state.json"
    return ClusterState.load(path) if path.exists() else None


def node_rows() -> list[dict[str, Any]]:
    """The joined cluster's node table: {id, ip, alive, cpus, head} per node (Ray's GCS)."""
    import ray  # heavy: only the commands that join the cluster need it

    return [{"id": n["NodeID"], "ip": n["NodeManagerAddress"], "alive": bool(n["Alive"]),
             "cpus": n.get("Resources", {}).get("CPU", 0.0),
             "head": "node:__internal_head__" in n.get("Resources", {})} for n in ray.nodes()]


def _print_nodes(address: str, expect: list[str], timeout_s: float) -> None:
    """Child-process helper: the GCS's node table as one JSON line, once every IP in `expect`
    is alive or `timeout_s` passed."""
    import ray  # heavy: only the commands that join the cluster need it

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=address, logging_level="ERROR", log_to_driver=False, include_dashboard=False)
    end = time.time() + timeout_s
    while True:
        nodes = node_rows()
        alive = {n["ip"] for n in nodes if n["alive"]}
        if set(expect) <= alive or time.time() > end:
            break
        time.sleep(0.5)
    print(json.dumps(nodes), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["nodes"]:
        _print_nodes(sys.argv[2], sys.argv[3].split(",") if sys.argv[3] else [], float(sys.argv[4]))
