"""Whole-job resume: `laminar train` killed with SIGKILL (the driver and every process it
started: Ray's own, the pools, the rollouts, the relays, the trainer) at seeded moments, three
times, then `laminar resume RUN_DIR` finishes the run, and every group's gradient is in the
final model exactly once."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from laminar.bench.faults import kill_tree
from laminar.pools.resume import check_lineage
from waiting import remaining_s, until

JOB = {
    "name": "resume-test", "mode": "laminar",
    "sft": {"enabled": False},
    "task": {"reverse": {"max_len": 12}, "eval_prompts": 8},
    "rollout": {"max_new_tokens": 13, "group_size": 2, "num_workers": 2, "batch_groups": 2,
                "engine": {"max_batch_size": 8}, "max_outstanding_batches": 2,
                "stream_every": 4, "stream_interval_s": 0.05},  # in-flight tokens on record
    # tool calls of ~0.2 s: an update takes a few tenths of a second even on an idle machine, so
    # a kill lands mid-run and not after the end
    "bench": {"env_latency": {"enabled": True, "median_s": 0.2, "sigma": 0.5, "max_s": 1.0}},
    "cluster": {"virtual_nodes": 2, "wait_timeout_s": 120, "heartbeat_s": 1.0, "num_cpus": 4},
    "manager": {"interval_s": 0.2},
    "trainer": {"prompts_per_step": 4, "threads": 1, "total_steps": 15, "checkpoint_every": 3,
                "eval_every": 0},
    "metrics": {"live": False},
}
LAMINAR = [sys.executable, "-m", "laminar.cli"]


def _step_rows(run_dir: Path) -> int:
    try:
        return sum('"kind": "step"' in line for line in (run_dir / "metrics.jsonl").open())
    except FileNotFoundError:
        return 0


def _kill_job(proc: subprocess.Popen) -> int:
    """SIGKILL the driver and every process under it; returns how many."""
    n = kill_tree(proc.pid)
    proc.wait(timeout=60)
    return n


@pytest.mark.slow  # ~50 s; the default suite kills and resumes the deterministic job three times
@pytest.mark.parametrize("times", [1, 3])
def test_a_killed_job_resumes_and_trains_every_group_exactly_once(times, tmp_path):
    """Killed once, and three times (a resume of a resume)."""
    rng = random.Random(17)
    run_dir = tmp_path / "run"
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({**JOB, "run_dir": str(run_dir)}))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray cluster
    cmd = [*LAMINAR, "train", str(config)]
    jobs, kills = [], []
    for round_ in range(times):
        before = _step_rows(run_dir)
        log = (tmp_path / f"round{round_}.log").open("w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        target = before + rng.randint(1, 3)  # updates this incarnation makes before its kill

        def reached(proc=proc, round_=round_, target=target):
            assert proc.poll() is None, f"round {round_} ended early:\n" + \
                (tmp_path / f"round{round_}.log").read_text()[-3000:]
            return _step_rows(run_dir) >= target
        until(f"round {round_} to reach update {target}", reached,
              seen=lambda: f"{_step_rows(run_dir)} updates")
        time.sleep(rng.uniform(0.0, 0.5))  # anywhere in the next update: mid-step, mid-push
        jobs.append(json.loads((run_dir / "job.json").read_text())["job"])
        kills.append((_step_rows(run_dir), _kill_job(proc)))
        assert all(n > 5 for _, n in kills)  # the driver, Ray's processes and the actors
        cmd = [*LAMINAR, "resume", str(run_dir)]

    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=remaining_s())
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert out.count("resume: model from version") == 1 and "exactly-once check: passed" in out
    print(next(line for line in out.splitlines() if line.startswith("resume: ")))

    report = json.loads((run_dir / "report.json").read_text())
    cfg_steps, per_step = JOB["trainer"]["total_steps"], JOB["trainer"]["prompts_per_step"]
    once = report["exactly_once"]
    assert once["ok"] and once["restarts"] == times
    assert once["groups"] == cfg_steps * per_step  # total_steps updates, each group once
    again = check_lineage(run_dir, JOB["rollout"]["group_size"], cfg_steps * per_step)
    assert again.ok and not again.duplicates
    acct = report["prompts"]
    assert acct["issued"] == acct["leased"] + acct["returned"] + acct["completed"]
    assert acct["consumed"] == cfg_steps * per_step
    bal = report["balance"]  # every group handed out is trained, in flight or pending
    assert bal["issued"] == bal["trained"] + bal["in_flight"] + bal["pending"]
    # the killed jobs' relays left shared memory behind; the next job removed it
    shm = JOB.get("relay", {}).get("shm_dir", "/dev/shm")
    assert not [p for p in os.listdir(shm) if any(p.startswith(f"lam-{j}-") for j in jobs)]
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert sum(e.get("what") == "resume" for e in events) == times


def _final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    from laminar.trainer.service import newest_checkpoint

    return load_file(newest_checkpoint(run_dir) / "model" / "model.safetensors")


def test_a_deterministic_run_killed_and_resumed_ends_with_the_uninterrupted_model(tmp_path):
    """Sync on the one-process backend, one rollout, seeded sampling (each trajectory's draws
    are fixed by its id): killed three times at seeded moments and resumed, the final weights
    equal an uninterrupted run's, bit for bit."""
    import torch

    overrides = {"mode": "sync", "cluster": {"backend": "local"}, "sft": {"enabled": False},
                 "task": {"reverse": {"max_len": 8}, "eval_prompts": 4},
                 "rollout": {"max_new_tokens": 9, "group_size": 4, "num_workers": 1,
                             "stream_every": 2, "stream_interval_s": 0.0},
                 "trainer": {"prompts_per_step": 4, "total_steps": 12, "checkpoint_every": 2,
                             "threads": 1, "lr": 1e-3, "eval_every": 0},
                 "metrics": {"live": False, "tensorboard": False}}
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    rng = random.Random(int(os.environ.get("KILL_SEED", 5)))
    runs, summaries = {}, []
    for name in ("straight", "killed"):
        run_dir = tmp_path / name
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump({**overrides, "name": name, "run_dir": str(run_dir)}))
        runs[name] = run_dir
        cmd = [*LAMINAR, "train", str(config)]
        if name == "killed":
            for target in sorted(rng.sample(range(2, 11), 3)):  # kill after that many updates
                log = tmp_path / f"incarnation{len(summaries)}.log"
                proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
                until(f"update {target}", lambda proc=proc, target=target: _step_rows(run_dir) >= target
                      if proc.poll() is None else pytest.fail(f"the job ended early:\n{log.read_text()[-3000:]}"),
                      poll_s=0.01)
                time.sleep(rng.uniform(0.0, 0.3))
                _kill_job(proc)
                summaries += [line for line in log.read_text().splitlines() if line.startswith("resume: ")]
                summaries.append(f"killed after {target} updates")
                cmd = [*LAMINAR, "resume", str(run_dir)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=remaining_s())
        out = done.stdout + done.stderr
        assert done.returncode == 0 and "exactly-once check: passed" in out, out[-3000:]
        summaries += [line for line in out.splitlines() if line.startswith("resume: ")]
    print("\n".join(summaries))
    a, b = _final_weights(runs["straight"]), _final_weights(runs["killed"])
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), f"max |difference| {diff:.3g}"
