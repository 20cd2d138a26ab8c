"""`laminar bench modes`: the five schedules side by side as an experiment, plus TRL's
GRPOTrainer for reference.

Same model (the cached SFT warm start of the tiny preset), data, seeds, rollout workers, global
batch and number of trained samples for every mode. The headline is learning against the
wall clock: every mode scores the same held-out prompts greedily on the same wall-clock
schedule (`trainer.eval_every_s`), and the benchmark reports when each first reaches a target
fixed by rule before the run: the warm start's score plus 90% of sync's final gain
(laminar/bench/learning.py). Training tokens/s stands beside it.

    laminar bench modes [--task reverse|calc|reasoning_gym] [--quick] [--repeats N] [--no-control]
                        [--out FILE]

`--task calc` races the schedules on the built-in agentic task instead (CALC_WORKLOAD): real
multi-turn episodes whose Python tool calls run in the sandbox, so the environment latency is
measured, not emulated, and there is no env-latency-off control. Its JSON adds the environment
call latencies and turns per episode over every run (env_latency_p50_s, env_latency_p99_s,
turns_p50, turns_p99). `--task reasoning_gym` runs examples/reasoning-gym.yaml's task the same
way (reasoning-gym's generators and scorers; one-turn episodes, no tool latency).

Each mode runs `--repeats` times (3; the modes' order rotates every repeat) with the emulated
environment latency on, then the same again with it off (the control: what asynchrony gives
without tool latency). Ratios are paired per repeat and reported as median and min-max.

JSON keys (docs/performance.md): heldout_by_mode, heldout_start, heldout_target,
time_to_heldout_target_s_by_mode, repeats, ratio_laminar_vs (medians), ratio_laminar_vs_range,
throughput_by_mode, run_wall_s_per_update_by_mode (the whole run, start to exit, per update),
control_env_latency_off, trl, provenance; and, per mode and repeat,
everything measured (`runs`).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from laminar.bench import learning, trl
from laminar.bench.modes_tables import fmt, print_tables
from laminar.bench.cpu import CpuMeter
from laminar.config import Config, ConfigError, load_config
from laminar.devices import PINNED, cpu_affinity, leave_trainer_cores, restore_cores
from laminar.metrics import read_metrics, read_rows
from laminar.modes import run_training
from laminar.modes.common import start_weights
from laminar.provenance import provenance, versions
from laminar.runtime import ray_env_defaults
from laminar.report import bench_html_path, write_bench_html
from laminar.types import MODES

# The workload, the same for every schedule. Lengths follow the reverse task's default long
# tail (p99/p50 ~ 10); each trajectory also waits on an emulated tool call (log-normal latency).
# The reward is exact match, what the held-out score measures. The warm start (450 SFT steps,
# not capped by time, so every machine starts from the same model) reverses strings of up to 3
# characters, gets 4-10 right a quarter to a third of the time greedily but three times in four
# within 8 samples, and longer ones hardly ever: room for RL to learn (docs/performance.md).
WORKLOAD = [
    "model.preset=tiny", "rollout.num_workers=2", "cluster.virtual_nodes=2",
    "rollout.group_size=8", "rollout.batch_groups=4", "rollout.max_new_tokens=80",
    "rollout.engine.max_batch_size=64", "rollout.engine.kv_capacity_tokens=4096",
    "bench.env_latency.enabled=true", "bench.env_latency.median_s=0.15",
    "bench.env_latency.sigma=1.0", "bench.env_latency.max_s=3.0",
    "task.reward=laminar.tasks.rewards:exact_match_reward", "task.eval_prompts=256",
    "sft.steps=450", "sft.max_seconds=3600",
    "trainer.prompts_per_step=32", "trainer.mini_batches=4", "trainer.lr=1e-4",
    "trainer.threads=1", "rollout.threads=1",
    "trainer.eval_every=0", "trainer.eval_every_s=5", "trainer.checkpoint_every=0",
    "metrics.tensorboard=false", "metrics.live=off",
]
CONTROL = ["bench.env_latency.enabled=false"]  # the control: no tool latency
# The agentic workload (`--task calc`): the same shape of job on the calc task (examples/
# calc.yaml), whose tool calls run real programs in the sandbox; no emulated latency.
CALC_WORKLOAD = [
    "model.preset=tiny", "rollout.num_workers=2", "cluster.virtual_nodes=2",
    "task.name=calc", "task.max_turns=3", "task.eval_prompts=128", "task.env_timeout_s=120",
    "rollout.group_size=8", "rollout.batch_groups=4", "rollout.max_new_tokens=160",
    "rollout.engine.max_batch_size=64", "rollout.engine.kv_capacity_tokens=12288",
    "sft.steps=400", "sft.max_seconds=600",  # examples/calc.yaml's warm start (cached once)
    "trainer.prompts_per_step=32", "trainer.mini_batches=4", "trainer.lr=1e-4",
    "trainer.threads=1", "rollout.threads=1",
    # evaluations run episodes through the same sandbox: every 60 s, not 10, so they do not
    # take most of its capacity
    "trainer.eval_every=0", "trainer.eval_every_s=60", "trainer.checkpoint_every=0",
    "metrics.tensorboard=false", "metrics.live=off",
]
# reasoning-gym's generators (`--task reasoning_gym`, needs the tasks extra): examples/
# reasoning-gym.yaml's task and warm start (cached once), one-turn episodes scored by the
# generators' own score_answer; no emulated latency.
REASONING_GYM_WORKLOAD = [
    "model.preset=tiny", "rollout.num_workers=2", "cluster.virtual_nodes=2",
    "task.name=reasoning_gym", "task.eval_prompts=128", "task.reasoning_gym.size=4096",
    "task.reasoning_gym.datasets=[{name: spell_backward, weight: 3, config: {min_word_len: 3, "
    "max_word_len: 6}}, {name: chain_sum, weight: 1, config: {min_terms: 2, max_terms: 3, "
    "min_digits: 1, max_digits: 1}}]",
    "rollout.group_size=8", "rollout.batch_groups=4", "rollout.max_new_tokens=12",
    "rollout.engine.max_batch_size=64", "rollout.engine.kv_capacity_tokens=4096",
    "sft.steps=400", "sft.max_seconds=600",
    "trainer.prompts_per_step=32", "trainer.mini_batches=4", "trainer.lr=1e-4",
    "trainer.threads=1", "rollout.threads=1",
    "trainer.eval_every=0", "trainer.eval_every_s=10", "trainer.checkpoint_every=0",
    "metrics.tensorboard=false", "metrics.live=off",
]
WORKLOADS = {"reverse": WORKLOAD, "calc": CALC_WORKLOAD, "reasoning_gym": REASONING_GYM_WORKLOAD}
STEPS, QUICK_STEPS = 80, 12
# Sync trains `steps` and so sets the held-out target; every other schedule may train this many
# times as many, so that a schedule whose stale samples teach a little less per step still has
# room to reach the target (time to it is what is compared; tokens/s is per step either way).
RACE = 1.25
# The control (env latency off) runs the pair the question is about (laminar against sync) and
# the strongest baseline (partial); one_step and stream only in the main runs.
CONTROL_MODES = ("laminar", "sync", "partial")
# The policy objective of each schedule (trainer.correction), as in the paper's Table 3:
# GRPO against the engine's log-probs, except partial rollout, whose trajectories mix weight
# versions: AReaL trains them with decoupled PPO, which recomputes proximal log-probs (one
# more forward pass per token). `--set trainer.correction=none` gives partial the same
# loss as the others: the schedules alone.
REFERENCE_CORRECTION = {"laminar": "none", "sync": "none", "one_step": "none", "stream": "none",
                        "partial": "decoupled"}
WARMUP_STEPS = 3  # the first updates include actor start-up and the first batch's fill
TRL_STEPS = 20  # TRL is timed, not raced to the target: tokens/s after warm-up


def bench_config(mode: str, steps: int, run_dir: Path, overrides: list[str] = (),
                 task: str = "reverse") -> Config:
    algorithm = [f"trainer.correction.kind={REFERENCE_CORRECTION[mode]}"]
    return load_config(None, WORKLOADS[task] + algorithm + list(overrides) + [
        f"mode={mode}", f"trainer.total_steps={steps}", f"run_dir={run_dir}", f"name=bench-{mode}"])


def throughput(rows: list[dict[str, Any]]) -> float:
    """(prompt + response tokens of the global batches) / (time between their updates), after
    warm-up: the paper's training throughput."""
    tail = [r for r in rows[WARMUP_STEPS:] if r.get("update_interval_s")]
    return sum(r["batch_tokens"] for r in tail) / sum(r["update_interval_s"] for r in tail)


