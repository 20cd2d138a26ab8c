"""This machine measured for the simulator: a calibration file's `local` block.

    python -m laminar.bench.calibrate --out cal.json [--steps 6] [--measured bench-modes.json]

Runs `laminar bench engine --quick` (the decode curve) and a short sync training with
`laminar bench modes`' workload (the trainer's cost, the lengths), and writes a calibration file
for `laminar simulate --calibration` (laminar/sim/local.py reads it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from laminar.bench import engine as bench_engine
from laminar.bench.modes import bench_config
from laminar.modes import run_training
from laminar.sim.local import block_from_run


def measure(out: Path, steps: int, measured: str | None) -> dict[str, Any]:
    """Run `laminar bench engine --quick` and a short sync training with `laminar bench
    modes`' workload, and write a calibration file for `laminar simulate --calibration`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    engine_json = out.with_name(out.stem + "-engine.json")
    bench_engine.main(quick=True, out=str(engine_json))
    run_dir = out.with_name(out.stem + "-run")
    cfg = bench_config("sync", steps, run_dir)
    run_training(cfg)  # starts (and stops) its own embedded cluster
    block = block_from_run(cfg.resolved_run_dir, engine_json, cfg)
    if measured:
        block["measured"] = measured
    ro = cfg.rollout
    share = ro.batch_groups * ro.num_workers / cfg.trainer.prompts_per_step
    data = {"local": block, "inflight_batches": share, "partial_inflight_batches": share,
            "max_outstanding_batches": float(ro.max_outstanding_batches),
            "version_lag": ro.version_lag,
            "stream_minibatches": True}  # the runtime's free-running trainers always stream
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description="Measure this machine for the simulator.")
    ap.add_argument("--out", required=True, help="calibration JSON to write")
    ap.add_argument("--steps", type=int, default=6, help="sync training steps to time")
    ap.add_argument("--measured", help="`laminar bench modes` JSON to compare against")
    args = ap.parse_args()
    measure(Path(args.out), args.steps, args.measured)


if __name__ == "__main__":
    main()
