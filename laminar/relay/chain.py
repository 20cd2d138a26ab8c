"""The relay chain protocol: pipelined, resumable broadcast of versions over a `Link`.

Parts:
- `feed_version`: the sending side of one version. Offer the header, learn which chunks the
  receiver already has (so a repaired or late-joining relay only gets what it lacks), send
  each missing chunk as soon as it is verified locally (a relay forwards chunk i while it is
  still receiving chunk i+1), resend chunks the receiver reports as corrupt. A version with a
  `Delta` is offered as one (its base named) and its chunks go encoded; a receiver that lacks
  the base refuses with a reason, and the version goes whole instead.
- `Inbox`: the receiver's replies, read on a thread of their own so the feeder keeps streaming.
- `serve_feed`: the receiving side. Chunks are read straight into the shared-memory slot of
  the version (a delta chunk is decoded there against the base version's slot), checked
  against the whole version's crc32 (a bad one is asked for again), and the version is
  published once complete.
- `call` / `request` / `serve_requests`: a tiny JSON request/reply channel on the same port
  (set the plan, reserve and commit a pushed version, heartbeat), so relays can be driven
  without Ray.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

from laminar.relay.delta import RAW, decode_chunk
from laminar.relay.store import MISSING, RECEIVING, VERIFIED, Delta, VersionBuffer, WeightStore
from laminar.relay.transport import (CHUNK, COMPLETE, DELTA_CHUNK, HAVE, MAX_META_BYTES, NACK,
                                     OFFER, PING, PONG, REFUSED, REPLY, REQUEST, ROLE_CONTROL, Frame,
                                     Link, LinkError, LinkIdle, Transport, connect)
from laminar.relay.version import VersionHeader

log = logging.getLogger("laminar.relay")


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
                 should_stop: Callable[[], bool] = lambda: False, heartbeat_s: float = 1.0,
                 counts: dict[str, int] | None = None, as_delta: bool = True) -> bool:
    """Send `buf` to the peer, skipping the chunks it already has, as chunks become available
    locally; a delta (`buf.delta`) goes encoded unless the peer refuses it (it lacks the base:
    then whole; `counts["delta_refused"]` counts those). Returns True once the peer holds the
    complete version, False if `should_stop` asked to give up. Raises LinkError when the peer
    dies, hangs or breaks the protocol."""
    h = buf.header
    delta = buf.delta if as_delta else None
    meta = b"" if delta is None else b"\0" + json.dumps({"base": delta.base}).encode()
    link.send(OFFER, h.version, index=int(delta is not None), payload=h.to_bytes() + meta)
    have = _expect(inbox, HAVE, h.version, timeout_s)
    if have[0].index == REFUSED:
        log.info("relay %s refused version %d as a delta (%s); sending it whole",
                 link.peer, h.version, have[1].decode(errors="replace"))
        if counts is not None:
            counts["delta_refused"] = counts.get("delta_refused", 0) + 1
        return feed_version(link, inbox, buf, timeout_s, should_stop, heartbeat_s, counts, False)
    if have[0].index == 1:  # the peer already holds this version (or a newer one)
        return True
    wait = buf.wait_sendable if delta is not None else buf.wait_chunk
    todo = [i for i, b in enumerate(have[1]) if not b]
    resend: list[int] = []
    last_sent = time.monotonic()
    while todo or resend:
        if should_stop():
            return False
        if _drain(inbox, h.version, resend):
            return True
        i = resend.pop(0) if resend else todo[0]
        if not wait(i, min(heartbeat_s, timeout_s)):
            if time.monotonic() - last_sent > heartbeat_s:  # waiting on our own upstream
                link.send(PING)
                last_sent = time.monotonic()
            if resend:
                resend.insert(0, i)
            continue
        if todo and todo[0] == i:
            todo.pop(0)
        _send(link, buf, i, delta)
        last_sent = time.monotonic()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # every chunk is out: wait for the receiver's verdict
        if _drain(inbox, h.version, resend, block=min(heartbeat_s, timeout_s)):
            return True
        for i in resend:
            _send(link, buf, i, delta)
            deadline = time.monotonic() + timeout_s
        resend.clear()
        if should_stop():
            return False
    raise LinkError(f"{link.peer} did not confirm version {h.version} within {timeout_s}s")


def _send(link: Link, buf: VersionBuffer, i: int, delta: Delta | None) -> None:
    """Chunk i: its delta encoding where there is one, else the chunk whole from the slot."""
    payload = delta.payloads[i] if delta is not None else None
    if payload:
        link.send(DELTA_CHUNK, buf.version, i, payload, crc=buf.header.checksums[i])
    else:
        link.send_chunk(buf, i)


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
    the shared-memory buffer (a delta chunk decoded there against its base's slot); a chunk
    that fails the whole version's crc32 is asked for again (NACK)."""
    pinned: dict[int, VersionBuffer] = {}
    bases: dict[int, VersionBuffer] = {}  # version -> its delta's base, pinned while it arrives
    claimed: list[tuple[VersionBuffer, int]] = []
    try:
        while True:
            f = link.recv()
            if f.kind == PING:
                link.send(PONG)
            elif f.kind == OFFER:
                _on_offer(link, store, f, pinned, bases)
            elif f.kind in (CHUNK, DELTA_CHUNK):
                buf = pinned.get(f.version)
                if buf is None:
                    raise LinkError(f"{link.peer} sent a chunk of version {f.version} it never offered")
                base = bases.get(f.version)
                if f.kind == DELTA_CHUNK and base is None:
                    raise LinkError(f"{link.peer} sent a delta chunk of version {f.version} it "
                                    "offered whole")
                if _on_chunk(link, store, buf, f, claimed, base if f.kind == DELTA_CHUNK else None):
                    on_complete(f.version)  # before publishing: whoever sees it published sees this
                    store.publish(f.version)
                    link.send(COMPLETE, f.version)
                    store.unpin(pinned.pop(f.version))
                    if f.version in bases:
                        store.unpin(bases.pop(f.version))
            else:
                raise LinkError(f"{link.peer} sent an unexpected frame type {f.kind}")
    finally:
        with store.cond:
            for buf, i in claimed:
                if buf.state[i] == RECEIVING:  # cut off mid-chunk: another feeder may retry it
                    buf.state[i] = MISSING
        for buf in [*pinned.values(), *bases.values()]:
            store.unpin(buf)