BREAKDOWN = ("update_interval_s", "train_s", "trainer_idle_frac", "rollout_idle_frac",
             "rollout_drain_idle_frac", "gen_tokens_per_s", "push_stall_s", "pull_latency_s", "kv_util_mean")


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
    """(seconds since the rollouts started, moving-average training reward)."""
    rewards = [r["reward"] for r in rows]
    return [(round(r["time"], 3), float(np.mean(rewards[max(0, i - window + 1):i + 1])))
            for i, r in enumerate(rows)]


def mode_steps(mode: str, steps: int) -> int:
    """Trainer steps of `mode` in a benchmark of `steps` (RACE)."""
    return steps if mode == "sync" else round(steps * RACE)


def run_mode(mode: str, steps: int, root: Path, overrides: list[str] = (),
             task: str = "reverse", metric: str = "greedy_exact_match") -> dict[str, Any]:
    """One training run of `mode` (mode_steps of `steps`); everything the benchmark reports."""
    steps = mode_steps(mode, steps)
    cfg = bench_config(mode, steps, root / mode, overrides, task)
    # the warm start (SFT, cached once) before the clock and the CPU meter start: otherwise the
    # first schedule measured pays for it (it once put ~130 CPU s of SFT in laminar's "driver")
    start_weights(cfg)
    t0 = time.perf_counter()
    with CpuMeter() as cpu:
        run_training(cfg)
    rows = read_metrics(cfg.resolved_run_dir)
    hist: Counter = Counter()
    for r in rows:
        hist.update({int(k): v for k, v in r["staleness_hist"].items()})
    curve = learning.heldout_curve(read_rows(cfg.resolved_run_dir), metric)
    return {"throughput": throughput(rows), "heldout": curve, "reward_curve": reward_curve(rows),
            "heldout_start": curve[0][2] if curve and curve[0][1] == 0 else None,
            "heldout_final": curve[-1][2] if curve and curve[-1][1] == steps else None,
            "steps": steps, "train_wall_s": rows[-1]["time"], "staleness": dict(sorted(hist.items())),
            "wall_s": round(time.perf_counter() - t0, 1), "breakdown": breakdown(rows),
            "old_logprobs": cfg.trainer.old_logprobs, "correction": cfg.trainer.correction.kind,
            "env_latency_s": [x for r in rows for x in r.get("env_latency_s") or []],
            "turns": [x for r in rows for x in r.get("turns") or []],
            "cpu": {"wall_s": round(cpu.wall_s, 1), "seconds": cpu.seconds,
                    "machine_s": cpu.machine_s, "rest_s": cpu.rest_s,
                    "per_trained_ktoken": round(sum(cpu.seconds.values()) * 1000
                                                / sum(r["batch_tokens"] for r in rows), 3)}}


