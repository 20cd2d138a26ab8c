"""The overhead of durable pools: the bench-faults workload at 60 updates, `laminar train`
twice with durable_pools true and twice false, alternating; prints wall time and training
tokens/s (docs/fault-tolerance.md quotes it). Run from the repository root."""
import json
import statistics
import subprocess
import time
from pathlib import Path

import yaml

from laminar.bench.faults import WORKLOAD

Path("runs/durable-overhead").mkdir(parents=True, exist_ok=True)
res = {True: [], False: []}
for rep in range(2):
    for durable in (True, False):
        w = json.loads(json.dumps(WORKLOAD)); w["trainer"]["total_steps"] = 60
        run = f"runs/durable-overhead/run-{durable}-{rep}"
        w.update(run_dir=run, durable_pools=durable)
        cfg = f"runs/durable-overhead/cfg-{durable}.yaml"; open(cfg, "w").write(yaml.safe_dump(w))
        subprocess.run(["rm", "-rf", run])
        t = time.time()
        subprocess.run([".venv/bin/laminar", "train", cfg], capture_output=True, check=True)
        wall = time.time() - t
        rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if '"kind": "step"' in l]
        tps = statistics.median(r["throughput_tokens_per_s"] for r in rows if r.get("throughput_tokens_per_s"))
        res[durable].append((wall, tps))
        print(durable, rep, round(wall, 1), round(tps), flush=True)
for d in (True, False):
    print(d, "wall median", statistics.median(w for w, _ in res[d]), "tok/s median", statistics.median(t for _, t in res[d]))
