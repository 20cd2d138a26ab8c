"""Relays as plain OS processes, driven over their authenticated control channel.

    with RelayProcess("r0", job, secret, cfg) as r:      # python -m laminar.relay.relay
        r.call("set_plan", plan=plan.to_dict())
        r.heartbeat()["latest"]

`prefix` runs the relay under another command, e.g. ["ip", "netns", "exec", "ns3"] to put it in
a network namespace (the benchmark does). `kill()` sends SIGKILL, the way tests simulate a
crashed node; `close()` stops it politely and removes whatever shared memory it left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from laminar.config import RelayConfig
from laminar.relay.chain import call
from laminar.relay.transport import make_transport
from laminar.relay.plan import RelayInfo
from laminar.relay.store import cleanup


class RelayProcess:
    def __init__(self, relay_id: str, job: str, secret: bytes, cfg: RelayConfig | None = None,
                 prefix: list[str] | None = None, log_path: str | Path | None = None,
                 start_timeout_s: float = 30.0) -> None:
        self.cfg = cfg or RelayConfig()
        self.id, self.job, self.secret = relay_id, job, secret
        env = {**os.environ, self.cfg.secret_env: secret.decode()}
        self.log_path = Path(log_path) if log_path else None
        stderr = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        cmd = [*(prefix or []), sys.executable, "-m", "laminar.relay.relay", "--id", relay_id,
               "--job", job, "--config", self.cfg.model_dump_json()]
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