def parse_modes(modes: str | None) -> list[str]:
    chosen = list(MODES) + ["trl"] if not modes else [m.strip() for m in modes.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in (*MODES, "trl")]
    if unknown or "laminar" not in chosen:
        raise ConfigError(f"--modes {modes!r}: {'unknown ' + ', '.join(unknown) if unknown else 'no laminar'}; "
                          f"pick from {', '.join((*MODES, 'trl'))}, laminar included (ratios are "
                          "laminar / mode)")
    return chosen


def rotated(modes: list[str], repeat: int) -> list[str]:
    """The order of repeat `repeat`: rotated by one each time, so no mode always runs first
    (with the one-time imports) or last (after the machine has warmed up)."""
    k = repeat % len(modes) if modes else 0
    return modes[k:] + modes[:k]


def run_condition(modes: list[str], steps: int, repeats: int, root: Path,
                  overrides: list[str], label: str,
                  task: str = "reverse") -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for r in range(repeats):
        for m in rotated(modes, r):
            print(f"bench modes: {label}, repeat {r + 1}/{repeats}, {m} ...", flush=True)
            runs[m].append(run_mode(m, steps, root / f"{label}-{r}", overrides, task))
            res = runs[m][-1]
            print(f"  {m}: {res['throughput']:.0f} tok/s, held-out "
                  f"{fmt(res['heldout_start'])} -> {fmt(res['heldout_final'])} in "
                  f"{res['train_wall_s']:.0f} s", flush=True)
    return runs


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians, ranges, the held-out target and who reached it when, over one condition's runs."""
    tput = {m: [r["throughput"] for r in rs] for m, rs in runs.items()}
    others = [m for m in runs if m != "laminar"]
    paired = {m: learning.paired_ratios(tput["laminar"], tput[m]) for m in others}
    starts = [r["heldout_start"] for rs in runs.values() for r in rs if r["heldout_start"] is not None]
    start = float(np.median(starts)) if starts else None
    sync_finals = [r["heldout_final"] for r in runs.get("sync", []) if r["heldout_final"] is not None]
    target = learning.heldout_target(start, sync_finals) if start is not None and sync_finals else None
    ttt = {m: [learning.time_to_target(r["heldout"], target) if target is not None else None
               for r in rs] for m, rs in runs.items()}
    ttt_median = {m: learning.median_or_none(v) for m, v in ttt.items()}
    lam = ttt_median.get("laminar")
    latency = [x for rs in runs.values() for r in rs for x in r.get("env_latency_s", [])]
    turns = [x for rs in runs.values() for r in rs for x in r.get("turns", [])]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    return {
        "env_latency_p50_s": pct(latency, 50), "env_latency_p99_s": pct(latency, 99),
        "turns_p50": pct(turns, 50), "turns_p99": pct(turns, 99),
        "throughput_by_mode": {m: float(np.median(v)) for m, v in tput.items()},
        "throughput_by_mode_runs": tput,
        "ratio_laminar_vs": {m: float(np.median(v)) for m, v in paired.items() if v},
        "ratio_laminar_vs_range": {m: [min(v), max(v)] for m, v in paired.items() if v},
        "heldout_start": start,
        "heldout_final_by_mode": {m: learning.summary([r["heldout_final"] for r in rs
                                                       if r["heldout_final"] is not None])
                                  for m, rs in runs.items()},
        "sync_heldout_gain": (float(np.median(sync_finals)) - start)
        if start is not None and sync_finals else None,
        "heldout_target": target,
        "heldout_target_note": learning.NO_GAIN if start is not None and sync_finals
        and target is None else None,
        "time_to_heldout_target_s_by_mode": ttt_median,
        "time_to_heldout_target_s_runs": ttt,
        "heldout_speedup_laminar_vs": {m: v / lam for m, v in ttt_median.items()
                                       if m != "laminar" and v is not None and lam},
        "heldout_by_mode": {m: _median_run(rs, ttt[m])["heldout"] for m, rs in runs.items()},
        "heldout_by_mode_runs": {m: [r["heldout"] for r in rs] for m, rs in runs.items()},
        "staleness_hist_by_mode": {m: rs[0]["staleness"] for m, rs in runs.items()},
        "reward_curve_by_mode": {m: rs[0]["reward_curve"] for m, rs in runs.items()},
        "train_wall_s_by_mode": {m: [r["train_wall_s"] for r in rs] for m, rs in runs.items()},
        # what a user waits for: the whole run (start to exit) per update, medians
        "run_wall_s_per_update_by_mode": {m: float(np.median([r["wall_s"] / r["steps"] for r in rs]))
                                          for m, rs in runs.items()},
        "breakdown_by_mode": {m: rs[0]["breakdown"] for m, rs in runs.items()},
        "cpu_by_mode": {m: rs[0]["cpu"] for m, rs in runs.items()},
        "old_logprobs_by_mode": {m: rs[0]["old_logprobs"] for m, rs in runs.items()},
        "correction_by_mode": {m: rs[0]["correction"] for m, rs in runs.items()},
    }


