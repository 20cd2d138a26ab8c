"""`laminar bench modes`: the five schedules side by side, plus TRL's GRPOTrainer for reference.

Same model (the cached SFT warm start of the tiny preset), data, seeds, rollout workers, global
batch and number of trained samples for every mode, with the emulated environment latency on.
Reported per mode: training throughput (the paper's metric, averaged after warm-up), time to a
target reward, the staleness histogram and the reward-vs-wall-clock curve.

    laminar bench modes [--quick] [--out FILE]

JSON keys: throughput_by_mode (tokens/s, with `trl`), ratio_laminar_vs (per mode and `trl`),
staleness_hist_by_mode, reward_curve_by_mode, plus time_to_target_s_by_mode and the workload.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from laminar.config import MODES, Config, load_config
from laminar.metrics import read_metrics

# The workload, the same for every schedule. Lengths follow the reverse task's default long
# tail (p99/p50 ~ 10); each trajectory also waits on an emulated tool call (log-normal latency).
WORKLOAD = [
    "model.preset=tiny", "rollout.num_workers=2", "cluster.virtual_nodes=2",
    "rollout.group_size=8", "rollout.batch_groups=4", "rollout.max_new_tokens=80",
    "rollout.engine.max_batch_size=64", "rollout.engine.kv_capacity_tokens=4096",
    "rollout.env_latency.enabled=true", "rollout.env_latency.median_s=0.15",
    "rollout.env_latency.sigma=1.0", "rollout.env_latency.max_s=3.0",
    "trainer.prompts_per_step=32", "trainer.mini_batches=2", "trainer.lr=5e-4",
    "trainer.threads=1", "rollout.threads=1",
]
# The policy objective of each schedule (trainer.old_logprobs), as in the paper's Table 3:
# GRPO against the engine's log-probs, except partial rollout, whose trajectories mix weight
# versions: AReaL trains them with decoupled PPO, which recomputes proximal log-probs (one
# more forward pass per token). `--set trainer.old_logprobs=rollout` gives partial the same
# loss as the others: the schedules alone.
REFERENCE_OLD_LOGPROBS = {"laminar": "rollout", "sync": "rollout", "one_step": "rollout",
                          "stream": "rollout", "partial": "decoupled"}
WARMUP_STEPS = 3  # the first updates include actor start-up and the first batch's fill


def bench_config(mode: str, steps: int, run_dir: Path, overrides: list[str] = ()) -> Config:
    algorithm = [f"trainer.old_logprobs={REFERENCE_OLD_LOGPROBS[mode]}"]
    return load_config(None, WORKLOAD + algorithm + list(overrides) + [
        f"mode={mode}", f"trainer.total_steps={steps}", f"run_dir={run_dir}", f"name=bench-{mode}"])


def throughput(rows: list[dict[str, Any]]) -> float:
    """(prompt + response tokens of the global batches) / (time between their updates), after
    warm-up: the paper's training throughput."""
    tail = [r for r in rows[WARMUP_STEPS:] if r.get("update_interval_s")]
    return sum(r["batch_tokens"] for r in tail) / sum(r["update_interval_s"] for r in tail)


BREAKDOWN = ("update_interval_s", "train_s", "trainer_idle_frac", "rollout_idle_frac",
             "gen_tokens_per_s", "push_stall_s", "pull_latency_s", "kv_util_mean")


