"""Emulated cluster links for benchmarks and tests, two ways.

- `Netns`: one network namespace per node, joined by veth pairs to a bridge, each node's
  uplink and downlink capped with a `tc` token-bucket filter (tbf).

      with Netns(8, rate_mbit=1000) as net:
          net.prefix(3)      # ["ip", "netns", "exec", "<ns of node 3>"]: run a command on node 3
          net.address(3)     # node 3's IP

  Needs root and iproute2 (`ip`, `tc`); `Netns.available()` says whether this machine allows
  it. Everything created carries a random tag and is removed on exit.
- `ThrottledTcp`: the relay's TCP transport with a per-connection send cap (`TokenBucket`),
  standing in for a slow link where namespaces are not available (and slowing a broadcast
  down enough for a test to kill a relay in the middle of it).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time

from laminar.relay.transport import TcpLink, TcpTransport

SLICE = 256 << 10  # throttled sends go out in slices of this size


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class Netns:
    def __init__(self, n: int, rate_mbit: float, queue_ms: float = 5.0) -> None:
        self.n, self.rate_mbit, self.queue_ms = n, rate_mbit, queue_ms
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
        rate = f"{self.rate_mbit}mbit"
        # the bucket must hold a whole 64 KiB GSO packet with room to spare, or tbf splits every
        # packet into MTU pieces in software and the kernel, not the link, becomes the bottleneck
        burst = f"{max(256 << 10, int(self.rate_mbit * 1e6 / 8 / 500))}b"
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _run("ip", "addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, ns in enumerate(self.names):
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
                _run(*where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", burst, "latency", f"{self.queue_ms}ms")

    def close(self) -> None:
        for kind, name in reversed(self._made):
            cmd = ("ip", "netns", "del", name) if kind == "netns" else ("ip", "link", "del", name)
            subprocess.run(cmd, capture_output=True)
        self._made.clear()


# ---------------------------------------------------------------------------------------------
# Throttled TCP


class TokenBucket:
    """Caps the bytes per second of one connection."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = burst, time.perf_counter()

    def consume(self, n: int) -> None:
        now = time.perf_counter()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= n
        if self.tokens < 0:
            time.sleep(-self.tokens / self.rate)


class ThrottledLink(TcpLink):
    def __init__(self, sock: socket.socket, timeout_s: float, rate: float) -> None:
        super().__init__(sock, timeout_s)
        self.bucket = TokenBucket(rate, max(rate * 0.01, 2 * SLICE))

    def send_raw(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        for a in range(0, len(view), SLICE):
            part = view[a:a + SLICE]
            self.bucket.consume(len(part))
            super().send_raw(part)

    def _sendfile(self, file, offset: int, count: int) -> None:
        for at in range(0, count, SLICE):
            n = min(SLICE, count - at)
            self.bucket.consume(n)
            self.sock.sendfile(file, offset + at, n)


class ThrottledTcp(TcpTransport):
    """TCP whose every connection sends at most `rate_mbit` Mbit/s."""

    def __init__(self, timeout_s: float, rate_mbit: float) -> None:
        super().__init__(timeout_s)
        self.rate = rate_mbit * 1e6 / 8

    def make_link(self, sock: socket.socket) -> TcpLink:
        return ThrottledLink(sock, self.timeout_s, self.rate)
