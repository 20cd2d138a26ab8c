"""Elasticity from the command line: `laminar scale` and `laminar status` against a running job.

The job is a real `laminar train` process (its own embedded Ray cluster, two rollouts on two
virtual nodes); the commands are real `laminar` processes that talk to it only through its run
directory (laminar/observe/control.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from laminar.observe.control import plan_scale
from waiting import remaining_s, until

ROOT = Path(__file__).parent.parent
TINY = ["sft.enabled=false", "task.reverse.max_len=8", "rollout.max_new_tokens=9",
        "rollout.group_size=2", "rollout.num_workers=2", "cluster.virtual_nodes=2",
        "rollout.batch_groups=2", "trainer.prompts_per_step=4", "trainer.mini_batches=2",
        "trainer.threads=1", "rollout.engine.max_batch_size=8", "task.eval_prompts=8",
        "metrics.live=off", "metrics.tensorboard=false", "cluster.wait_timeout_s=120"]


def test_plan_scale_adds_and_removes_newest_first():
    live = ["rollout0", "rollout1", "rollout2.1", "rollout3"]
    assert plan_scale({"add": 2}, live) == (2, [])
    assert plan_scale({"rollouts": 6}, live) == (2, [])
    assert plan_scale({"rollouts": 2}, live) == (0, ["rollout2.1", "rollout3"])
    assert plan_scale({"remove": ["rollout1"]}, live) == (0, ["rollout1"])
    with pytest.raises(ValueError, match="no such live rollout"):
        plan_scale({"remove": ["rollout9"]}, live)
    with pytest.raises(ValueError, match="at least one rollout"):
        plan_scale({"rollouts": 0}, live)
    with pytest.raises(ValueError, match="leave no rollout"):
        plan_scale({"remove": live}, live)


def _laminar(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "laminar.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def _status(run: Path) -> dict:
    return json.loads((run / "status.json").read_text())


def _wait(what: str, cond) -> None:
    def safely():
        try:
            return cond()
        except (OSError, ValueError, KeyError):  # status.json not written yet, or mid-write
            return False
    until(what, safely, poll_s=0.5)


def test_commands_without_a_running_job_say_so(tmp_path):
    r = _laminar("scale", str(tmp_path), "--add", "1")
    assert r.returncode == 2 and "has no status.json" in r.stderr and "Traceback" not in r.stderr
    r = _laminar("scale", str(tmp_path))
    assert r.returncode == 2 and "say what to change" in r.stderr


@pytest.mark.slow
def test_scale_up_by_two_and_down_by_one_during_a_run(tmp_path):
    run = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "-m", "laminar.cli", "train", "examples/reverse.yaml",
                            f"run_dir={run}", *TINY, "mode=laminar", "trainer.total_steps=500"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        _wait("the job's status", lambda: _status(run)["step"] and _status(run)["step"] >= 3)
        up = _laminar("scale", str(run), "--add", "1")  # beside the existing relays
        assert up.returncode == 0 and "starting rollout2" in up.stdout, up.stdout + up.stderr
        new_node = _laminar("scale", str(run), "--add", "1", "--new-node")  # with a relay of its own
        assert new_node.returncode == 0 and "starting rollout3" in new_node.stdout, new_node.stderr
        _wait("both new rollouts to run", lambda: {"rollout2", "rollout3"} <= {
            r["id"] for r in _status(run)["rollouts"] if r["generated_tokens"] > 0})
        down = _laminar("scale", str(run), "--remove", "rollout0")
        assert down.returncode == 0 and "rollout0 left" in down.stdout, down.stdout + down.stderr
        shown = _laminar("status", str(run))
        assert shown.returncode == 0 and "running" in shown.stdout and "rollout3" in shown.stdout
        status = _status(run)
        assert {r["id"] for r in status["rollouts"]} == {"rollout1", "rollout2", "rollout3"}
        [joined] = status["relay_joins"]  # the new virtual node's relay
        relay3 = next(r["relay"] for r in status["rollouts"] if r["id"] == "rollout3")
        assert joined["relay"] == relay3 == status["relays"][-1]["id"]  # at the chain's tail
        # caught up before its rollout started: it held the master's version at the join
        assert joined["version"] is not None and joined["version"] >= joined["master_version"]
        out, _ = job.communicate(timeout=remaining_s())
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out[-3000:]
    assert "exactly-once check: passed" in out, out[-3000:]
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    scale = [e["detail"] for e in events if e.get("kind") == "event" and e.get("what") == "scale"]
    assert len(scale) == 3, scale
    assert _status(run)["finished"]