def breakdown(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Where the time goes: means over the steps after warm-up."""
    tail = rows[WARMUP_STEPS:]
    out: dict[str, float | None] = {}
    for key in BREAKDOWN:
        values = [r[key] for r in tail if r.get(key) is not None]
        out[key] = float(np.mean(values)) if values else None
    out["repacks"] = rows[-1].get("repacks", 0)
    return out


def reward_curve(rows: list[dict[str, Any]], window: int = 10) -> list[tuple[float, float]]:
    """(seconds since the first update, moving-average training reward)."""
    t0 = rows[0]["time"]
    rewards = [r["reward"] for r in rows]
    return [(round(r["time"] - t0, 3), float(np.mean(rewards[max(0, i - window + 1):i + 1])))
            for i, r in enumerate(rows)]


def time_to(curve: list[tuple[float, float]], target: float, window: int = 10) -> float | None:
    """First time the moving average (over a full window) reaches `target`."""
    return next((t for t, r in curve[window - 1:] if r >= target), None)


def reward_at(curve: list[tuple[float, float]], seconds: float) -> float:
    """The moving-average reward a run had reached `seconds` after its first update."""
    reached = [r for t, r in curve if t <= seconds]
    return reached[-1] if reached else curve[0][1]


def run_mode(mode: str, steps: int, root: Path, overrides: list[str] = ()) -> dict[str, Any]:
    from laminar.bench.cpu import CpuMeter
    from laminar.modes import run_training

    cfg = bench_config(mode, steps, root / mode, overrides)
    t0 = time.perf_counter()
    with CpuMeter() as cpu:
        run_training(cfg)
    rows = read_metrics(cfg.resolved_run_dir)
    hist: Counter = Counter()
    for r in rows:
        hist.update({int(k): v for k, v in r["staleness_hist"].items()})
    return {"throughput": throughput(rows), "curve": reward_curve(rows),
            "staleness": dict(sorted(hist.items())), "wall_s": time.perf_counter() - t0,
            "breakdown": breakdown(rows), "old_logprobs": cfg.trainer.old_logprobs,
            "cpu": {"wall_s": round(cpu.wall_s, 1), "seconds": cpu.seconds,
                    "per_trained_ktoken": round(sum(cpu.seconds.values()) * 1000
                                                / sum(r["batch_tokens"] for r in rows), 3)}}


def run_trl(steps: int, root: Path, overrides: list[str] = ()) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same warm-started model, tokenizer, prompts, reward and batch."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from laminar.models import load_pretrained
    from laminar.tasks import build_task
    from laminar.tasks.rewards import similarity_reward
    from laminar.trainer.sft import run_sft

    cfg = bench_config("sync", steps, root / "trl", overrides)
    torch.set_num_threads(2)  # one process: TRL gets both cores
    model, tokenizer = load_pretrained(run_sft(cfg))
    task = build_task(cfg.task)
    bos = tokenizer.bos_token
    data = Dataset.from_list([{"prompt": bos + it.prompt, "answer": it.answer} for it in task.train])

    env = cfg.rollout.env_latency
    rng = np.random.default_rng(cfg.trainer.seed)

    def reward(completions, answer, **_):
        # the same emulated tool call per completion; a synchronous batch waits for its slowest
        if env.enabled:
            calls = env.median_s * np.exp(env.sigma * rng.standard_normal(len(completions)))
            time.sleep(float(np.minimum(calls, env.max_s).max()))
        return [similarity_reward("", c, a) for c, a in zip(completions, answer)]

    stamps: list[tuple[float, float, float]] = []  # (time, cumulative tokens, reward)

    class Clock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "num_tokens" in logs:
                stamps.append((time.perf_counter(), float(logs["num_tokens"]), float(logs.get("reward", 0))))

    group, prompts = cfg.rollout.group_size, cfg.trainer.prompts_per_step
    args = GRPOConfig(
        output_dir=str(root / "trl"), use_cpu=True, bf16=False, seed=cfg.trainer.seed,
        per_device_train_batch_size=group * prompts // cfg.trainer.mini_batches,
        steps_per_generation=cfg.trainer.mini_batches, num_generations=group,
        max_completion_length=cfg.rollout.max_new_tokens, temperature=1.0, top_k=0, top_p=1.0,
        learning_rate=cfg.trainer.lr, lr_scheduler_type="constant", beta=0.0, epsilon=0.2,
        epsilon_high=0.28, loss_type="dapo", max_steps=steps * cfg.trainer.mini_batches,
        logging_steps=cfg.trainer.mini_batches, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Clock()])
    t0 = time.perf_counter()
    trainer.train()
    tail = stamps[WARMUP_STEPS:]
    tokens_per_s = (tail[-1][1] - tail[0][1]) / (tail[-1][0] - tail[0][0])
    curve = [(round(t - stamps[0][0], 3), r) for t, _, r in stamps]
    return {"throughput": tokens_per_s, "curve": curve, "staleness": {0: len(stamps) * prompts * group},
            "wall_s": time.perf_counter() - t0}


def parse_modes(modes: str | None) -> list[str]:
    chosen = list(MODES) + ["trl"] if not modes else [m.strip() for m in modes.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in (*MODES, "trl")]
    if unknown or "laminar" not in chosen:
        from laminar.config import ConfigError

        raise ConfigError(f"--modes {modes!r}: {'unknown ' + ', '.join(unknown) if unknown else 'no laminar'}; "
                          f"pick from {', '.join((*MODES, 'trl'))}, laminar included (ratios are "
                          "laminar / mode)")
    return chosen


def main(quick: bool = False, out: str | None = None, modes: str | None = None,
         steps: int | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    import ray
    from rich.console import Console
    from rich.table import Table

    chosen = parse_modes(modes)
    overrides = list(overrides or [])
    bench_config("laminar", 1, Path("/tmp"), overrides)  # a bad --set fails before anything runs
    steps = steps or (8 if quick else 40)
    root = Path(tempfile.mkdtemp(prefix="laminar-bench-modes-"))
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        results = {mode: run_mode(mode, steps, root, overrides) for mode in MODES if mode in chosen}
    finally:
        ray.shutdown()
    if "trl" in chosen:
        results["trl"] = run_trl(steps, root, overrides)

    # target: the reward on-policy sync ends with (10-step moving average); who gets there first?
    # (without sync in the run: laminar's own final reward)
    reference = results["sync" if "sync" in results else "laminar"]["curve"][-1]
    sync_end_s, target = reference
    tput = {m: r["throughput"] for m, r in results.items()}
    report = {
        "workload": WORKLOAD + overrides, "steps": steps, "quick": quick,
        "old_logprobs_by_mode": {m: r["old_logprobs"] for m, r in results.items()
                                 if "old_logprobs" in r},
        "throughput_by_mode": tput,
        "ratio_laminar_vs": {m: tput["laminar"] / v for m, v in tput.items() if m != "laminar"},
        "staleness_hist_by_mode": {m: r["staleness"] for m, r in results.items()},
        "reward_curve_by_mode": {m: r["curve"] for m, r in results.items()},
        "target_reward": target,
        "time_to_target_s_by_mode": {m: time_to(r["curve"], target) for m, r in results.items()},
        "reward_at_sync_end_by_mode": {m: reward_at(r["curve"], sync_end_s) for m, r in results.items()},
        "wall_s_by_mode": {m: r["wall_s"] for m, r in results.items()},
        "breakdown_by_mode": {m: r["breakdown"] for m, r in results.items() if "breakdown" in r},
        "cpu_by_mode": {m: r["cpu"] for m, r in results.items() if "cpu" in r},
    }
    table = Table(title=f"laminar bench modes ({steps} steps, env latency on)")
    for col in ("mode", "tok/s", "laminar/mode", f"time to {target:.3f}",
                f"reward at {sync_end_s:.0f}s", "staleness histogram"):
        table.add_column(col)
    for m in results:
        ttt = report["time_to_target_s_by_mode"][m]
        table.add_row(m, f"{tput[m]:.0f}", "-" if m == "laminar" else f"{report['ratio_laminar_vs'][m]:.2f}x",
                      f"{ttt:.1f}s" if ttt is not None else "not reached",
                      f"{report['reward_at_sync_end_by_mode'][m]:.3f}",
                      " ".join(f"{k}:{v}" for k, v in report["staleness_hist_by_mode"][m].items()))
    console = Console(width=150)
    console.print(table)
    detail = Table(title="where the time goes (means after warm-up)")
    for col in ("mode", "step s", "train s", "trainer idle", "rollout idle", "gen tok/s",
                "push stall s", "pull s", "KV util", "repacks"):
        detail.add_column(col)
    for m, b in report["breakdown_by_mode"].items():
        detail.add_row(m, *("-" if b[k] is None else f"{b[k]:.3g}" for k in (*BREAKDOWN, "repacks")))
    console.print(detail)
    cpu = Table(title="where the CPU goes (CPU seconds over each mode's whole run)")
    parts = ("TrainerActor", "RolloutActor", "PromptPool", "ExperienceBuffer", "PartialPool",
             "ManagerActor", "Relay", "driver", "ray daemons")
    for col in ("mode", "wall s", *parts, "CPU s per 1k trained tokens"):
        cpu.add_column(col)
    for m, c in report["cpu_by_mode"].items():
        cpu.add_row(m, f"{c['wall_s']:.0f}", *(f"{c['seconds'].get(p, 0):.1f}" for p in parts),
                    f"{c['per_trained_ktoken']:.3f}")
    console.print(cpu)
    if out:
        Path(out).write_text(json.dumps(report, indent=2))
        print(f"wrote {out}")
        from laminar.report import bench_html_path, write_bench_html

        print(f"wrote {write_bench_html(report, bench_html_path(out))}")
    return report
