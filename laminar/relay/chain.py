"""Relay-to-relay transport: framed chunks over an authenticated link, pipelined.

Parts:
- `Link` / `Listener` / `Transport`: the small interface the relay needs (send a frame, read a
  frame header, read a payload straight into a buffer). `TcpTransport` implements it;
  `make_transport` is the factory where an RDMA transport (UCX) would be added.
- `handshake_client` / `handshake_server`: mutual HMAC-SHA256 challenge-response with the job
  secret. A peer that fails it is logged and closed before any frame is read from it.
- `feed_version`: the sending side of one version. Offer the header, learn which chunks the
  receiver already has (so a repaired or late-joining relay only gets what it lacks), send
  each missing chunk as soon as it is verified locally (a relay forwards chunk i while it is
  still receiving chunk i+1), resend chunks the receiver reports as corrupt.
- `serve_feed`: the receiving side. Chunks are read straight into the shared-memory buffer of
  the version, checked against their crc32, and the version is published once complete.
- `call` / `serve_requests`: a tiny JSON request/reply channel on the same port (set the plan,
  adopt a pushed version, status), so relays can be driven without Ray.

Frame: type u8, crc32 u32, version i64, chunk index u32, payload length u64, then the payload.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import queue
import socket
import struct
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from laminar.relay.store import MISSING, RECEIVING, VersionBuffer, VersionHeader, WeightStore

log = logging.getLogger("laminar.relay")

OFFER, HAVE, CHUNK, NACK, COMPLETE, PING, PONG, REQUEST, REPLY = range(1, 10)
FRAME = struct.Struct("!BIqIQ")
MAX_META_BYTES = 256 << 20  # an OFFER's header or a REQUEST is never larger than this
HELLO = b"LMR1"
ROLE_FEED, ROLE_CONTROL = b"F", b"C"
SLICE = 256 << 10  # rate-limited sends go out in slices of this size


class LinkError(ConnectionError):
    """The peer is gone, hung, failed authentication or broke the protocol."""


class LinkIdle(LinkError):
    """Nothing arrived for the link's timeout while waiting for the start of a frame."""


@dataclass(frozen=True, slots=True)
class Frame:
    kind: int
    crc: int
    version: int
    index: int
    length: int


# ---------------------------------------------------------------------------------------------
# Transport interface


class Link(ABC):
    """One authenticated, ordered, reliable byte stream between two relays."""

    peer: str

    @abstractmethod
    def send_raw(self, data: bytes | memoryview) -> None: ...

    @abstractmethod
    def recv_into(self, view: memoryview) -> None:
        """Fill `view` completely or raise LinkError."""

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def set_timeout(self, seconds: float | None) -> None:
        """How long a send or a wait for data may take before the peer counts as hung."""

    def recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        self.recv_into(memoryview(buf))
        return bytes(buf)

    def send(self, kind: int, version: int = 0, index: int = 0, payload: bytes | memoryview = b"",
             crc: int = 0) -> None:
        head = FRAME.pack(kind, crc, version, index, len(payload))
        if len(payload) <= 4096:
            self.send_raw(head + bytes(payload))
        else:
            self.send_raw(head)
            self.send_raw(payload)

    def recv(self) -> Frame:
        return Frame(*FRAME.unpack(self.recv_exact(FRAME.size)))

    def send_chunk(self, buf: VersionBuffer, i: int) -> None:
        """Send chunk i of a version; a transport may send it straight from the segment file."""
        self.send(CHUNK, buf.version, i, buf.chunk(i), crc=buf.header.checksums[i])


class Listener(ABC):
    address: tuple[str, int]

    @abstractmethod
    def accept(self) -> Link | None:
        """The next inbound link, or None once closed."""

    @abstractmethod
    def close(self) -> None: ...


class Transport(ABC):
    @abstractmethod
    def listen(self, host: str, port_range: tuple[int, int] | None) -> Listener: ...

    @abstractmethod
    def connect(self, address: tuple[str, int]) -> Link: ...


