"""The transport under the relay chain: authenticated, framed, ordered links.

Parts:
- Frames: type u8, crc32 u32, version i64, chunk index u32, payload length u64, then the
  payload. `Frame` is a parsed header; the message types are the constants below (a
  DELTA_CHUNK's crc is that of the chunk it rebuilds).
- `Link` / `Listener` / `Transport`: the small interface the relay needs (send a frame, send a
  chunk straight from a version's slot, read a frame header, read a payload straight into a
  buffer). `TcpTransport` implements it; `make_transport` is the factory where an RDMA
  transport (UCX) would be added. (The relay benchmark's throttled links subclass it:
  laminar/bench/links.py.)
- `handshake_client` / `handshake_server` / `connect`: mutual HMAC-SHA256 challenge-response
  with the job secret. A peer that fails it is logged and closed before any frame is read.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

from laminar.relay.store import VersionBuffer

log = logging.getLogger("laminar.relay")

OFFER, HAVE, CHUNK, NACK, COMPLETE, PING, PONG, REQUEST, REPLY = range(1, 10)
DELTA_CHUNK = 10  # a chunk encoded against the offer's base version (delta.py)
REFUSED = 2  # HAVE's index when the receiver cannot take a delta (it lacks the base)
FRAME = struct.Struct("!BIqIQ")
MAX_META_BYTES = 256 << 20  # an OFFER's header or a REQUEST is never larger than this
HELLO = b"LMR1"
ROLE_FEED, ROLE_CONTROL = b"F", b"C"


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


def make_transport(name: str, timeout_s: float) -> Transport:
    if name == "tcp":
        return TcpTransport(timeout_s)
    raise ValueError(f"relay.transport='{name}' is not available; use 'tcp'")


# ---------------------------------------------------------------------------------------------
# TCP


class TcpLink(Link):
    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout_s)
        self.sock = sock
        self.peer = "%s:%s" % sock.getpeername()[:2]
        self._send_lock = threading.Lock()

    def send_raw(self, data: bytes | memoryview) -> None:
        try:
            with self._send_lock:
                self.sock.sendall(data)
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
                self._sendfile(buf.file, offset, b - a)
        except OSError as e:
            raise LinkError(f"send to {self.peer} failed: {e!r}") from None

    def _sendfile(self, file, offset: int, count: int) -> None:
        self.sock.sendfile(file, offset, count)

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
    def __init__(self, sock: socket.socket, transport: "TcpTransport") -> None:
        self.sock, self.transport = sock, transport
        self.address = sock.getsockname()[:2]

    def accept(self) -> Link | None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return None
        return self.transport.make_link(conn)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class TcpTransport(Transport):
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def make_link(self, sock: socket.socket) -> TcpLink:
        return TcpLink(sock, self.timeout_s)

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
            return TcpListener(sock, self)
        raise OSError(f"relay could not listen on {host} ports {port_range}: {last}; set "
                      "relay.port_range to a free range or leave it unset for an ephemeral port")

    def connect(self, address: tuple[str, int]) -> Link:
        try:
            sock = socket.create_connection(address, timeout=self.timeout_s)
        except OSError as e:
            raise LinkError(f"cannot connect to relay at {address[0]}:{address[1]}: {e!r}") from None
        return self.make_link(sock)


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
