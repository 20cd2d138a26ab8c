"""A real multi-node Ray cluster on this machine: a head raylet and two worker raylets, each worker
in its own network namespace (its own IP behind a veth) and mount namespace (its own /dev/shm
and /tmp), started with `ray start` (laminar/devcluster/nscluster.py). Jobs are `laminar train`
processes with `cluster.address`, as a user runs them; user code lives in pytest's temporary
folder, which the worker nodes cannot see, so it has to travel.

Skipped with the reason where namespaces cannot be created (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from laminar.devcluster.nscluster import NamespacedCluster

OK, WHY = NamespacedCluster.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"namespaced cluster unavailable: {WHY}")

TINY = ["sft.enabled=false", "task.reverse.max_len=8", "rollout.max_new_tokens=9",
        "rollout.group_size=2", "rollout.num_workers=2", "rollout.batch_groups=2",
        "trainer.prompts_per_step=4", "trainer.mini_batches=2", "trainer.threads=1",
        "rollout.engine.max_batch_size=8", "task.eval_prompts=8", "metrics.live=off",
        "metrics.tensorboard=false", "cluster.wait_timeout_s=90"]

REWARD = '''
def score(prompt, response, answer):
    return float(response.strip() == answer.strip())
'''


@pytest.fixture(scope="module")
def cluster():
    c = NamespacedCluster(3, name=f"pytest-{os.getpid()}")
    c.up()
    try:
        yield c
    finally:
        c.down()


def _user_files(folder: Path) -> None:
    """A reward file and a JSONL dataset in a folder only the driver's machine has."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "my_reward.py").write_text(REWARD)
    rng = random.Random(0)
    with open(folder / "data.jsonl", "w") as f:
        for _ in range(64):
            word = "".join(rng.choice("abcdef") for _ in range(rng.randint(2, 6)))
            f.write(json.dumps({"prompt": word, "answer": word[::-1]}) + "\n")


def _train(cluster: NamespacedCluster, run_dir: Path, *extra: str, env: dict | None = None,
           timeout: float = 400) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "laminar.cli", "train", "examples/reverse.yaml",
           f"cluster.address={cluster.address}", f"run_dir={run_dir}", *TINY, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          cwd=Path(__file__).parent.parent, env={**os.environ, **(env or {})})


def _veth_rx_bytes(cluster: NamespacedCluster) -> dict[str, int]:
    """Bytes each worker node received over its veth (counted inside its namespace)."""
    out = {}
    for i, ns in enumerate(cluster.state.namespaces, 1):
        stats = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/dev"],
                               capture_output=True, text=True).stdout
        line = next(ln for ln in stats.splitlines() if f"lp{cluster.state.tag}" in ln)
        out[cluster.state.node_ips[i]] = int(line.split(":")[1].split()[0])
    return out


def test_laminar_job_trains_across_three_nodes(cluster, tmp_path):
    user = tmp_path / "user"
    _user_files(user)
    before = _veth_rx_bytes(cluster)
    r = _train(cluster, tmp_path / "run", "mode=laminar", "trainer.total_steps=8",
               "task.name=dataset", f"task.dataset.path={user / 'data.jsonl'}",
               f"task.reward={user / 'my_reward.py'}:score")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "exactly-once check: passed" in r.stdout
    assert "step    8/8" in r.stdout
    assert "shipping task.reward" in r.stdout  # the reward's folder travelled
    procs = json.loads((tmp_path / "run" / "processes.json").read_text())
    head, workers = cluster.node_ips[0], set(cluster.node_ips[1:])
    hosts = [procs["relay_addresses"][r].rpartition(":")[0] for r in procs["chain"]]
    assert len(set(hosts)) == 3 and set(hosts) == set(cluster.node_ips), hosts
    assert hosts[0] == head and procs["trainer_node"] == head  # the master sits with the trainer
    for wid, ip in procs["rollout_nodes"].items():  # each rollout reads its own node's relay
        relay = procs["rollout_relay"][wid]
        assert ip in workers and procs["relay_addresses"][relay].startswith(ip + ":"), (wid, ip, relay)
    # versions reached the workers over their veths: each node received more than a whole model
    # (the starting weights, then versions whole or as deltas: relay.full_every, docs/relay.md);
    # and a laminar rollout that never got a new version could not have trained 8 updates
    # (it drains at rollout.version_lag until its local relay has one)
    model_bytes = (tmp_path / "run" / "initial_model" / "model.safetensors").stat().st_size
    received = {ip: n - before[ip] for ip, n in _veth_rx_bytes(cluster).items()}
    assert all(n > 1.5 * model_bytes for n in received.values()), (received, model_bytes)