def make_transport(name: str, timeout_s: float, rate_limit_mbps: float = 0.0) -> Transport:
    if name == "tcp":
        return TcpTransport(timeout_s, rate_limit_mbps * 1e6 / 8)
    raise ValueError(f"relay.transport='{name}' is not available; use 'tcp'")


# ---------------------------------------------------------------------------------------------
# TCP


class TokenBucket:
    """Caps the bytes per second of one connection (the in-transport rate limiter that stands
    in for a slow link when network namespaces are not available)."""

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


class TcpLink(Link):
    def __init__(self, sock: socket.socket, timeout_s: float, rate: float = 0.0) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout_s)
        self.sock = sock
        self.peer = "%s:%s" % sock.getpeername()[:2]
        self._bucket = TokenBucket(rate, max(rate * 0.01, 2 * SLICE)) if rate > 0 else None
        self._send_lock = threading.Lock()

    def send_raw(self, data: bytes | memoryview) -> None:
        try:
            with self._send_lock:
                if self._bucket is None:
                    self.sock.sendall(data)
                    return
                view = memoryview(data)
                for a in range(0, len(view), SLICE):
                    part = view[a:a + SLICE]
                    self._bucket.consume(len(part))
                    self.sock.sendall(part)
        except OSError as e:  # includes socket.timeout: the peer stopped reading
            raise LinkError(f"send to {self.peer} failed: {e!r}") from None

    def send_chunk(self, buf: VersionBuffer, i: int) -> None:
        # sendfile: the kernel sends the chunk from the shared-memory file's pages, one copy
        # per hop fewer than sendall from the mapping
        a, b = buf.header.chunk_range(i)
        head = FRAME.pack(CHUNK, buf.header.checksums[i], buf.version, i, b - a)
        offset = buf.header.data_offset + a
        try:
            with self._send_lock:
                self.sock.sendall(head)
                step = SLICE if self._bucket else b - a
                for at in range(0, b - a, step):
                    n = min(step, b - a - at)
                    if self._bucket:
                        self._bucket.consume(n)
                    self.sock.sendfile(buf.file, offset + at, n)
        except OSError as e:
            raise LinkError(f"send to {self.peer} failed: {e!r}") from None

    def recv_into(self, view: memoryview) -> None:
        got, n = 0, len(view)
        while got < n:
            try:
                k = self.sock.recv_into(view[got:], n - got)
            except socket.timeout:
                if got == 0:
                    raise LinkIdle(f"nothing from {self.peer} for {self.sock.gettimeout()}s") from None
                raise LinkError(f"{self.peer} stalled in the middle of a frame") from None
            except OSError as e:
                raise LinkError(f"receive from {self.peer} failed: {e!r}") from None
            if k == 0:
                raise LinkError(f"{self.peer} closed the connection")
            got += k

    def set_timeout(self, seconds: float | None) -> None:
        self.sock.settimeout(seconds)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class TcpListener(Listener):
    def __init__(self, sock: socket.socket, timeout_s: float, rate: float) -> None:
        self.sock, self.timeout_s, self.rate = sock, timeout_s, rate
        self.address = sock.getsockname()[:2]

    def accept(self) -> Link | None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return None
        return TcpLink(conn, self.timeout_s, self.rate)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class TcpTransport(Transport):
    def __init__(self, timeout_s: float, rate_bytes_per_s: float = 0.0) -> None:
        self.timeout_s, self.rate = timeout_s, rate_bytes_per_s

    def listen(self, host: str, port_range: tuple[int, int] | None) -> Listener:
        ports = [0] if port_range is None else range(port_range[0], port_range[1] + 1)
        last: OSError | None = None
        for port in ports:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as e:
                sock.close()
                last = e
                continue
            sock.listen(64)
            return TcpListener(sock, self.timeout_s, self.rate)
        raise OSError(f"relay could not listen on {host} ports {port_range}: {last}; set "
                      "relay.port_range to a free range or leave it unset for an ephemeral port")

    def connect(self, address: tuple[str, int]) -> Link:
        try:
            sock = socket.create_connection(address, timeout=self.timeout_s)
        except OSError as e:
            raise LinkError(f"cannot connect to relay at {address[0]}:{address[1]}: {e!r}") from None
        return TcpLink(sock, self.timeout_s, self.rate)


