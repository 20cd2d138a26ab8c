"""Relays as real processes talking over real loopback sockets: broadcast, failures, security."""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from laminar.config import RelayConfig
from laminar.relay.chain import call
from laminar.relay.transport import (CHUNK, DELTA_CHUNK, FRAME, OFFER, ROLE_FEED, LinkError, connect,
                                     make_transport)
from laminar.relay.client import Puller, Pusher
from laminar.relay.plan import RelayInfo, build_chain, join
from laminar.bench.relay_node import RelayProcess
from laminar.relay.reader import read_latest_version
from waiting import until

SECRET = b"job-secret-for-tests"


@pytest.fixture
def job():
    name = f"t{uuid.uuid4().hex[:8]}"
    yield name
    left = sorted(p.name for p in Path("/dev/shm").glob(f"lam-{name}-*"))
    assert not left, f"shared-memory files left behind: {left}"


def make_cfg(**kw) -> RelayConfig:
    # a killed relay is noticed at once (its sockets close); no live one, however loaded the
    # machine, goes 30 s without progress
    return RelayConfig(**{"timeout_s": 30.0, "heartbeat_s": 0.5, "chunk_bytes": 256 << 10, **kw})


@contextmanager
def started(n: int, job: str, tmp_path: Path, cfg: RelayConfig, rate_mbit: float = 0.0):
    with ThreadPoolExecutor(n) as pool:
        procs = list(pool.map(lambda i: RelayProcess(f"r{i}", job, SECRET, cfg, rate_mbit=rate_mbit,
                                                     log_path=tmp_path / f"r{i}.log"), range(n)))
    try:
        yield procs
    finally:
        for p in procs:
            p.close()


def chain_up(procs: list[RelayProcess], infos: list[RelayInfo] | None = None):
    plan = build_chain(infos or [p.info for p in procs])
    for p in procs:
        p.call("set_plan", plan=plan.to_dict())
    return plan


def state_dict(seed: int, scale: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(512 * scale, 256, generator=g),
            "layers.0.attn.qkv": torch.randn(256, 768, generator=g).bfloat16(),
            "layers.0.norm": torch.randn(256, generator=g),
            "layers.1.mlp": torch.randn(256 * scale, 1024, generator=g).half(),
            "step": torch.tensor(seed, dtype=torch.int64)}


def wait_for(pred, what: str = "the condition"):
    until(what, pred, poll_s=0.01)


def holds(proc: RelayProcess, version: int) -> bool:
    return proc.heartbeat()["latest"] == version


def assert_holds_exactly(proc: RelayProcess, sd: dict[str, torch.Tensor], version: int, cfg: RelayConfig):
    with Puller(proc.info, cfg).open_latest() as pulled:
        assert pulled.version == version
        named = pulled.named_tensors()
        assert list(named) == list(sd)
        for k, t in sd.items():
            assert named[k].dtype == t.dtype and torch.equal(named[k], t), k
        del named


@pytest.mark.parametrize("p", [1, 2, 4])
def test_broadcast_down_a_chain_gives_every_relay_identical_bytes(p, job, tmp_path):
    cfg = make_cfg()
    with started(p, job, tmp_path, cfg) as procs:
        plan = chain_up(procs)
        pusher = Pusher(plan, SECRET, cfg)
        for version in (1, 2):
            sd = state_dict(version)
            result = pusher.push(sd, version)
            assert result.master == "r0" and result.failed_masters == []
            for proc in procs:
                wait_for(lambda: holds(proc, version), what=f"{proc.id} to hold v{version}")
            for proc in procs:
                assert_holds_exactly(proc, sd, version, cfg)
        # the buffers themselves are equal byte for byte, not just the tensors
        blobs = []
        for proc in procs:
            with Puller(proc.info, cfg).open_latest() as pulled:
                blobs.append(bytes(pulled.snapshot.data))
        assert all(b == blobs[0] for b in blobs)


