"""The simulator on a machine that is not the paper's testbed: parameters measured here.

A calibration file's `local` block describes the setup (every key optional except the decode
curve; defaults mirror laminar's default config on a CPU box):

    {"local": {
        "decode_latency_ms_by_batch": {"1": 9.0, "8": 11.0, "32": 19.0},  # or:
        "engine_bench": "runs/bench-engine.json",   # JSON of `laminar bench engine`
        "kv_capacity_tokens": 16384, "max_running": 64, "prefill_ms_per_token": 0.05,
        "trainer_s_per_token": 2e-4, "trainer_step_overhead_s": 0.2,
        "lengths": {"0.5": 20, "0.9": 45, "0.99": 70, "1.0": 80},
        "prompt_median": 8, "prompt_sigma": 0.6,
        "rollout_workers": 2, "prompts": 16, "samples": 8, "minibatches": 1,
        "sync_s": 0.05, "push_s": 0.02, "broadcast_s": 0.02, "pull_s": 0.02,
        "env_median_s": 0.15, "env_sigma": 1.0, "env_max_s": 3.0,   # reward sandbox latency
        "measured": "runs/bench-modes.json"          # optional: `laminar bench modes` JSON
    }}

`local_setup` turns it into a `Setup`; `measured_throughput` reads the measured mode
throughputs to compare the predicted ratios with. `python -m laminar.sim.local --out FILE`
measures this machine (engine benchmark + a short sync training with `laminar bench modes`'
workload) and writes such a file (`measure`, `block_from_run`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from laminar.metrics import read_metrics
from laminar.sim import paper
from laminar.sim.calibration import Calibration
from laminar.sim.core import Setup
from laminar.sim.costs import DecodeCurve
from laminar.sim.workload import LengthDistribution
from laminar.types import GLOBAL_BATCH_MODES

DEFAULTS: dict[str, Any] = dict(
    kv_capacity_tokens=16384, max_running=64, prefill_ms_per_token=0.05,
    trainer_s_per_token=2e-4, trainer_step_overhead_s=0.2,
    lengths={"0.5": 20, "0.9": 45, "0.99": 70, "1.0": 80}, prompt_median=8.0, prompt_sigma=0.6,
    rollout_workers=2, prompts=16, samples=8, minibatches=1,
    sync_s=0.05, push_s=0.02, broadcast_s=0.02, pull_s=0.02, controller_s_per_token=0.0,
    env_median_s=0.0, env_sigma=1.0, env_max_s=float("inf"))
KEYS = set(DEFAULTS) | {"decode_latency_ms_by_batch", "engine_bench", "measured"}


def fit_decode(ms_by_batch: dict[Any, float]) -> DecodeCurve:
    """Least-squares line ms = a + b * batch through a measured decode curve."""
    pts = sorted((int(b), float(ms)) for b, ms in ms_by_batch.items())
    if len(pts) < 2:
        raise ValueError(f"decode_latency_ms_by_batch needs >= 2 batch sizes, got {pts}")
    b, ms = np.array(pts, dtype=float).T
    slope, base = np.polyfit(b, ms, 1)
    return DecodeCurve(base_s=max(base, 1e-6) / 1e3, per_seq_s=max(slope, 0.0) / 1e3,
                       per_kv_s=0.0)


def _read_json(path: str | Path, key: str) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if key not in data:
        raise ValueError(f"{path}: no {key!r} key; is it the right benchmark's JSON?")
    return data[key]


def local_setup(mode: str, local: dict[str, Any], cal: Calibration, seed: int = 0) -> Setup:
    unknown = sorted(set(local) - KEYS)
    if unknown:
        raise ValueError(f"calibration 'local' block: unknown keys {unknown}; allowed: "
                         f"{sorted(KEYS)}")
    cfg = {**DEFAULTS, **local}
    if "decode_latency_ms_by_batch" in cfg:
        curve = fit_decode(cfg["decode_latency_ms_by_batch"])
    elif "engine_bench" in cfg:
        curve = fit_decode(_read_json(cfg["engine_bench"], "decode_latency_ms_by_batch"))
    else:
        raise ValueError("calibration 'local' block needs decode_latency_ms_by_batch or "
                         "engine_bench (the JSON of `laminar bench engine`)")
    s_tok, step_s = cfg["trainer_s_per_token"], cfg["trainer_step_overhead_s"]
    workers = int(cfg["rollout_workers"])
    # Responses of tens of tokens: simulate every decode step (quantum 1).
    cal = cal.with_overrides(prompt_median=float(cfg["prompt_median"]),
                             prompt_sigma=float(cfg["prompt_sigma"]), decode_quantum=1,
                             env_median_s=float(cfg["env_median_s"]),
                             env_sigma=float(cfg["env_sigma"]), env_max_s=float(cfg["env_max_s"]))
    lengths = {float(q): float(v) for q, v in cfg["lengths"].items()}
    return Setup(
        mode=mode, model="local", gpus=workers + 1, trainer_gpus=1, rollout_gpus=workers, tp=1,
        cal=cal, curve=curve, kv_capacity=int(cfg["kv_capacity_tokens"]),
        prefill_tok_s=cfg["prefill_ms_per_token"] / 1e3, prefill_sq_s=0.0,
        train_fn=lambda tok, sq, steps, g: tok * s_tok + steps * step_s,
        sync_s=cfg["sync_s"], push_s=cfg["push_s"], broadcast_s=cfg["broadcast_s"],
        pull_s=cfg["pull_s"],
        controller_s_per_token=(cfg["controller_s_per_token"]
                                if mode in GLOBAL_BATCH_MODES else 0.0),
        update_overhead_s=0.0,  # measured trainer time already includes it
        lengths=LengthDistribution.from_points(lengths, min_len=1, max_len=int(max(lengths.values()))),
        prompts=int(cfg["prompts"]), samples=int(cfg["samples"]),
        minibatches=int(cfg["minibatches"]), max_running=int(cfg["max_running"]), seed=seed)


def measured_throughput(local: dict[str, Any]) -> dict[str, float] | None:
    """`throughput_by_mode` of a `laminar bench modes` run, if the block names one."""
    if "measured" not in local:
        return None
    out = _read_json(local["measured"], "throughput_by_mode")
    return {m: float(v) for m, v in out.items() if m in paper.MODES}


# --- measuring this machine ----------------------------------------------------------------

def block_from_run(run_dir: Path, engine_json: Path, cfg: Any, warmup: int = 2) -> dict[str, Any]:
    """A `local` block from a finished run (metrics.jsonl, trajectories.jsonl), the engine
    benchmark's JSON, and the run's config (worker counts, batch, KV, environment latency)."""
    rows = read_metrics(run_dir)
    trajs = [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines() if x]
    tail = rows[warmup:] or rows
    lens = np.array([t["response_len"] for t in trajs], dtype=float)
    n_trajs = len(trajs)
    prompt_tokens = sum(r["batch_tokens"] - r["response_tokens"] for r in rows)
    ro, tr, env = cfg.rollout, cfg.trainer, cfg.bench.env_latency
    return {
        "engine_bench": str(engine_json),
        "kv_capacity_tokens": ro.engine.kv_capacity_tokens,
        "max_running": ro.engine.max_batch_size,
        "trainer_s_per_token": sum(r["train_s"] for r in tail) / sum(r["batch_tokens"] for r in tail),
        "trainer_step_overhead_s": 0.0,
        "lengths": {str(q): float(np.quantile(lens, q)) for q in (0.5, 0.9, 0.99)}
        | {"1.0": float(lens.max())},
        "prompt_median": prompt_tokens / n_trajs, "prompt_sigma": 0.0,
        "rollout_workers": ro.num_workers, "prompts": tr.prompts_per_step,
        "samples": ro.group_size, "minibatches": tr.mini_batches,
        "env_median_s": env.median_s if env.enabled else 0.0,
        "env_sigma": env.sigma, "env_max_s": env.max_s,
    }


def measure(out: Path, steps: int, measured: str | None) -> dict[str, Any]:
    """Run `laminar bench engine --quick` and a short sync training with `laminar bench
    modes`' workload, and write a calibration file for `laminar simulate --calibration`."""
    from laminar.bench import engine as bench_engine
    from laminar.bench.modes import bench_config
    from laminar.modes import run_training

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
    import argparse

    ap = argparse.ArgumentParser(description="Measure this machine for the simulator.")
    ap.add_argument("--out", required=True, help="calibration JSON to write")
    ap.add_argument("--steps", type=int, default=6, help="sync training steps to time")
    ap.add_argument("--measured", help="`laminar bench modes` JSON to compare against")
    args = ap.parse_args()
    measure(Path(args.out), args.steps, args.measured)


if __name__ == "__main__":
    main()