@pytest.mark.slow  # a start-up error across nodes; the default suite keeps the three-node job
def test_relay_bound_to_one_nodes_address_fails_naming_the_node(cluster, tmp_path):
    t0 = time.monotonic()
    r = _train(cluster, tmp_path / "run", "trainer.total_steps=2", f"relay.host={cluster.node_ips[0]}")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    err = r.stderr.strip().splitlines()[-1]
    assert "relay node1" in err and f"relay.host='{cluster.node_ips[0]}'" in err, err
    assert any(ip in err for ip in cluster.node_ips[1:]) and "Traceback" not in r.stderr, r.stderr
    assert time.monotonic() - t0 < 90 + 60


def _block_ports(dev: str, first: int) -> None:
    """Packets to TCP/UDP ports first..first+15 leaving `dev` go to an htb class of 8 bit/s: a
    SYN takes over a minute, so the port is as good as firewalled (this kernel has no iptables
    or tc drop action; htb and the u32 classifier it has)."""
    tc = ["tc"]
    for args in (["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
                 ["class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit"],
                 ["class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", "8bit",
                  "ceil", "8bit", "burst", "1", "cburst", "1"],  # no burst: not even one SYN
                 ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                  "match", "ip", "dport", str(first), "0xfff0", "flowid", "1:20"]):
        subprocess.run([*tc, *args], check=True, capture_output=True)


@pytest.mark.slow  # a start-up error across nodes; the default suite keeps the three-node job
def test_blocked_relay_port_fails_naming_both_ends(cluster, tmp_path):
    first = 47008  # 16 ports, aligned so that one u32 mask matches them all
    dev = f"lv{cluster.state.tag}1"  # the host's end of node 2's veth: traffic towards node 2
    try:
        _block_ports(dev, first)
        r = _train(cluster, tmp_path / "run", "trainer.total_steps=2",
                   f"relay.port_range=[{first},{first + 15}]", "relay.timeout_s=3",
                   "relay.heartbeat_s=1")
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    err = r.stderr.strip().splitlines()[-1]
    assert "cannot reach relay node" in err and cluster.node_ips[2] in err, err
    assert "relay.port_range" in err and "Traceback" not in r.stderr


@pytest.mark.slow  # a start-up error across nodes (20 s); the default suite keeps the three-node job
def test_worker_node_that_cannot_import_the_reward_is_named(cluster, tmp_path):
    user, private = tmp_path / "user", tmp_path / "driver-only"
    _user_files(user)
    private.mkdir()
    (private / "head_only.py").write_text("BONUS = 0.0\n")  # on the driver's PYTHONPATH only
    (user / "my_reward.py").write_text("import head_only\n" + REWARD)
    r = _train(cluster, tmp_path / "run", "trainer.total_steps=2",
               f"task.reward={user / 'my_reward.py'}:score",
               env={"PYTHONPATH": f"{private}:{os.environ.get('PYTHONPATH', '')}"})
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    err = r.stderr.strip().splitlines()[-1]
    assert "failed to start" in err and "head_only" in err and "task.reward" in err, err
    assert any(f"on node {ip}" in err for ip in cluster.node_ips[1:]), err


def _start(cluster: NamespacedCluster, run: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "laminar.cli", "train", "examples/reverse.yaml",
         f"cluster.address={cluster.address}", f"run_dir={run}", *TINY, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).parent.parent)