def _on_offer(link: Link, store: WeightStore, f: Frame, pinned: dict[int, VersionBuffer],
              bases: dict[int, VersionBuffer]) -> None:
    if f.length > MAX_META_BYTES:
        raise LinkError(f"{link.peer} offered a {f.length}-byte header")
    raw, _, meta = link.recv_exact(f.length).partition(b"\0")
    header = VersionHeader.from_bytes(raw)
    if header.version != f.version or len(header.checksums) != header.num_chunks:
        raise LinkError(f"{link.peer} offered an inconsistent header for version {f.version}")
    latest = store.latest()
    if latest is not None and header.version <= latest.version:
        link.send(HAVE, f.version, index=1)  # already have it, or something newer
        return
    base_version = int(json.loads(meta)["base"]) if f.index == 1 else None
    if base_version is not None:
        why = _cannot_take_delta(store, header, base_version, pinned.get(f.version))
        if why:
            link.send(HAVE, f.version, index=REFUSED, payload=why.encode())
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
            if old in bases:
                store.unpin(bases.pop(old))
    if base_version is not None and f.version not in bases:
        base = store.pin(base_version)
        if base is None or not base.is_complete:  # dropped since the check: whole instead
            if base is not None:
                store.unpin(base)
            link.send(HAVE, f.version, index=REFUSED, payload=b"the base version was just dropped")
            return
        bases[f.version] = base
        with store.cond:
            if buf.delta is None:  # chunks already here go on whole
                buf.delta = Delta(base_version, buf.header.num_chunks)
                for i in range(buf.header.num_chunks):
                    if buf.state[i] == VERIFIED:
                        buf.delta.payloads[i] = b""
    link.send(HAVE, f.version, index=int(buf.is_complete), payload=buf.have_bitmap())