def test_killing_a_middle_relay_during_a_broadcast_does_not_stop_the_others(job, tmp_path):
    # 100 Mbit/s per link: an 8 MiB version takes ~0.7 s a hop, long enough to kill r1 mid-way
    cfg = make_cfg()
    with started(4, job, tmp_path, cfg, rate_mbit=100) as procs:
        plan = chain_up(procs)
        sd = state_dict(1, scale=6)
        Pusher(plan, SECRET, cfg).push(sd, 1)

        def r1_half_way() -> bool:
            prog = procs[1].heartbeat()["progress"].get("1")
            return prog is not None and prog["verified"] >= prog["chunks"] // 3
        wait_for(r1_half_way, what="r1 to receive a third of the version")
        os.kill(procs[1].pid, signal.SIGSTOP)  # freeze it, then check it is really mid-way
        assert read_latest_version("/dev/shm", procs[1].info.shm_prefix) is None
        procs[1].kill()

        for proc in (procs[2], procs[3]):
            wait_for(lambda: holds(proc, 1), what=f"{proc.id} to complete v1 after r1 died")
        master = procs[0].heartbeat()
        assert [f["relay"] for f in master["failures"]] == ["r1"]
        for proc in (procs[2], procs[3]):  # (how soon after the failure: bench relay measures it)
            beat = proc.heartbeat()
            prog = beat["progress"]["1"]
            assert prog["received"] == prog["chunks"], "a chunk the successor had was sent again"
            assert_holds_exactly(proc, sd, 1, cfg)
        # the repaired chain carries the next version too
        Pusher(plan, SECRET, cfg).push(state_dict(2), 2)
        for proc in (procs[2], procs[3]):
            wait_for(lambda: holds(proc, 2), what=f"{proc.id} to hold v2")


def test_killing_the_master_elects_its_successor_and_the_next_push_succeeds(job, tmp_path):
    cfg = make_cfg()
    with started(3, job, tmp_path, cfg, rate_mbit=100) as procs:
        plan = chain_up(procs)
        pusher = Pusher(plan, SECRET, cfg)
        pusher.push(state_dict(1), 1)
        for proc in procs:
            wait_for(lambda: holds(proc, 1))
        # the master dies in the middle of broadcasting v2: v2 can never complete
        pusher.push(state_dict(2, scale=6), 2)
        wait_for(lambda: "2" in procs[1].heartbeat()["progress"], what="r1 to start on v2")
        procs[0].kill()
        sd = state_dict(3)
        result = pusher.push(sd, 3)
        assert (result.master, result.failed_masters) == ("r1", ["r0"])
        for proc in procs[1:]:
            wait_for(lambda: holds(proc, 3), what=f"{proc.id} to hold v3 from the new master")
            assert_holds_exactly(proc, sd, 3, cfg)
            beat = proc.heartbeat()
            assert "2" not in beat["completed_at"]  # v2 never completed: it was overtaken
            assert len(beat["progress"]) <= cfg.keep_versions  # and it is not piling up


def test_a_relay_that_joins_late_catches_up_from_its_predecessor(job, tmp_path):
    cfg = make_cfg()
    with started(2, job, tmp_path, cfg) as procs:
        plan = chain_up(procs)
        sd = state_dict(5)
        Pusher(plan, SECRET, cfg).push(sd, 5)
        wait_for(lambda: holds(procs[1], 5))
        with RelayProcess("late", job, SECRET, cfg, log_path=tmp_path / "late.log") as late:
            plan = join(plan, late.info)
            for proc in (*procs, late):
                proc.call("set_plan", plan=plan.to_dict())
            wait_for(lambda: holds(late, 5), what="the late joiner to catch up")
            assert_holds_exactly(late, sd, 5, cfg)


def test_a_connection_with_the_wrong_secret_is_refused_logged_and_never_writes(job, tmp_path):
    cfg = make_cfg()
    with started(1, job, tmp_path, cfg) as (relay,):
        transport = make_transport("tcp", 60.0)
        with pytest.raises(LinkError):
            connect(transport, relay.info.address, b"wrong", ROLE_FEED)
        with pytest.raises(LinkError):
            call(transport, relay.info.address, b"wrong", "set_plan", plan={})

        # a raw client that ignores the handshake and just starts sending a version
        s = socket.create_connection(relay.info.address, timeout=60)
        s.recv(20)  # the relay's hello
        s.sendall(b"LMR1F" + b"\0" * 48)  # a handshake with a bogus MAC
        header = b'{"version":9}'
        try:
            s.sendall(FRAME.pack(OFFER, 0, 9, 0, len(header)) + header)
            s.sendall(FRAME.pack(CHUNK, 0, 9, 0, 4) + b"evil")
        except OSError:
            pass  # the relay may already have closed the socket
        assert s.recv(100) == b""  # closed without a word: no proof of the secret came back
        s.close()

        beat = relay.heartbeat()
        assert beat["latest"] is None and beat["progress"] == {}
        assert not list(Path("/dev/shm").glob(f"{relay.info.shm_prefix}.*"))
        wait_for(lambda: relay.log_path.read_text().count("failed the job-secret handshake") >= 3,
                 what="the refusals to be logged")