def _wait_steps(run: Path, n: int, proc: subprocess.Popen, timeout: float = 200) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if (run / "metrics.jsonl").exists():
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
            if sum(r.get("kind") == "step" for r in rows) >= n:
                return
        time.sleep(0.5)
    raise AssertionError(f"the job did not reach step {n} (exit {proc.poll()})")


def _job_with(cluster: NamespacedCluster, run: Path, steps: int, after: int, during) -> tuple[str, object]:
    """A laminar-mode job of `steps` updates; `during()` runs once it reached `after` steps.
    Returns its output and what `during` returned, once it ended well and lost nothing."""
    proc = _start(cluster, run, "mode=laminar", f"trainer.total_steps={steps}")
    try:
        _wait_steps(run, after, proc)
        value = during()
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert "exactly-once check: passed" in out and f"step  {steps:3d}/{steps}" in out, out[-3000:]
    return out, value


@pytest.mark.slow
def test_a_node_that_joins_gets_a_relay_and_rollouts(cluster, tmp_path):
    # long enough for the new node's rollout to start (a fresh raylet starts a worker that
    # imports torch: ~10 s here) and generate for a while
    run = tmp_path / "run"

    def join():
        ip = cluster.add_node()  # a machine joins the running cluster
        end = time.monotonic() + 150
        while time.monotonic() < end:  # until its rollout runs
            if ip in json.loads((run / "processes.json").read_text()).get("rollout_nodes", {}).values():
                break
            time.sleep(0.5)
        return ip, subprocess.run([sys.executable, "-m", "laminar.cli", "cluster", "status",
                                   "--address", cluster.address], capture_output=True, text=True,
                                  timeout=120)

    _, (ip, status) = _job_with(cluster, run, 200, 3, join)
    procs = json.loads((run / "processes.json").read_text())
    # `laminar cluster status`, asked mid-run: every node, and the job's chain master first
    assert status.returncode == 0, status.stderr[-2000:]
    assert all(node in status.stdout for node in cluster.node_ips[:3]), status.stdout
    assert "relay chain, master first" in status.stdout and "node0 (master)" in status.stdout
    [joined] = procs["nodes_joined"]
    assert joined["node"] == ip and procs["chain"][-1] == joined["relay"]  # at the tail
    assert procs["relay_addresses"][joined["relay"]].startswith(ip + ":")
    [new] = joined["rollouts"]
    assert procs["rollout_nodes"][new] == ip and procs["rollout_relay"][new] == joined["relay"]
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    assert any(e.get("kind") == "event" and e.get("what") == "node" for e in events)
    # the new rollout generated (and the exactly-once check says all generated work was trained)
    assert any((e.get("gen_tokens_per_s_by_rollout") or {}).get(new, 0) > 0 for e in events
               if e.get("kind") == "step"), "the new rollout never generated"


@pytest.mark.slow
def test_a_relay_that_dies_on_a_live_node_is_replaced_there(cluster, tmp_path):
    run = tmp_path / "run"

    def kill_relay():
        before = json.loads((run / "processes.json").read_text())
        victim = before["rollout_relay"]["rollout0"]  # rollout0's relay, on a worker node
        os.kill(before["relays"][victim], 9)
        return victim, before["rollout_nodes"]["rollout0"]

    _, (victim, node_ip) = _job_with(cluster, run, 120, 5, kill_relay)
    after = json.loads((run / "processes.json").read_text())
    new = after["rollout_relay"]["rollout0"]
    assert new != victim and victim not in after["chain"] and new in after["chain"]
    assert after["relay_addresses"][new].startswith(node_ip + ":")  # on rollout0's own node
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if r.get("kind") == "step"]
    # rollout0 went on generating after the kill, with weights from the new relay
    assert (steps[-1].get("gen_tokens_per_s_by_rollout") or {}).get("rollout0", 0) > 0


@pytest.mark.slow
def test_job_goes_on_when_a_worker_node_dies(cluster, tmp_path):
    # every process of worker node 2 (its raylet, relay and rollout) gets SIGKILL at step 5
    _, killed = _job_with(cluster, tmp_path / "run", 30, 5, lambda: cluster.kill_node(2))
    assert killed