def _cannot_take_delta(store: WeightStore, header: VersionHeader, base_version: int,
                       partial: VersionBuffer | None) -> str:
    """Why this relay cannot rebuild `header`'s version from a delta on `base_version` ("" if
    it can)."""
    base = store.get(base_version)
    if base is None or not base.is_complete:
        return (f"this relay does not hold base version {base_version} (it holds "
                f"{store.versions()}); send version {header.version} whole")
    if base.header.nbytes != header.nbytes or base.header.chunk_bytes != header.chunk_bytes:
        return f"base version {base_version} has another layout than version {header.version}"
    if partial is not None and partial.delta is not None and partial.delta.base != base_version:
        return f"a partial copy of version {header.version} is a delta on {partial.delta.base}"
    return ""


def _on_chunk(link: Link, store: WeightStore, buf: VersionBuffer, f: Frame,
              claimed: list[tuple[VersionBuffer, int]], base: VersionBuffer | None = None) -> bool:
    """One chunk frame: the chunk whole, or (`base` given) its delta encoding against `base`."""
    h = buf.header
    size = len(buf.chunk(f.index)) if 0 <= f.index < h.num_chunks else -1
    if size < 0 or (f.length != size if base is None else not 0 < f.length <= size + 1):
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
    ok, payload = True, b""
    if base is None:
        link.recv_into(view)
    else:
        payload = link.recv_exact(f.length)
        try:
            decode_chunk(payload, base.chunk(f.index), view)
        except ValueError as e:  # corrupted on the way: as a failed checksum
            log.warning("delta chunk %d of version %d from %s does not decode: %s",
                        f.index, f.version, link.peer, e)
            ok = False
    buf.num_received += 1
    buf.wire_bytes += f.length
    if not ok or zlib.crc32(view) != h.checksums[f.index] or f.crc != h.checksums[f.index]:
        with store.cond:
            buf.state[f.index] = MISSING
            buf.num_rejected += 1
        log.warning("chunk %d of version %d from %s failed its checksum; asking again",
                    f.index, f.version, link.peer)
        link.send(NACK, f.version, f.index)
        return False
    if buf.delta is not None:  # what this relay forwards: the encoding, or the chunk whole
        buf.delta.payloads[f.index] = payload if payload and payload[0] != RAW else b""
    return store.mark_verified(buf, f.index)


# ---------------------------------------------------------------------------------------------
# Requests (control channel)


def call(transport: Transport, address: tuple[str, int], secret: bytes, op: str,
         reply_timeout_s: float | None = None, **args: Any) -> Any:
    """One request to a relay on a fresh connection; returns its result or raises
    RuntimeError with its error. `reply_timeout_s` overrides the transport timeout."""
    link = connect(transport, address, secret, ROLE_CONTROL)
    try:
        if reply_timeout_s is not None:
            link.set_timeout(reply_timeout_s)
        return request(link, op, **args)
    finally:
        link.close()


def request(link: Link, op: str, **args: Any) -> Any:
    """One request on an open control connection (several may follow on the same one)."""
    link.send(REQUEST, payload=json.dumps({"op": op, "args": args}).encode())
    f = link.recv()
    if f.kind != REPLY or f.length > MAX_META_BYTES:
        raise LinkError(f"relay at {link.peer} sent frame type {f.kind} instead of a reply")
    reply = json.loads(link.recv_exact(f.length))
    if not reply["ok"]:
        raise RuntimeError(f"relay at {link.peer} refused '{op}': {reply['error']}")
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