class CorruptingProxy:
    """Sits between two relays and flips one byte inside one chunk's payload, once."""

    def __init__(self, target: tuple[str, int], chunk_index: int, kind: int = CHUNK) -> None:
        self.target, self.chunk_index, self.flipped, self.kind = target, chunk_index, 0, kind
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pump_raw, args=(server, client), daemon=True).start()
            threading.Thread(target=self._pump_frames, args=(client, server), daemon=True).start()

    @staticmethod
    def _read(sock: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            part = sock.recv(n - len(buf))
            if not part:
                raise OSError("closed")
            buf += part
        return buf

    def _pump_raw(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass

    def _pump_frames(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            dst.sendall(self._read(src, 4 + 1 + 16 + 32))  # the feeder's handshake
            while True:
                head = self._read(src, FRAME.size)
                kind, _, _, index, length = struct.unpack("!BIqIQ", head)
                payload = bytearray(self._read(src, length))
                if kind == self.kind and index == self.chunk_index and not self.flipped:
                    payload[len(payload) // 2] ^= 0xFF
                    self.flipped += 1
                dst.sendall(head + payload)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


def test_a_corrupted_chunk_is_detected_and_sent_again(job, tmp_path):
    cfg = make_cfg()
    with started(2, job, tmp_path, cfg) as procs:
        proxy = CorruptingProxy(procs[1].info.address, chunk_index=3)
        try:
            via_proxy = RelayInfo("r1", *proxy.address, procs[1].info.node, procs[1].info.shm_prefix)
            plan = chain_up(procs, [procs[0].info, via_proxy])
            sd = state_dict(7)
            Pusher(plan, SECRET, cfg).push(sd, 7)
            wait_for(lambda: holds(procs[1], 7), what="r1 to complete v7 through the proxy")
        finally:
            proxy.close()
        assert proxy.flipped == 1
        prog = procs[1].heartbeat()["progress"]["7"]
        assert prog["rejected"] == 1 and prog["received"] == prog["chunks"] + 1
        assert_holds_exactly(procs[1], sd, 7, cfg)
        assert "failed its checksum" in procs[1].log_path.read_text()


# -- delta versions ------------------------------------------------------------------------------


class AdamLikeModel:
    """fp32 master weights published as bf16; each `step` moves every master weight by about
    lr (what an Adam step does), so at lr 1e-6 a few percent of the bf16 words change."""

    def __init__(self, scale: int = 1, seed: int = 0) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.masters = {"embed.weight": torch.randn(512 * scale, 256, generator=self.g) * 0.02,
                        "layers.0.mlp": torch.randn(256 * scale, 1024, generator=self.g) * 0.02,
                        "layers.0.norm": torch.ones(256)}

    def step(self, lr: float) -> None:
        for t in self.masters.values():
            t -= lr * torch.randn(t.shape, generator=self.g).clamp(-3, 3)

    def published(self) -> dict[str, torch.Tensor]:
        return {k: t.bfloat16() for k, t in self.masters.items()}


def slot_bytes(proc: RelayProcess, cfg: RelayConfig) -> tuple[int, bytes]:
    with Puller(proc.info, cfg).open_latest() as pulled:
        assert pulled.snapshot.verify() == []
        return pulled.version, bytes(pulled.snapshot.data)


@pytest.mark.slow  # four relay processes, four versions: ~10 s alone, 30 s on a loaded machine
def test_a_chain_of_4_forwards_deltas_and_every_slot_is_the_published_bytes(job, tmp_path):
    cfg = make_cfg(full_every=8)
    model = AdamLikeModel()
    with started(4, job, tmp_path, cfg) as procs:
        pusher = Pusher(chain_up(procs), SECRET, cfg)
        for version in range(1, 5):
            model.step(1e-6)
            pusher.push(model.published(), version)
            for proc in procs:
                wait_for(lambda: holds(proc, version), what=f"{proc.id} to hold v{version}")
        sd = model.published()
        for proc in procs:
            assert_holds_exactly(proc, sd, 4, cfg)  # bit for bit what the trainer published
        assert len({slot_bytes(p, cfg) for p in procs}) == 1
        assert procs[0].heartbeat()["delta"]["built"] == 3  # v1 whole, v2..v4 deltas
        for proc in procs[1:]:
            beat = proc.heartbeat()
            assert beat["progress"]["4"]["delta_base"] == 3
            for v in ("2", "3", "4"):  # a delta's wire bytes, against the version's
                a = beat["arrivals"][v]
                assert 0 < a["wire_bytes"] < 0.15 * a["bytes"], (proc.id, v, a)
            assert beat["arrivals"]["1"]["wire_bytes"] == beat["arrivals"]["1"]["bytes"]


def test_a_late_joiner_takes_the_newest_version_whole_then_deltas(job, tmp_path):
    """The new relay lacks every base, so it refuses its predecessor's delta offer (counted)
    and gets the newest version whole from it, not from the master; the next is a delta."""
    cfg = make_cfg(full_every=8)
    model = AdamLikeModel()
    with started(2, job, tmp_path, cfg) as procs:
        plan = chain_up(procs)
        pusher = Pusher(plan, SECRET, cfg)
        for version in (1, 2, 3):
            model.step(1e-6)
            pusher.push(model.published(), version)
            wait_for(lambda: holds(procs[1], version), what=f"r1 to hold v{version}")
        with RelayProcess("late", job, SECRET, cfg, log_path=tmp_path / "late.log") as late:
            plan = join(plan, late.info)
            for proc in (*procs, late):
                proc.call("set_plan", plan=plan.to_dict())
            wait_for(lambda: holds(late, 3), what="the late joiner to catch up")
            assert_holds_exactly(late, model.published(), 3, cfg)
            assert procs[1].heartbeat()["delta"] == {"delta_refused": 1}
            assert procs[0].heartbeat()["delta"].get("delta_refused", 0) == 0
            assert "refused version 3 as a delta" in procs[1].log_path.read_text()
            model.step(1e-6)
            pusher.set_plan(plan)
            pusher.push(model.published(), 4)
            wait_for(lambda: holds(late, 4), what="the late joiner to take v4")
            beat = late.heartbeat()
            assert beat["progress"]["4"]["delta_base"] == 3
            assert beat["arrivals"]["4"]["wire_bytes"] < 0.15 * beat["arrivals"]["4"]["bytes"]
            assert_holds_exactly(late, model.published(), 4, cfg)


def test_a_corrupted_delta_chunk_is_nacked_and_sent_again(job, tmp_path):
    cfg = make_cfg(full_every=8)
    model = AdamLikeModel()
    with started(2, job, tmp_path, cfg) as procs:
        proxy = CorruptingProxy(procs[1].info.address, chunk_index=3, kind=DELTA_CHUNK)
        try:
            via_proxy = RelayInfo("r1", *proxy.address, procs[1].info.node, procs[1].info.shm_prefix)
            pusher = Pusher(chain_up(procs, [procs[0].info, via_proxy]), SECRET, cfg)
            for version in (1, 2):
                model.step(1e-6)
                pusher.push(model.published(), version)
                wait_for(lambda: holds(procs[1], version), what=f"r1 to complete v{version}")
        finally:
            proxy.close()
        assert proxy.flipped == 1
        prog = procs[1].heartbeat()["progress"]["2"]
        assert prog["delta_base"] == 1
        assert prog["rejected"] == 1 and prog["received"] == prog["chunks"] + 1
        assert_holds_exactly(procs[1], model.published(), 2, cfg)


@pytest.mark.slow  # a throttled 8 MiB version: ~10 s
def test_a_relay_killed_mid_delta_shows_readers_only_complete_versions(job, tmp_path):
    """r1 is frozen a third of the way into a delta version and killed: its readers still get
    the base, intact; its successor gets the delta from r0 and ends with the published bytes."""
    cfg = make_cfg(full_every=8)
    model = AdamLikeModel(scale=8)
    with started(3, job, tmp_path, cfg, rate_mbit=20) as procs:
        plan = chain_up(procs)
        pusher = Pusher(plan, SECRET, cfg)
        model.step(1e-6)
        pusher.push(model.published(), 1)
        for proc in procs:
            wait_for(lambda: holds(proc, 1), what=f"{proc.id} to hold v1")
        base = slot_bytes(procs[1], cfg)
        model.step(1e-4)  # a larger update: a delta that takes a while at 20 Mbit/s
        pusher.push(model.published(), 2)

        def r1_a_third_in() -> bool:
            prog = procs[1].heartbeat()["progress"].get("2")
            return prog is not None and prog["verified"] >= prog["chunks"] // 3
        wait_for(r1_a_third_in, what="r1 to rebuild a third of v2")
        os.kill(procs[1].pid, signal.SIGSTOP)
        assert slot_bytes(procs[1], cfg) == base  # mid-delta: readers see v1, whole
        procs[1].kill()
        assert slot_bytes(procs[1], cfg) == base  # and after the kill
        wait_for(lambda: holds(procs[2], 2), what="r2 to get v2 after r1 died")
        assert_holds_exactly(procs[2], model.published(), 2, cfg)
        assert procs[2].heartbeat()["progress"]["2"]["delta_base"] == 1
