"""The weight push from the shards at two ranks, FSDP full against grad_op, alternating three
times, 30 pushes each into a real relay process (a scratch experiment behind the A/B figures
docs/trainer.md quotes; not part of the package).

    .venv/bin/python docs/results/scripts/push_ab.py
"""
import statistics, tempfile, uuid
from dataclasses import asdict
from pathlib import Path
from laminar.bench.trainer import _run
from laminar.bench.relay_node import RelayProcess
from laminar.config import RelayConfig
from laminar.trainer.ranks import spawn_ranks
if __name__ == "__main__":
    cfg = RelayConfig(); secret = uuid.uuid4().hex.encode()
    relay = RelayProcess("r0", f"bp{uuid.uuid4().hex[:6]}", secret, cfg, log_path=Path(tempfile.mkdtemp()) / "relay.log")
    k = 0
    try:
        for rep in range(3):
            for mode in ("full", "grad_op"):
                k += 1
                r = spawn_ranks(2, _run, mode, 1, 30, 1000 * k, asdict(relay.info), secret, cfg, threads=1)
                s = r["stalls"]["shards"]
                print(mode, f"median {statistics.median(s)*1e3:.1f} ms  min {min(s)*1e3:.1f}", flush=True)
    finally:
        relay.close()
