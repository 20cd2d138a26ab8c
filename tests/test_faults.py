"""Failure isolation and elasticity with real actors and real kills (SIGKILL on the process):
a killed rollout loses nothing, its work continues in the version it started in, and a new
incarnation takes its place; a killed relay (one mid-broadcast, and the master) is cut out of
the chain and training goes on; a killed trainer (mid-step, and right after a checkpoint)
restarts from its checkpoint and trains every group once; rollouts join and leave a running
job.

Every test waits for the event it asserts (the manager's detection, the repair, the
replacement, training going on after it) with a deadline, and ends training itself after that:
nothing races with the end of training. A victim is frozen (SIGSTOP) for a moment before the
kill where the test must know what it held when it died (a rollout's trajectories, a relay's
unforwarded version); the manager's fault records say when it noticed and when it repaired.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter

import pytest
import ray
import torch

from laminar.config import load_config
from laminar.metrics import read_rows
from laminar.modes import schedule
from laminar.modes.common import start_weights
from laminar.modes.driver import Follower, finish
from laminar.runtime.cluster import ClusterRuntime
from waiting import answer, until

# cluster.heartbeat_s stays 2 s: a killed process is noticed at once (calls to it fail), and a
# rollout whose step takes over 1.5 s on this shared 2-core machine must not be declared hung
TINY = ["sft.enabled=false", "task.reverse.max_len=12", "rollout.max_new_tokens=13",
        "rollout.group_size=2", "rollout.num_workers=2", "cluster.virtual_nodes=2",
        "rollout.batch_groups=2", "trainer.prompts_per_step=4", "trainer.threads=1",
        "rollout.engine.max_batch_size=8", "cluster.wait_timeout_s=120",
        "cluster.heartbeat_s=2", "manager.interval_s=0.2", "mode=laminar",
        "rollout.max_outstanding_batches=2", "trainer.total_steps=500"]
RELAYS = ["relay.heartbeat_s=0.2", "relay.chunk_bytes=65536"]  # a killed relay is noticed at once


def _runtime(cfg):
    model_dir, _ = start_weights(cfg)
    return ClusterRuntime(cfg, model_dir, 0, schedule("laminar").policy(cfg))


def _version(rt):
    return len(ray.get(rt.trainer.metrics_since.remote(0)))


def _wait_version(rt, version):
    until(f"the trainer to reach version {version}", lambda: _version(rt) >= version,
          seen=lambda: f"version {_version(rt)}")


def _then_stop(rt, follower, training, more=2):
    """Training goes on for `more` versions after the fault was handled, then ends; returns
    the updates the model got (its version: no restart skipped a number)."""
    _wait_version(rt, _version(rt) + more)
    rt.trainer.stop.remote()
    return follower.follow(lambda: rt.train("run"), started=training)


def _fault(rt, kind, who):
    return until(f"the manager to repair {kind} {who}", lambda: next(
        (f for f in rt.manager_stats()["faults"] if (f["kind"], f["who"]) == (kind, who)), None),
        seen=lambda: rt.manager_stats()["faults"])


def _latest(rt, relay):
    return answer(rt.relays.actors[relay].heartbeat.remote(), f"relay {relay}'s heartbeat")["latest"] or 0


def _trained(cfg):
    lines = [json.loads(line) for line in (cfg.resolved_run_dir / "trajectories.jsonl").read_text().splitlines()]
    return [t for t in lines if "traj_id" in t]


def _check_nothing_lost(cfg, report, steps):
    trained = _trained(cfg)
    assert len({t["traj_id"] for t in trained}) == len(trained)  # every group trained once
    assert set(Counter(t["group_id"] for t in trained).values()) == {cfg.rollout.group_size}
    acct = report["prompts"]
    assert acct["issued"] == acct["leased"] + acct["returned"] + acct["completed"]
    assert acct["consumed"] == steps * cfg.trainer.prompts_per_step
    assert all(t["token_versions"] is None for t in trained)  # still one version each
    assert report["exactly_once"]["ok"]


def _check_lineage(cfg, report, steps):
    """After trainer restarts: the model's lineage (what was trained up to each restart's
    checkpoint, then after it) holds every group once and `steps` global batches."""
    kept, marks = [], []
    for line in map(json.loads, (cfg.resolved_run_dir / "trajectories.jsonl").read_text().splitlines()):
        if line.get("event") == "trainer_restart":  # what was trained after its checkpoint is lost
            marks.append(line)
            kept = [t for t in kept if t["trained_at"] < line["resumed_at"]]
        elif "traj_id" in line:
            kept.append(line)
    assert len({t["traj_id"] for t in kept}) == len(kept)  # nothing trained twice
    groups = Counter(t["group_id"] for t in kept)
    assert set(groups.values()) == {cfg.rollout.group_size}
    assert len(groups) == steps * cfg.trainer.prompts_per_step  # nothing lost
    acct = report["prompts"]
    assert acct["issued"] == acct["leased"] + acct["returned"] + acct["completed"]
    assert report["exactly_once"]["ok"]
    return marks


def _events(run_dir):
    return {(e["what"], e["detail"].split()[1]) for e in read_rows(run_dir, "event")}


def _freeze_mid_generation(partials, pid):
    """Wait for rollout0 to hold trajectories with streamed tokens, then SIGSTOP its process
    `pid` and return {trajectory id: version} of what it owns once its last sends landed."""
    def owned_by_rollout0():
        return {e.request.request_id: e.request.version
                for e in ray.get(partials.owned_by.remote("rollout0"))}

    def frozen_mid_generation():
        if not any(v is not None for v in owned_by_rollout0().values()):
            return None
        os.kill(pid, signal.SIGSTOP)
        owned = owned_by_rollout0()
        while (again := owned_by_rollout0()) != owned:  # what it sent before the freeze lands
            owned = again
        if any(v is not None for v in owned.values()):
            return owned
        os.kill(pid, signal.SIGCONT)
        return None

    return until("rollout0 to stream tokens", frozen_mid_generation, poll_s=0.01)


def test_a_killed_rollout_is_replaced_and_its_work_keeps_its_version(tmp_path, ray_cluster):
    # every 2 tokens reach the partial pool (a moved trajectory has some, and their version)
    cfg = load_config(None, TINY + [f"run_dir={tmp_path}", "rollout.stream_every=2",
                                    "rollout.stream_interval_s=0", "rollout.max_outstanding_batches=8"])
    with _runtime(cfg) as rt:
        trainer_pid, pid = rt.trainer_pid(), ray.get(rt.workers["rollout0"].pid.remote())
        partials = rt.pools["partials"]
        training = rt.train("run")
        follower = Follower(rt)

        # held before its second version, the trainer publishes nothing a rollout pulls
        # (rollout.version_lag=2): rollout1 holds the version of rollout0's work when it dies
        os.kill(trainer_pid, signal.SIGSTOP)
        try:
            owned = _freeze_mid_generation(partials, pid)
            killed_at = time.time()
            os.kill(pid, signal.SIGKILL)  # the real process
            fault = _fault(rt, "rollout", "rollout0")
        finally:
            os.kill(trainer_pid, signal.SIGCONT)
        # all of it continues on rollout1 as it was: tokens of version 0 (or none yet)
        assert fault["moved"] == owned and 0 in owned.values()
        until("rollout0's replacement", lambda: rt.manager_stats()["recreated"] == [["rollout0", "rollout0.1"]])
        new = ray.get(rt.manager.rollouts.remote(["rollout0.1"]))["rollout0.1"]
        until("rollout0.1 to finish trajectories",
              lambda: ray.get(new.snapshot.remote()).counters.finished > 0)
        version = _then_stop(rt, follower, training)
        snap = ray.get(new.snapshot.remote())
        report = finish(rt, follower)
    fault = next(f for f in report["manager"]["faults"] if f["who"] == "rollout0")
    print(f"rollout0 killed: detected {fault['detected_at'] - killed_at:.3f}s after the kill, its "
          f"{len(owned)} trajectories handed over {fault['repaired_at'] - fault['detected_at']:.3f}s "
          f"after that, rollout0.1 running {fault['recreated_at'] - fault['detected_at']:.1f}s after it")
    manager = report["manager"]
    assert manager["dead"] == ["rollout0"] and manager["workers"] == ["rollout0.1", "rollout1"]
    assert snap.counters.versions[0] == 0 and max(snap.counters.versions) >= 1  # pulled, then generated
    # the moved trajectories were trained in the version they started in
    trained = {t["traj_id"]: t["version"] for t in _trained(cfg)}
    started = [t for t, v in owned.items() if v == 0 and t in trained]
    assert started and all(trained[t] == 0 for t in started)
    assert {("failure", "rollout0"), ("recreated", "rollout0.1")} <= _events(tmp_path)
    assert ("join", "rollout0.1") not in _events(tmp_path)
    assert version in {e["step"] for e in read_rows(tmp_path, "eval")}  # the held-out schedule survived
    _check_nothing_lost(cfg, report, version)


def test_rollouts_join_and_leave_a_running_job(tmp_path, ray_cluster):
    cfg = load_config(None, TINY + [f"run_dir={tmp_path}"])
    with _runtime(cfg) as rt:
        training = rt.train("run")
        follower = Follower(rt)
        _wait_version(rt, 1)
        wid = rt.add_worker()
        joined = rt.workers[wid]
        until("the new rollout to finish a trajectory",
              lambda: ray.get(joined.snapshot.remote()).counters.finished > 0)
        rt.retire_worker("rollout0")
        version = _then_stop(rt, follower, training)  # training goes on without rollout0
        snap = ray.get(joined.snapshot.remote())
        report = finish(rt, follower)
    assert wid == "rollout2"
    assert snap.counters.versions[0] == 0 and len(snap.counters.versions) >= 2
    assert report["manager"]["retired_workers"] == 1
    assert {("join", "rollout2"), ("leave", "rollout0")} <= _events(tmp_path)
    _check_nothing_lost(cfg, report, version)


def _kill_the_trainer_at(rt, version):
    """Train; once the trainer reached `version`, SIGKILL its process (the real one) and follow
    training through the restart to its end. Returns (the follower, the updates trained)."""
    training = rt.train("run")
    follower = Follower(rt)
    _wait_version(rt, version)
    os.kill(rt.trainer_pid(), signal.SIGKILL)
    return follower, follower.follow(lambda: rt.train("run"), started=training)


@pytest.mark.slow  # the LoRA and right-after-a-checkpoint kills below cover the restart
def test_a_killed_trainer_restarts_from_its_checkpoint_and_loses_no_data(tmp_path, ray_cluster):
    cfg = load_config(None, TINY + [f"run_dir={tmp_path}", "trainer.total_steps=6",
                                    "trainer.checkpoint_every=2"])
    with _runtime(cfg) as rt:
        follower, steps = _kill_the_trainer_at(rt, 3)  # a checkpoint at 2, one update after it
        report = finish(rt, follower)
    assert steps == cfg.trainer.total_steps
    [mark] = _check_lineage(cfg, report, steps)
    # the kill lands at version 3 or later (a slow poll may let the trainer checkpoint at 4)
    assert mark["resumed_at"] >= 2 and mark["resumed_at"] % cfg.trainer.checkpoint_every == 0
    # what was trained after the checkpoint is lost with the process: its groups go back
    lines = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    before = [json.loads(line) for line in lines[:lines.index(json.dumps(mark))]]
    lost = {t["group_id"] for t in before if t["trained_at"] >= mark["resumed_at"]}
    assert mark["requeued_groups"] >= len(lost)


@pytest.mark.slow  # the default suite kills the full-weights trainer twice (mid-step, after a checkpoint)
def test_a_killed_lora_trainer_restarts_on_the_rollouts_base(tmp_path, ray_cluster):
    """trainer.lora: a trainer killed after a checkpoint restarts from it (built again on the
    run's start weights, its LoRA base, then the checkpoint's adapters and optimizer state), so
    the adapter versions it pushes after the restart, under version numbers the relays have not
    seen, still merge on the rollouts' own W0 into exactly the weights the trainer holds; nothing
    is lost or trained twice. (A restart after `laminar resume`, built on the checkpoint's merged
    export, restores the base from DCP: tests/test_lora.py covers that load.)"""
    cfg = load_config(None, TINY + [f"run_dir={tmp_path}", "trainer.total_steps=7",
                                    "trainer.checkpoint_every=2", "trainer.lr=1e-2",
                                    "trainer.lora={}"])
    with _runtime(cfg) as rt:
        follower, steps = _kill_the_trainer_at(rt, 3)  # a checkpoint at 2, one update after it
        # the newest version (a restart skips the numbers the relays already hold)
        version, pushed, merged = ray.get(rt.trainer.__ray_call__.remote(
            lambda a: (a.trainer.version, sorted(a.trainer.named_weights()),
                       a.trainer.merged_state_dict())))
        engines = {}
        for wid, w in rt.workers.items():  # before `finish` stops the rollouts' loops
            assert answer(w.sync_to.remote(version), f"{wid} to hold version {version}") >= version
            engines[wid] = ray.get(w.__ray_call__.remote(
                lambda a: {k: v.clone() for k, v in a.loop.engine.model.state_dict().items()}))
        report = finish(rt, follower)
    assert steps == cfg.trainer.total_steps
    [mark] = _check_lineage(cfg, report, steps)
    assert mark["resumed_at"] >= 2
    adapted = {n.removesuffix(".lora_A") + ".weight" for n in pushed if n.endswith(".lora_A")}
    assert adapted and all(".lora_" in n for n in pushed)
    for wid, weights in engines.items():
        for name in adapted:
            assert torch.allclose(weights[name], merged[name], atol=1e-6, rtol=0), (wid, name)


def test_a_trainer_killed_right_after_a_checkpoint_trains_nothing_twice(tmp_path, ray_cluster):
    """The kill that failed the test above one run in five: after the checkpoint of update 4,
    before the buffer had its acknowledgement and before update 4's audit lines were written.
    The restarted trainer got back the groups of updates 3 and 4 (in the checkpoint already:
    trained twice), and update 4's groups were missing from the audit. Now the audit lines come
    before the checkpoint and the buffer gives back only what was taken after the checkpoint's
    version."""
    cfg = load_config(None, TINY + [f"run_dir={tmp_path}", "trainer.total_steps=6",
                                    "trainer.checkpoint_every=2"])
    with _runtime(cfg) as rt:
        training = rt.train("run")
        follower = Follower(rt)
        pid = rt.trainer_pid()
        until("the checkpoint of step 4", (tmp_path / "checkpoints" / "step_000004").exists, poll_s=0.001)
        os.kill(pid, signal.SIGKILL)
        steps = follower.follow(lambda: rt.train("run"), started=training)
        report = finish(rt, follower)
    assert steps == cfg.trainer.total_steps
    [mark] = _check_lineage(cfg, report, steps)
    assert mark["resumed_at"] == 4


def test_a_relay_killed_mid_broadcast_is_cut_out_and_its_successor_catches_up(tmp_path, ray_cluster):
    cfg = load_config(None, TINY + RELAYS + [f"run_dir={tmp_path}", "cluster.virtual_nodes=3",
                                             "rollout.num_workers=3"])
    with _runtime(cfg) as rt:  # chain node0 -> node1 -> node2; rollout1 pulls from node1
        training = rt.train("run")
        follower = Follower(rt)
        _wait_version(rt, 2)
        pid = rt.relays.pids["node1"]
        os.kill(pid, signal.SIGSTOP)  # node1 forwards nothing from now on
        until("a version node1 has not forwarded", lambda: _latest(rt, "node0") > _latest(rt, "node2"))
        in_flight = _latest(rt, "node0")
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)  # mid-broadcast: node0 holds a version node2 lacks
        fault = _fault(rt, "relay", "node1")
        assert not fault["master"] and fault["chain"] == ["node0", "node2"]
        until("node2 to get the version node1 had not forwarded", lambda: _latest(rt, "node2") >= in_flight)
        rollout1 = rt.workers["rollout1"]
        until("rollout1 to pull through node0",
              lambda: max(ray.get(rollout1.snapshot.remote()).counters.versions) > in_flight)
        version = _then_stop(rt, follower, training)
        report = finish(rt, follower)
    print(f"relay node1 killed mid-broadcast: detected {fault['detected_at'] - killed_at:.3f}s after "
          f"the kill, chain re-planned {fault['repaired_at'] - fault['detected_at']:.3f}s after that")
    assert report["manager"]["chain"] == ["node0", "node2"] and report["manager"]["dead_relays"] == 1
    assert ("chain", "relay") in _events(tmp_path)
    _check_nothing_lost(cfg, report, version)


@pytest.mark.slow  # replacing the master is test_relay_ray's too (relay actors, in the default suite)
def test_a_killed_master_relay_is_replaced_by_its_successor(tmp_path, ray_cluster):
    cfg = load_config(None, TINY + RELAYS + [f"run_dir={tmp_path}"])
    with _runtime(cfg) as rt:  # chain node0 (master) -> node1; rollout0 pulls from node0
        training = rt.train("run")
        follower = Follower(rt)
        _wait_version(rt, 2)
        killed_at, at_kill = time.time(), _version(rt)
        os.kill(rt.relays.pids["node0"], signal.SIGKILL)
        fault = _fault(rt, "relay", "node0")
        assert fault["master"] and fault["chain"] == ["node1"]
        until("a new version at the new master", lambda: _latest(rt, "node1") > at_kill)
        rollout0 = rt.workers["rollout0"]
        until("rollout0 to pull from node1",
              lambda: max(ray.get(rollout0.snapshot.remote()).counters.versions) > at_kill)
        version = _then_stop(rt, follower, training)
        report = finish(rt, follower)
    print(f"master relay node0 killed: detected {fault['detected_at'] - killed_at:.3f}s after the "
          f"kill, chain re-planned {fault['repaired_at'] - fault['detected_at']:.3f}s after that")
    assert report["manager"]["chain"] == ["node1"] and report["manager"]["dead_relays"] == 1
    _check_nothing_lost(cfg, report, version)
