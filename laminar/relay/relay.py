"""The relay: one per node, holds weight versions in shared memory and passes them down a chain.

Parts:
- `Relay`: plain Python. A `WeightStore`, a listener (upstream feeds and control requests, both
  authenticated), and one downstream thread that forwards the newest version to the relay's
  successor in the plan, chunk by chunk as chunks arrive. When the successor dies (connection
  refused or reset, handshake or send timeout, no pong) the relay cuts it out of its plan
  (`plan.repair`: one link changes) and feeds the next one, which answers the offer with the
  chunks it already has, so only the missing ones travel.
- Delta versions (the master): a version published here is forwarded as a delta against the
  previous one (`_plan_delta`; a whole one every relay.full_every), encoded chunk by chunk on
  a thread of its own (`_encode_delta`) while the feeder already sends the first chunks; the
  trainer's push returns before any of it.
- Control (the same methods over the TCP control channel or as Ray actor methods): `set_plan`,
  `publish` (master: write a state dict into the store; returns once it is there),
  `reserve` / `commit` (a trainer on this machine writes the version into a slot itself),
  `latest`, `heartbeat`, `stop`.

The Ray edge (one actor per node, the group that starts, heartbeats and repairs them) is
laminar/relay/actor.py; relays as plain OS processes, for tests and the benchmark, are
laminar/bench/relay_node.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from laminar.config import RelayConfig
from laminar.relay.address import AddressError, local_interfaces, node_id, resolve_host
from laminar.relay.chain import Inbox, feed_version, serve_feed, serve_requests
from laminar.relay.delta import RAW, encode_chunk, should_send_full
from laminar.relay.plan import ChainPlan, RelayInfo, repair
from laminar.relay.store import Delta, VersionBuffer, WeightStore
from laminar.relay.transport import (PING, ROLE_CONTROL, ROLE_FEED, LinkError, Transport, connect,
                                     handshake_server, make_transport)
from laminar.relay.version import VersionHeader

log = logging.getLogger("laminar.relay")


def segment_prefix(job: str, relay_id: str) -> str:
    return f"lam-{job}-{relay_id}"


HISTORY = 16  # versions whose completion times a heartbeat reports


class Relay:
    """One relay. Starts listening and forwarding on construction; `stop()` ends it and
    removes its shared memory. `transport`: another than relay.transport's (the benchmark's
    throttled links)."""

    OPS = ("set_plan", "reserve", "commit", "latest", "heartbeat", "probe", "stop")  # control requests

    def __init__(self, relay_id: str, job: str, secret: bytes, cfg: RelayConfig | None = None,
                 transport: Transport | None = None, node_ip: str | None = None) -> None:
        """`node_ip`: this node's address on the cluster (None: one machine); with relay.host
        it decides the address bound and advertised (laminar/relay/address.py)."""
        self.cfg = cfg = cfg or RelayConfig()
        self.id, self.job, self.secret = relay_id, job, secret
        where = f"node {node_ip}" if node_ip else "this machine"
        bind, advertise = resolve_host(cfg.host, node_ip, local_interfaces(), where)
        self.transport = transport or make_transport(cfg.transport, cfg.timeout_s)
        try:
            self.listener = self.transport.listen(bind, cfg.port_range)
        except OSError as e:
            raise AddressError(f"relay {relay_id} on {where} cannot listen on {bind} "
                               f"(relay.host='{cfg.host}', relay.port_range={cfg.port_range}): {e}") from None
        self.store = WeightStore(cfg.shm_dir, segment_prefix(job, relay_id), cfg.keep_versions)
        port = self.listener.address[1]
        self.info = RelayInfo(relay_id, advertise, port, node_id(cfg.shm_dir), self.store.prefix)
        self.plan = ChainPlan((relay_id,), {relay_id: self.info})
        self.failures: list[dict[str, Any]] = []  # successors this relay found dead
        self.completed_at: dict[int, float] = {}  # version -> when it was complete here
        self.forwarded_at: dict[int, float] = {}  # version -> when the successor confirmed it
        self.arrivals: dict[int, dict[str, float]] = {}  # version -> bytes, seconds to arrive
        self.delta_counts: dict[str, int] = {}  # deltas built here, and offers of them refused
        self._last_full: int | None = None  # master: the last version it sent whole
        self._last_delta_ratio = 0.0  # master: the last delta's bytes / its version's
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept_loop, daemon=True, name="relay-accept"),
                         threading.Thread(target=self._downstream_loop, daemon=True, name="relay-down")]
        for t in self._threads:
            t.start()
        log.info("relay %s listening on %s:%d (advertised as %s)", relay_id, bind, port, advertise)

    # -- control ------------------------------------------------------------------------------

    def set_plan(self, plan: ChainPlan | Mapping[str, Any]) -> None:
        plan = plan if isinstance(plan, ChainPlan) else ChainPlan.from_dict(plan)
        if self.id not in plan:
            plan = ChainPlan((self.id,), {self.id: self.info}, plan.epoch)  # not in the chain: idle
        with self.store.cond:
            self.plan = plan
            self.store.cond.notify_all()

    def publish(self, named_tensors: Mapping[str, Any], version: int) -> dict[str, Any]:
        """Write a state dict into this relay's store and publish it; the version is then in
        this relay's memory and forwarding starts in the background."""
        from laminar.relay.pack import prepare_version, write_version  # torch: plain relays never load it

        header, tensors = prepare_version(named_tensors, version, self.cfg.chunk_bytes)
        buf = self.store.create(header, header_final=False)
        write_version(buf.data, header, tensors)
        base = self._plan_delta(buf)
        self.store.finish(buf, header)
        return self._publish(version, base)

    def reserve(self, header: str) -> dict[str, Any]:
        """A process on this machine (the trainer) will write a version: give it a slot."""
        buf = self.store.create(VersionHeader.from_bytes(header.encode()), header_final=False)
        return {"slot": str(buf.path)}

    def commit(self, version: int) -> dict[str, Any]:
        """The process that reserved a slot for `version` wrote it: publish it."""
        buf = self.store.get(version)
        base = self._plan_delta(buf) if buf is not None else None
        self.store.finish_from_slot(version)
        return self._publish(version, base)

    def _publish(self, version: int, base: VersionBuffer | None = None) -> dict[str, Any]:
        self._on_complete(version)  # before readers can see it
        self.store.publish(version)
        if base is not None:
            threading.Thread(target=self._encode_delta, args=(self.store.pin(version), base),
                             daemon=True, name=f"relay-delta-{version}").start()
        return {"version": version, "completed_at": self.completed_at[version]}

    def _plan_delta(self, buf: VersionBuffer) -> VersionBuffer | None:
        """Before a version published here becomes forwardable: whether it travels as a delta,
        and against which base (returned pinned; None: whole)."""
        base = self.store.latest()
        if should_send_full(buf.version, self._last_full, self.cfg.full_every):
            self._last_delta_ratio = 0.0  # the next one tries a delta again
        elif (base is not None and self._last_delta_ratio < 0.9
              and base.header.tensors == buf.header.tensors
              and base.header.chunk_bytes == buf.header.chunk_bytes):
            base = self.store.pin(base.version)
            if base is not None:
                buf.delta = Delta(base.version, buf.header.num_chunks)
                return base
        self._last_full = buf.version
        return None

    def _encode_delta(self, buf: VersionBuffer, base: VersionBuffer) -> None:
        """Encode each chunk against the base, in order, waking the feeder after each; a chunk
        whose delta would not be smaller goes whole (b"")."""
        delta = buf.delta
        whole = 0  # bytes of the chunks that go whole, counted as they are encoded
        try:
            for i in range(buf.header.num_chunks):
                chunk = buf.chunk(i)
                payload = encode_chunk(chunk, base.chunk(i))
                if payload[0] == RAW:
                    whole, payload = whole + len(chunk), b""
                with self.store.cond:
                    delta.payloads[i] = payload
                    self.store.cond.notify_all()
            self._last_delta_ratio = (delta.nbytes + whole) / buf.header.nbytes
            self.delta_counts["built"] = self.delta_counts.get("built", 0) + 1
        except (ValueError, BufferError):
            if not self._stop.is_set():
                raise
            # stop() closed the store under this thread: its slots' memory is gone, and so is
            # every feeder that would have sent the delta
            log.debug("relay %s: delta of v%d abandoned at shutdown", self.id, buf.version)
        finally:
            with self.store.cond:  # whatever happened, no feeder waits for ever: the rest whole
                delta.payloads = [b"" if p is None else p for p in delta.payloads]
                self.store.cond.notify_all()
            self.store.unpin(base)
            self.store.unpin(buf)

    def latest(self) -> dict[str, Any] | None:
        buf = self.store.latest()
        if buf is None:
            return None
        return {"version": buf.version, "path": str(buf.path), "shm_dir": str(self.store.directory),
                "prefix": self.store.prefix, "nbytes": buf.header.nbytes}

    def probe(self, host: str, port: int) -> str | None:
        """Can this relay reach a relay at host:port (connect and prove the secret)? None if
        yes, else why not: the runtime checks every chain link this way before training."""
        try:
            connect(self.transport, (host, port), self.secret, ROLE_CONTROL).close()
        except LinkError as e:
            return str(e)
        return None

    def heartbeat(self) -> dict[str, Any]:
        """Liveness and state, JSON-safe (per-version maps are keyed by str(version))."""
        latest = self.store.latest()
        with self.store.cond:
            successor = self.plan.successor(self.id)
            bufs = [self.store.get(v) for v in self.store.versions()]
            progress = {str(b.version): {"verified": b.num_verified, "chunks": b.header.num_chunks,
                                    "received": b.num_received, "rejected": b.num_rejected,
                                    "wire_bytes": b.wire_bytes,
                                    "delta_base": b.delta.base if b.delta else None}
                        for b in bufs}
        return {"id": self.id, "pid": os.getpid(), "time": time.time(), "info": self.info.to_dict(),
                "epoch": self.plan.epoch, "successor": successor,
                "latest": latest.version if latest else None, "progress": progress,
                "completed_at": {str(v): t for v, t in self.completed_at.items()},
                "forwarded_at": {str(v): t for v, t in self.forwarded_at.items()},
                "failures": list(self.failures), "held": self.store.held_versions(),
                "versions": self.store.versions(), "delta": dict(self.delta_counts),
                "arrivals": {str(v): a for v, a in self.arrivals.items()}}

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        with self.store.cond:
            self.store.cond.notify_all()
        self.listener.close()
        self._threads[1].join(timeout=self.cfg.timeout_s)
        self.store.close()

    # -- threads ------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            link = self.listener.accept()
            if link is None:
                return
            threading.Thread(target=self._serve, args=(link,), daemon=True,
                             name=f"relay-in-{link.peer}").start()

    def _serve(self, link: Any) -> None:
        try:
            role = handshake_server(link, self.secret)
            if role == ROLE_FEED:
                serve_feed(link, self.store, self._on_complete)
            elif role == ROLE_CONTROL:
                serve_requests(link, self._handle)
        except LinkError as e:
            log.debug("relay %s: connection from %s ended: %s", self.id, link.peer, e)
        finally:
            link.close()

    def _handle(self, op: str, args: dict[str, Any]) -> Any:
        if op not in self.OPS:
            raise ValueError(f"unknown relay request '{op}'")
        if op == "stop":
            threading.Thread(target=self.stop, daemon=True).start()
            return None
        return getattr(self, op)(**args)

    def _on_complete(self, version: int) -> None:
        now = time.time()
        _record(self.completed_at, version, now)
        buf = self.store.get(version)
        if buf is not None:  # how long the version took to arrive: the link's measured speed
            self.arrivals[version] = {"bytes": buf.header.nbytes, "seconds": now - buf.created_at,
                                      "wire_bytes": buf.wire_bytes}
            for old in sorted(self.arrivals)[:-HISTORY]:
                del self.arrivals[old]

    def _downstream_loop(self) -> None:
        while not self._stop.is_set():
            with self.store.cond:
                succ = self.plan.successor(self.id)
                if succ is None:
                    self.store.cond.wait(self.cfg.heartbeat_s)
                    continue
                target = self.plan.relays[succ]
            try:
                link = connect(self.transport, target.address, self.secret, ROLE_FEED)
            except LinkError as e:
                self._cut(succ, e)
                continue
            try:
                self._feed(link, succ)
            except LinkError as e:
                log.warning("relay %s: link to %s failed: %s; reconnecting", self.id, succ, e)
            finally:
                link.close()

    def _feed(self, link: Any, succ: str) -> None:
        """Forward versions to `succ` until the plan changes, the relay stops or the link fails."""
        inbox = Inbox(link)
        sent: int | None = None
        idle_since = time.monotonic()

        def plan_changed() -> bool:
            return self._stop.is_set() or self.plan.successor(self.id) != succ

        while not plan_changed():
            buf = self.store.forwardable()
            if buf is None or (sent is not None and buf.version <= sent):
                with self.store.cond:
                    self.store.cond.wait(self.cfg.heartbeat_s)
                if inbox.closed.is_set():
                    raise LinkError(f"{succ} closed the connection")
                if time.monotonic() - inbox.last_seen > self.cfg.timeout_s:
                    raise LinkError(f"{succ} answered no ping for {self.cfg.timeout_s}s")
                if time.monotonic() - idle_since > self.cfg.heartbeat_s:
                    link.send(PING)
                    idle_since = time.monotonic()
                continue
            buf = self.store.pin(buf.version)
            if buf is None:
                continue

            def give_up(v: int = buf.version, b: Any = buf) -> bool:
                # an incomplete version that a newer one overtook will never complete here
                newest = self.store.forwardable()
                return plan_changed() or (not b.is_complete and newest is not None and newest.version > v)

            try:
                ok = feed_version(link, inbox, buf, self.cfg.timeout_s, give_up, self.cfg.heartbeat_s,
                                  self.delta_counts)
            finally:
                self.store.unpin(buf)
            if ok:
                sent = buf.version
                _record(self.forwarded_at, sent, time.time())
            idle_since = time.monotonic()

    def _cut(self, dead: str, err: Exception) -> None:
        with self.store.cond:
            if self.plan.successor(self.id) != dead:
                return
            self.plan = repair(self.plan, dead)
            new = self.plan.successor(self.id)
        self.failures = [*self.failures[-HISTORY + 1:], {"relay": dead, "time": time.time(), "error": str(err)}]
        log.warning("relay %s: successor %s is unreachable (%s); chain repaired, now feeding %s",
                    self.id, dead, err, new)


def _record(times: dict[int, float], version: int, t: float) -> None:
    times[version] = t
    for v in sorted(times)[:-HISTORY]:
        del times[v]