# ---------------------------------------------------------------------------------------------
# Authentication


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def handshake_client(link: Link, secret: bytes, role: bytes) -> None:
    hello = link.recv_exact(len(HELLO) + 16)
    if hello[:4] != HELLO:
        raise LinkError(f"{link.peer} is not a laminar relay")
    nonce_s, nonce_c = hello[4:], os.urandom(16)
    link.send_raw(HELLO + role + nonce_c + _mac(secret, b"client", role, nonce_s, nonce_c))
    proof = link.recv_exact(32)  # a peer that rejected us closes instead: LinkError here
    if not hmac.compare_digest(proof, _mac(secret, b"server", nonce_c, nonce_s)):
        raise LinkError(f"relay at {link.peer} does not know the job secret")


def handshake_server(link: Link, secret: bytes) -> bytes | None:
    """The peer's role, or None (after logging) when it does not prove the job secret."""
    nonce_s = os.urandom(16)
    try:
        link.send_raw(HELLO + nonce_s)
        msg = link.recv_exact(len(HELLO) + 1 + 16 + 32)
    except LinkError as e:
        log.warning("relay handshake with %s failed: %s", link.peer, e)
        return None
    role, nonce_c, mac = msg[4:5], msg[5:21], msg[21:]
    if msg[:4] != HELLO or role not in (ROLE_FEED, ROLE_CONTROL) or not hmac.compare_digest(
            mac, _mac(secret, b"client", role, nonce_s, nonce_c)):
        log.warning("relay refused a connection from %s: it failed the job-secret handshake", link.peer)
        return None
    link.send_raw(_mac(secret, b"server", nonce_c, nonce_s))
    return role


def connect(transport: Transport, address: tuple[str, int], secret: bytes, role: bytes) -> Link:
    link = transport.connect(address)
    try:
        handshake_client(link, secret, role)
    except LinkError:
        link.close()
        raise
    return link


# ---------------------------------------------------------------------------------------------
# Sending one version


