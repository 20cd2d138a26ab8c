"""Emulated cluster links for benchmarks and tests, two ways.

- `Netns` (laminar/devcluster/netns.py): one network namespace per node, each node's uplink and
  downlink capped with `tc`.
- `ThrottledTcp`: the relay's TCP transport with a per-connection send cap (`TokenBucket`),
  standing in for a slow link where namespaces are not available (and slowing a broadcast
  down enough for a test to kill a relay in the middle of it).
"""

from __future__ import annotations

import socket
import time

from laminar.relay.transport import TcpLink, TcpTransport
from laminar.devcluster.netns import Netns

__all__ = ["Netns", "ThrottledTcp", "TokenBucket"]

SLICE = 256 << 10  # throttled sends go out in slices of this size


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
