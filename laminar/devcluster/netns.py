"""Emulated cluster nodes: one network namespace per node, joined by veth pairs to a bridge.

    with Netns(8, rate_mbit=1000) as net:
        net.prefix(3)      # ["ip", "netns", "exec", "<ns of node 3>"]: run a command on node 3
        net.address(3)     # node 3's IP (10.77.X.4); the host's end of the bridge is 10.77.X.254

Each node's uplink and downlink can be capped with a `tc` token-bucket filter (`rate_mbit`) and
delayed with `netem` (`latency_ms`). Needs root and iproute2 (`ip`, `tc`); `Netns.available()`
says whether this machine allows it. Everything created carries a random tag and is removed on
exit. Used by the relay benchmark (laminar/bench/relay.py) and by the namespaced Ray cluster
(laminar/devcluster/nscluster.py).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class Netns:
    def __init__(self, n: int, rate_mbit: float | None, queue_ms: float = 5.0,
                 latency_ms: float | None = None) -> None:
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"link rate {rate_mbit} Mbit/s must be > 0 (or None: uncapped)")
        if latency_ms is not None and latency_ms < 0:
            raise ValueError(f"link latency {latency_ms} ms must be >= 0")
        self.n, self.rate_mbit, self.queue_ms, self.latency_ms = n, rate_mbit, queue_ms, latency_ms
        self.tag = secrets.token_hex(2)
        self.subnet = 100 + int(self.tag, 16) % 100  # 10.77.<subnet>.0/24
        self.bridge = f"lbr{self.tag}"
        self.names = [f"lam{self.tag}n{i}" for i in range(n)]
        self._made: list[tuple[str, str]] = []

    @staticmethod
    def available() -> tuple[bool, str]:
        if os.geteuid() != 0:
            return False, "not root"
        if not shutil.which("ip") or not shutil.which("tc"):
            return False, "iproute2 (ip, tc) is not installed"
        probe = f"lamprobe{secrets.token_hex(2)}"
        try:
            _run("ip", "netns", "add", probe)
            _run("ip", "netns", "del", probe)
        except (subprocess.CalledProcessError, OSError) as e:
            return False, f"cannot create network namespaces: {getattr(e, 'stderr', e)}"
        return True, "root with iproute2"

    def address(self, i: int) -> str:
        return f"10.77.{self.subnet}.{i + 1}"

    @property
    def host_address(self) -> str:
        return f"10.77.{self.subnet}.254"

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]

    def __enter__(self) -> "Netns":
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _up(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _run("ip", "addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, ns in enumerate(self.names):
            self._add(i, ns)

    def add(self) -> int:
        """One more node on the running bridge (a machine joining the cluster); its index."""
        i = len(self.names)
        if i >= 250:
            raise RuntimeError("a namespaced network holds at most 250 nodes")
        self.names.append(f"lam{self.tag}n{i}")
        self.n += 1
        self._add(i, self.names[i])
        return i

    def _add(self, i: int, ns: str) -> None:
        host_end, node_end = f"lv{self.tag}{i}", f"lp{self.tag}{i}"
        _run("ip", "netns", "add", ns)
        self._made.append(("netns", ns))
        _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end)
        self._made.append(("link", host_end))
        _run("ip", "link", "set", node_end, "netns", ns)
        _run("ip", "link", "set", host_end, "master", self.bridge)
        _run("ip", "link", "set", host_end, "up")
        _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.address(i)}/24", "dev", node_end)
        _run("ip", "netns", "exec", ns, "ip", "link", "set", node_end, "up")
        _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        # uplink (node -> bridge) and downlink (bridge -> node), like a full-duplex NIC
        for dev, where in ((node_end, ["ip", "netns", "exec", ns]), (host_end, [])):
            self._shape(where, dev)

    def _shape(self, where: list[str], dev: str) -> None:
        """tbf caps the rate; a netem delay, when asked for, sits under it."""
        if self.rate_mbit is None and not self.latency_ms:
            return
        tc = [*where, "tc", "qdisc", "add", "dev", dev]
        if self.rate_mbit is not None:
            # the bucket must hold a whole 64 KiB GSO packet with room to spare, or tbf splits every
            # packet into MTU pieces in software and the kernel, not the link, becomes the bottleneck
            burst = f"{max(256 << 10, int(self.rate_mbit * 1e6 / 8 / 500))}b"
            _run(*tc, "root", "handle", "1:", "tbf", "rate", f"{self.rate_mbit}mbit", "burst", burst,
                 "latency", f"{self.queue_ms}ms")
        try:
            if self.latency_ms and self.rate_mbit is not None:
                _run(*tc, "parent", "1:1", "handle", "10:", "netem", "delay", f"{self.latency_ms}ms")
            elif self.latency_ms:
                _run(*tc, "root", "netem", "delay", f"{self.latency_ms}ms")
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"cannot add a {self.latency_ms} ms delay to the links: this kernel "
                               f"has no netem qdisc ({e.stderr.strip()}); leave the latency out") from None

    def close(self) -> None:
        for kind, name in reversed(self._made):
            cmd = ("ip", "netns", "del", name) if kind == "netns" else ("ip", "link", "del", name)
            subprocess.run(cmd, capture_output=True)
        self._made.clear()
