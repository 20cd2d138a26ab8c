"""Relays as plain OS processes, for tests and the relay benchmark.

    with RelayProcess("r0", job, secret, cfg) as r:      # python -m laminar.bench.relay_node
        r.call("set_plan", plan=plan.to_dict())
        r.heartbeat()["latest"]

`prefix` runs the relay under another command, e.g. ["ip", "netns", "exec", "ns3"] to put it in
a network namespace (the benchmark does); `rate_mbit` caps each of its connections
(links.ThrottledTcp). `kill()` sends SIGKILL, the way tests simulate a crashed node; `close()`
stops it politely and removes whatever shared memory it left behind.

The process runs a `BenchRelay`: a relay that also answers `send_to`, the star baseline (send
a complete version to each given relay in turn, not down the chain).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from laminar.bench.links import ThrottledTcp
from laminar.config import RelayConfig
from laminar.relay.chain import Inbox, call, feed_version
from laminar.relay.plan import RelayInfo
from laminar.relay.relay import Relay
from laminar.relay.store import cleanup
from laminar.relay.transport import ROLE_FEED, connect, make_transport


class RelayProcess:
    def __init__(self, relay_id: str, job: str, secret: bytes, cfg: RelayConfig | None = None,
                 prefix: list[str] | None = None, log_path: str | Path | None = None,
                 start_timeout_s: float = 30.0, rate_mbit: float = 0.0) -> None:
        self.cfg = cfg or RelayConfig()
        self.id, self.job, self.secret = relay_id, job, secret
        env = {**os.environ, self.cfg.secret_env: secret.decode()}
        self.log_path = Path(log_path) if log_path else None
        stderr = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        cmd = [*(prefix or []), sys.executable, "-m", "laminar.bench.relay_node", "--id", relay_id,
               "--job", job, "--config", self.cfg.model_dump_json(), "--rate-mbit", str(rate_mbit)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, env=env)
        if stderr is not subprocess.DEVNULL:
            stderr.close()
        self._transport = make_transport(self.cfg.transport, self.cfg.timeout_s)
        self.info = self._read_info(start_timeout_s)

    def _read_info(self, timeout_s: float) -> RelayInfo:
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.kill()
            log = self.log_path.read_text()[-2000:] if self.log_path and self.log_path.exists() else ""
            raise RuntimeError(f"relay {self.id} did not start within {timeout_s}s:\n{log}")
        return RelayInfo.from_dict(json.loads(line))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, op: str, timeout_s: float | None = None, **args: Any) -> Any:
        return call(self._transport, self.info.address, self.secret, op, reply_timeout_s=timeout_s, **args)

    def heartbeat(self) -> dict[str, Any]:
        return self.call("heartbeat")

    def kill(self) -> None:
        """SIGKILL, as a crashed node: no cleanup runs in the relay."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=self.cfg.timeout_s + 5)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc.stdout:
            self.proc.stdout.close()
        cleanup(self.cfg.shm_dir, self.info.shm_prefix)

    def __enter__(self) -> "RelayProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BenchRelay(Relay):
    OPS = (*Relay.OPS, "send_to")

    def send_to(self, targets: list[Mapping[str, Any]], version: int | None = None) -> list[float]:
        """Send a complete version to each target relay in turn (not down the chain); returns
        when each target held it, in seconds from the start. The star baseline."""
        buf = self.store.latest() if version is None else self.store.get(version)
        if buf is None or not buf.is_complete:
            raise ValueError(f"relay {self.id} has no complete version {version} to send")
        buf = self.store.pin(buf.version)
        start, done = time.perf_counter(), []
        try:
            for t in targets:
                link = connect(self.transport, RelayInfo.from_dict(t).address, self.secret, ROLE_FEED)
                try:
                    feed_version(link, Inbox(link), buf, self.cfg.timeout_s,
                                 heartbeat_s=self.cfg.heartbeat_s)
                finally:
                    link.close()
                done.append(time.perf_counter() - start)
        finally:
            self.store.unpin(buf)
        return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m laminar.bench.relay_node",
                                description="Run one relay as a plain process. The job secret is "
                                "read from the environment variable named by relay.secret_env.")
    p.add_argument("--id", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--config", default="{}", help="RelayConfig fields as JSON")
    p.add_argument("--rate-mbit", type=float, default=0.0, help="cap each connection (0 = off)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = RelayConfig.model_validate(json.loads(args.config))
    secret = os.environ.get(cfg.secret_env)
    if not secret:
        print(f"relay: environment variable {cfg.secret_env} (relay.secret_env) holds no job "
              "secret", file=sys.stderr)
        return 2
    transport = ThrottledTcp(cfg.timeout_s, args.rate_mbit) if args.rate_mbit > 0 else None
    relay = BenchRelay(args.id, args.job, secret.encode(), cfg, transport)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    print(json.dumps(relay.info.to_dict()), flush=True)
    while not stopped.is_set() and not relay._stop.is_set():
        stopped.wait(0.2)
    relay.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