def _median_run(runs: list[dict[str, Any]], times: list[float | None]) -> dict[str, Any]:
    """The run whose time to the target is the median one (the first run when none got there)."""
    order = sorted(range(len(runs)), key=lambda i: np.inf if times[i] is None else times[i])
    return runs[order[(len(order) - 1) // 2]] if any(t is not None for t in times) else runs[0]


def main(quick: bool = False, out: str | None = None, modes: str | None = None,
         steps: int | None = None, overrides: list[str] | None = None,
         repeats: int | None = None, control: bool | None = None,
         predicted: str | None = None, task: str = "reverse") -> dict[str, Any]:
    import ray

    chosen = parse_modes(modes)
    if task not in WORKLOADS:
        raise ConfigError(f"--task {task!r}: bench modes has a workload for "
                          f"{', '.join(WORKLOADS)}")
    overrides = list(overrides or [])
    prediction = read_prediction(predicted) if predicted else None  # before anything runs
    bench_config("laminar", 1, Path("/tmp"), overrides, task)  # a bad --set fails first
    steps = steps or (QUICK_STEPS if quick else STEPS)
    repeats = repeats or (1 if quick else 3)
    control = (not quick and task == "reverse") if control is None else control
    if control and task != "reverse":
        raise ConfigError(f"--task {task}: its environment latency is real, so there is no "
                          "env-latency-off control; drop the control option")
    with_trl = "trl" in chosen
    if with_trl and task != "reverse":
        print(f"bench modes: skipping trl (its GRPOTrainer runs one-turn rewards, not the {task} "
              "task's episodes)", flush=True)
        with_trl = False
    if with_trl and not trl.available():
        print(f"bench modes: skipping trl. {trl.INSTALL_HINT}", flush=True)
        with_trl = False
    schedules = [m for m in MODES if m in chosen]
    root = Path(tempfile.mkdtemp(prefix="laminar-bench-modes-"))
    print(f"bench modes: {len(schedules)} schedules x {repeats} repeats, sync {steps} steps and the "
          f"others {mode_steps('laminar', steps)}{', then the env-latency-off control' if control else ''}; "
          f"runs in {root}", flush=True)

    # recorded before anything runs: the commit and tree the results come from
    configs = {m: bench_config(m, mode_steps(m, steps), root / m, overrides, task)
               for m in schedules}
    prov = provenance(config={m: c.model_dump(mode="json") for m, c in configs.items()})
    affinity = {m: cpu_affinity(c) for m, c in configs.items()}  # cluster.cpu_affinity, per mode
    for m, (choice, why) in affinity.items():
        print(f"  {m}: cpus {choice} ({why})", flush=True)
    ray_env_defaults()  # as laminar's own jobs start Ray: workers at the driver's priority
    # and, where a schedule splits, off the trainer's cores (a sync run's trainer and rollouts
    # take every core back: devices.pin_cpus)
    split = [c for m, c in configs.items() if affinity[m][0] in PINNED]
    if split:
        leave_trainer_cores(split[0])
    ray.init(include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        on = run_condition(schedules, steps, repeats, root, overrides, "env-on", task)
        off = run_condition([m for m in schedules if m in CONTROL_MODES], steps, repeats, root,
                            overrides + CONTROL, "env-off") if control else None
    finally:
        ray.shutdown()
        restore_cores()
    report: dict[str, Any] = {
        "task": task, "workload": WORKLOADS[task] + overrides, "control_overrides": CONTROL,
        "steps": steps,
        "steps_by_mode": {m: mode_steps(m, steps) for m in schedules},
        "quick": quick, "repeats": repeats,
        "cpu_affinity_by_mode": {m: choice for m, (choice, _) in affinity.items()},
        **summarize(on),
        "control_env_latency_off": summarize(off) if off else None,
    }
    if with_trl:
        report["trl"] = run_trl_reference(root, overrides, min(steps, TRL_STEPS))
        tput = report["trl"]["throughput"]
        report["throughput_by_mode"]["trl"] = tput
        report["ratio_laminar_vs"]["trl"] = report["throughput_by_mode"]["laminar"] / tput
    if prediction:
        report["simulator_prediction"] = compare_prediction(prediction, report["ratio_laminar_vs"],
                                                            predicted)
    report["runs"] = {m: [{k: v for k, v in r.items()
                           if k not in ("heldout", "reward_curve", "env_latency_s", "turns")}
                          for r in rs] for m, rs in on.items()}
    report["provenance"] = prov
    print_tables(report, mode_steps("laminar", report["steps"]), BREAKDOWN)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1))
        print(f"wrote {out}")

        print(f"wrote {write_bench_html(report, bench_html_path(out))}")
    return report


def read_prediction(path: str) -> dict[str, float]:
    """`throughput_by_mode` of `laminar simulate --calibration LOCAL.json --out F`: the
    simulator's prediction for this machine, made before the benchmark runs."""
    try:
        data = json.loads(Path(path).read_text())
        return {m: float(v) for m, v in data["throughput_by_mode"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"--predicted {path}: not a `laminar simulate --calibration ... --out` "
                          f"JSON with throughput_by_mode ({type(e).__name__}: {e})") from None


def compare_prediction(predicted: dict[str, float], measured: dict[str, float],
                       source: str) -> dict[str, Any]:
    """laminar/mode ratios: the simulator's (from this machine's calibration) vs measured."""
    ratios = {m: predicted["laminar"] / v for m, v in predicted.items() if m != "laminar" and v}
    return {"source": source, "predicted_ratio_laminar_vs": ratios,
            "measured_ratio_laminar_vs": {m: measured[m] for m in ratios if m in measured},
            "error": {m: measured[m] / r - 1.0 for m, r in ratios.items() if m in measured}}


def run_trl_reference(root: Path, overrides: list[str], steps: int) -> dict[str, Any]:
    """TRL at its best here: each of its settings timed on a few steps, the fastest one run."""
    cfg = bench_config("sync", steps, root / "trl", overrides)
    print(f"bench modes: timing TRL's {len(trl.SETTINGS)} settings ...", flush=True)
    best, speeds = trl.pick_fastest(cfg, root / "trl")
    print(f"bench modes: trl {best} ({', '.join(f'{k} {v:.0f} tok/s' for k, v in speeds.items())}); "
          f"running it for {steps} steps ...", flush=True)
    result = trl.run_trl(cfg, steps, root / "trl" / best, best, WARMUP_STEPS)
    found = versions()
    return {**result, "probe_tokens_per_s": speeds, "steps": steps,
            "version": found["trl"], "transformers": found["transformers"]}
