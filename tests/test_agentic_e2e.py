"""Agentic training end to end with real Ray actors, relays and the real sandbox: a user's
environment from a file beside the job, whose every turn runs hostile code in the sandbox (a
socket to the host, 10 GB, an endless loop, 100 MB of output, reading the run directory and
the relay's secret). Each is contained, comes back as an observation, is counted in the step
rows by status, and the job trains to the end losing nothing."""

from __future__ import annotations

import json
import socket
import textwrap

import pytest

from laminar.config import load_config
from laminar.metrics import read_metrics
from laminar.modes import run_training
from laminar.sandbox import SandboxError, resolve_backend

ENV = '''
from laminar.config import SandboxConfig
from laminar.envs import Env, StepResult
from laminar.sandbox import shared_sandbox

ATTACKS = [
    "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1); print('reach' + 'ed')",
    "x = bytearray(10 * 2**30); print('alloc' + 'ated')",
    "while True: pass",
    "for _ in range(10**6): print('y' * 100)",  # 100 MB out, a few ms of CPU to the limit
    "print(open({secret!r}).read())",
    "import os; print(os.environ.get({secret_env!r}, 'no secret'))",
]

class Hostile(Env):
    """Two turns; each runs the next attack (by prompt index) whatever the model wrote."""
    def __init__(self):
        self.sandbox = SandboxConfig(timeout_s=1.0, cpu_s=2, memory_mb=256)
        self.turn = 0
    async def reset(self, sample):
        self.index = sample.index
        return sample.prompt
    async def step(self, text):
        code = ATTACKS[(self.index + self.turn) % len(ATTACKS)]
        self.turn += 1
        r = await shared_sandbox(self.sandbox).arun(code)
        leaked = "reached" in r.stdout or "allocated" in r.stdout or "TOPSECRET" in r.stdout
        return StepResult("<" + r.observation()[-40:] + ">", 0.0 if leaked else 0.5,
                          self.turn == 2, {{"tool_status": r.status, "leaked": leaked}})
'''


def test_hostile_tool_calls_are_contained_and_training_goes_on(tmp_path, ray_cluster, monkeypatch):
    try:
        resolve_backend(load_config(None, []).sandbox)
    except SandboxError as e:
        pytest.skip(f"no isolating sandbox here: {e}")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.1)
    port = listener.getsockname()[1]
    run_dir = tmp_path / "run"
    secret = run_dir / "secret.txt"
    run_dir.mkdir()
    secret.write_text("TOPSECRET")
    monkeypatch.setenv("LAMINAR_TEST_SECRET", "TOPSECRET")
    user = tmp_path / "user"
    user.mkdir()
    (user / "hostile.py").write_text(ENV.format(port=port, secret=str(secret),
                                                secret_env="LAMINAR_TEST_SECRET"))
    job = user / "job.yaml"
    job.write_text(textwrap.dedent(f"""
        task: {{name: reverse, env: "hostile.py:Hostile", max_turns: 2, env_timeout_s: 30,
                reverse: {{max_len: 6}}, eval_prompts: 4}}
        sft: {{enabled: false}}
        rollout: {{num_workers: 2, max_new_tokens: 30, group_size: 2, batch_groups: 2,
                   engine: {{max_batch_size: 8}}}}
        cluster: {{virtual_nodes: 2, wait_timeout_s: 120}}
        trainer: {{prompts_per_step: 4, mini_batches: 2, total_steps: 3, threads: 1}}
        run_dir: {run_dir}
        """))
    report = run_training(load_config(str(job), []))
    try:
        listener.accept()
        reached = True
    except OSError:
        reached = False
    listener.close()
    assert not reached, "a sandboxed program connected to the host's loopback"

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    calls = rows[-1]["tool_calls"]
    assert calls.get("timeout", 0) >= 1 and calls.get("output_limit", 0) >= 1, calls
    assert sum(calls.values()) >= 12  # 3 steps x 4 groups x 2 samples, one call per turn at least
    trained = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(trained) == len({t["traj_id"] for t in trained}) == 3 * 4 * 2
    assert all(t["failed"] is None for t in trained)  # contained attacks fail nothing
    assert all(t["reward"] == 0.5 for t in trained), "an attack got through (reward 0 = leaked)"
    assert report["exactly_once"]["ok"]
    assert any(x > 0.5 for r in rows for x in r["env_latency_s"])  # the endless loop's timeout