class Inbox:
    """Frames the receiver sends back to a feeding relay, read on a thread of their own so
    the feeder can keep streaming chunks."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.last_seen = time.monotonic()  # when the peer last sent anything (pongs included)
        self.frames: queue.Queue[tuple[Frame, bytes] | None] = queue.Queue()
        self.closed = threading.Event()
        threading.Thread(target=self._run, daemon=True, name=f"inbox-{link.peer}").start()

    def _run(self) -> None:
        try:
            while True:
                try:
                    f = self.link.recv()
                except LinkIdle:  # liveness is judged by the feeder from `last_seen`
                    continue
                self.last_seen = time.monotonic()
                if f.length > MAX_META_BYTES:
                    raise LinkError(f"{self.link.peer} sent a {f.length}-byte reply")
                self.frames.put((f, self.link.recv_exact(f.length) if f.length else b""))
        except LinkError:
            pass
        finally:
            self.closed.set()
            self.frames.put(None)

    def get(self, timeout: float) -> tuple[Frame, bytes] | None:
        try:
            item = self.frames.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is None:
            self.frames.put(None)  # keep the end marker for later callers
            raise LinkError(f"{self.link.peer} closed the connection")
        return item


def feed_version(link: Link, inbox: Inbox, buf: VersionBuffer, timeout_s: float,
                 should_stop: Callable[[], bool] = lambda: False, heartbeat_s: float = 1.0) -> bool:
    """Send `buf` to the peer, skipping the chunks it already has, as chunks become available
    locally. Returns True once the peer holds the complete version, False if `should_stop`
    asked to give up. Raises LinkError when the peer dies, hangs or breaks the protocol."""
    h = buf.header
    link.send(OFFER, h.version, payload=h.to_bytes())
    have = _expect(inbox, HAVE, h.version, timeout_s)
    if have[0].index == 1:  # the peer already holds this version (or a newer one)
        return True
    todo = [i for i, b in enumerate(have[1]) if not b]
    resend: list[int] = []
    last_sent = time.monotonic()
    while todo or resend:
        if should_stop():
            return False
        if _drain(inbox, h.version, resend):
            return True
        i = resend.pop(0) if resend else todo[0]
        if not buf.wait_chunk(i, min(heartbeat_s, timeout_s)):
            if time.monotonic() - last_sent > heartbeat_s:  # waiting on our own upstream
                link.send(PING)
                last_sent = time.monotonic()
            if resend:
                resend.insert(0, i)
            continue
        if todo and todo[0] == i:
            todo.pop(0)
        link.send_chunk(buf, i)
        last_sent = time.monotonic()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # every chunk is out: wait for the receiver's verdict
        if _drain(inbox, h.version, resend, block=min(heartbeat_s, timeout_s)):
            return True
        for i in resend:
            link.send_chunk(buf, i)
            deadline = time.monotonic() + timeout_s
        resend.clear()
        if should_stop():
            return False
    raise LinkError(f"{link.peer} did not confirm version {h.version} within {timeout_s}s")


def _expect(inbox: Inbox, kind: int, version: int, timeout_s: float) -> tuple[Frame, bytes]:
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        item = inbox.get(left)
        if item is None:
            break
        if item[0].kind == kind and item[0].version == version:
            return item
    raise LinkError(f"{inbox.link.peer} did not answer the offer of version {version} "
                    f"within {timeout_s}s")


def _drain(inbox: Inbox, version: int, resend: list[int], block: float = 0.0) -> bool:
    """Handle replies that arrived; True once the peer reports the version complete."""
    while (item := inbox.get(block) if block else _nowait(inbox)) is not None:
        block = 0.0
        f, _ = item
        if f.version != version:
            continue
        if f.kind == COMPLETE:
            return True
        if f.kind == NACK and f.index not in resend:
            log.warning("relay %s reports chunk %d of version %d corrupt; sending it again",
                        inbox.link.peer, f.index, version)
            resend.append(f.index)
    return False


def _nowait(inbox: Inbox) -> tuple[Frame, bytes] | None:
    return inbox.get(0.0) if not inbox.frames.empty() else None


# ---------------------------------------------------------------------------------------------
# Receiving


def serve_feed(link: Link, store: WeightStore, on_complete: Callable[[int], None]) -> None:
    """Receive versions from an upstream until it goes away. Chunk payloads land directly in
    the shared-memory buffer; a chunk that fails its crc32 is asked for again (NACK)."""
    pinned: dict[int, VersionBuffer] = {}
    claimed: list[tuple[VersionBuffer, int]] = []
    try:
        while True:
            f = link.recv()
            if f.kind == PING:
                link.send(PONG)
            elif f.kind == OFFER:
                _on_offer(link, store, f, pinned)
            elif f.kind == CHUNK:
                buf = pinned.get(f.version)
                if buf is None:
                    raise LinkError(f"{link.peer} sent a chunk of version {f.version} it never offered")
                if _on_chunk(link, store, buf, f, claimed):
                    on_complete(f.version)  # before publishing: whoever sees it published sees this
                    store.publish(f.version)
                    link.send(COMPLETE, f.version)
                    store.unpin(pinned.pop(f.version))
            else:
                raise LinkError(f"{link.peer} sent an unexpected frame type {f.kind}")
    finally:
        with store.cond:
            for buf, i in claimed:
                if buf.state[i] == RECEIVING:  # cut off mid-chunk: another feeder may retry it
                    buf.state[i] = MISSING
        for buf in pinned.values():
            store.unpin(buf)


def _on_offer(link: Link, store: WeightStore, f: Frame, pinned: dict[int, VersionBuffer]) -> None:
    if f.length > MAX_META_BYTES:
        raise LinkError(f"{link.peer} offered a {f.length}-byte header")
    header = VersionHeader.from_bytes(link.recv_exact(f.length))
    if header.version != f.version or len(header.checksums) != header.num_chunks:
        raise LinkError(f"{link.peer} offered an inconsistent header for version {f.version}")
    latest = store.latest()
    if latest is not None and header.version <= latest.version:
        link.send(HAVE, f.version, index=1)  # already have it, or something newer
        return
    buf = pinned.get(f.version)
    if buf is None:
        buf = store.pin(f.version)
        if buf is None:
            store.create(header)
            buf = store.pin(f.version)
        if buf.header.checksums != header.checksums or buf.header.nbytes != header.nbytes:
            store.unpin(buf)
            raise LinkError(f"{link.peer} offered version {f.version} with different contents "
                            "than the copy this relay already has")
        pinned[f.version] = buf
        for old in [v for v in pinned if v < f.version]:  # the feeder gave those up
            store.unpin(pinned.pop(old))
    link.send(HAVE, f.version, index=int(buf.is_complete), payload=buf.have_bitmap())


def _on_chunk(link: Link, store: WeightStore, buf: VersionBuffer, f: Frame,
              claimed: list[tuple[VersionBuffer, int]]) -> bool:
    h = buf.header
    if not 0 <= f.index < h.num_chunks or f.length != len(buf.chunk(f.index)):
        raise LinkError(f"{link.peer} sent chunk {f.index} of {f.length} bytes; version "
                        f"{f.version} has {h.num_chunks} chunks of {h.chunk_bytes} bytes")
    with store.cond:
        mine = buf.state[f.index] == MISSING
        if mine:
            buf.state[f.index] = RECEIVING
            claimed.append((buf, f.index))
    if not mine:  # verified already, or arriving over another link: read and drop
        link.recv_exact(f.length)
        buf.num_received += 1
        return False
    view = buf.chunk(f.index)
    link.recv_into(view)
    buf.num_received += 1
    if zlib.crc32(view) != h.checksums[f.index] or f.crc != h.checksums[f.index]:
        with store.cond:
            buf.state[f.index] = MISSING
            buf.num_rejected += 1
        log.warning("chunk %d of version %d from %s failed its checksum; asking again",
                    f.index, f.version, link.peer)
        link.send(NACK, f.version, f.index)
        return False
    return store.mark_verified(buf, f.index)


# ---------------------------------------------------------------------------------------------
# Requests (control channel)


def call(transport: Transport, address: tuple[str, int], secret: bytes, op: str,
         reply_timeout_s: float | None = None, **args: Any) -> Any:
    """One request to a relay; returns its result or raises RuntimeError with its error.
    `reply_timeout_s` overrides the transport timeout for slow requests (None: keep it)."""
    link = connect(transport, address, secret, ROLE_CONTROL)
    try:
        if reply_timeout_s is not None:
            link.set_timeout(reply_timeout_s)
        link.send(REQUEST, payload=json.dumps({"op": op, "args": args}).encode())
        f = link.recv()
        if f.kind != REPLY or f.length > MAX_META_BYTES:
            raise LinkError(f"relay at {link.peer} sent frame type {f.kind} instead of a reply")
        reply = json.loads(link.recv_exact(f.length))
    finally:
        link.close()
    if not reply["ok"]:
        raise RuntimeError(f"relay at {address[0]}:{address[1]} refused '{op}': {reply['error']}")
    return reply["result"]


def serve_requests(link: Link, handle: Callable[[str, dict[str, Any]], Any]) -> None:
    while True:
        f = link.recv()
        if f.kind != REQUEST or f.length > MAX_META_BYTES:
            raise LinkError(f"{link.peer} sent frame type {f.kind} on a control connection")
        req = json.loads(link.recv_exact(f.length))
        try:
            reply = {"ok": True, "result": handle(req["op"], req.get("args", {}))}
        except Exception as e:  # the error travels back to the caller, who raises it
            log.exception("relay request %s failed", req.get("op"))
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        link.send(REPLY, payload=json.dumps(reply).encode())

