"""Failure isolation and elasticity with real actors: a killed rollout (SIGKILL on its process)
loses nothing and does not stop training; rollouts join and leave a running job; a killed
trainer or relay process is recovered from."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter

import ray

from laminar.config import load_config
from laminar.metrics import read_rows
from laminar.modes import schedule
from laminar.modes.common import start_weights
from laminar.modes.driver import Follower, finish
from laminar.runtime.cluster import ClusterRuntime

TINY = ["sft.enabled=false", "task.reverse.max_len=12", "rollout.max_new_tokens=13",
        "rollout.group_size=2", "rollout.num_workers=2", "cluster.virtual_nodes=2",
        "rollout.batch_groups=2", "trainer.prompts_per_step=4", "trainer.threads=1",
        "rollout.engine.max_batch_size=8", "cluster.wait_timeout_s=120",
        "cluster.heartbeat_s=0.5", "manager.interval_s=0.2", "mode=laminar",
        "rollout.max_outstanding_batches=2"]


def _runtime(cfg):
    model_dir, _ = start_weights(cfg)
    return ClusterRuntime(cfg, model_dir, 0, schedule("laminar").policy(cfg))


def _wait(what, done, timeout=120):
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _wait_version(rt, version, timeout=120):
    deadline = time.monotonic() + timeout
    while len(ray.get(rt.trainer.metrics_since.remote(0))) < version:
        assert time.monotonic() < deadline, f"trainer did not reach version {version}"
        time.sleep(0.05)


def _check_nothing_lost(cfg, report, steps):
    trained = [json.loads(line) for line in
               (cfg.resolved_run_dir / "trajectories.jsonl").read_text().splitlines()]
    trained = [t for t in trained if "traj_id" in t]
    assert len({t["traj_id"] for t in trained}) == len(trained)
    assert set(Counter(t["group_id"] for t in trained).values()) == {cfg.rollout.group_size}
    acct = report["prompts"]
    assert acct["issued"] == acct["leased"] + acct["returned"] + acct["completed"]
    assert acct["consumed"] == steps * cfg.trainer.prompts_per_step
    assert all(t["token_versions"] is None for t in trained)  # still one version each


def test_a_killed_rollout_loses_nothing_and_training_goes_on(tmp_path, ray_cluster):
    cfg = load_config(None, TINY + [f"run_dir={tmp_path}", "trainer.total_steps=500"])
    with _runtime(cfg) as rt:
        training = rt.train("run")
        follower = Follower(rt)
        _wait_version(rt, 1)
        victim = rt.workers["rollout0"]
        pid = ray.get(victim.pid.remote())
        _wait("rollout0 to have work in flight",  # kill it mid-generation
              lambda: ray.get(victim.snapshot.remote()).num_in_flight > 0, timeout=60)
        os.kill(pid, signal.SIGKILL)  # the real process
        _wait("the manager to fail rollout0 over", lambda: rt.manager_stats()["dead_workers"] == 1)
        _wait_version(rt, len(ray.get(rt.trainer.metrics_since.remote(0))) + 2)  # training goes on
        rt.trainer.stop.remote()
        version = follower.follow(lambda: rt.train("run"), started=training)
        report = finish(rt, follower)
    manager = report["manager"]
    assert manager["dead_workers"] == 1 and manager["dead"] == ["rollout0"]
    assert manager["failover_trajectories"] > 0  # its in-flight work continued elsewhere
    assert report["heldout_last"]["step"] == version  # the held-out schedule survived the kill
    _check_nothing_lost(cfg, report, version)


def test_rollouts_join_and_leave_a_running_job(tmp_path, ray_cluster):
    cfg = load_config(None, TINY + [f"run_dir={tmp_path}", "trainer.total_steps=500"])
    with _runtime(cfg) as rt:
        training = rt.train("run")
        follower = Follower(rt)
        _wait_version(rt, 1)
        wid = rt.add_worker()
        joined = rt.workers[wid]
        _wait("the new rollout to finish a trajectory",
              lambda: ray.get(joined.snapshot.remote()).counters.finished > 0)
        rt.retire_worker("rollout0")
        at_retire = len(ray.get(rt.trainer.metrics_since.remote(0)))
        _wait_version(rt, at_retire + 2)  # training goes on without rollout0
        rt.trainer.stop.remote()
        version = follower.follow(lambda: rt.train("run"), started=training)
        snap = ray.get(joined.snapshot.remote())
        report = finish(rt, follower)
    assert wid == "rollout2"
    assert snap.counters.versions[0] == 0 and len(snap.counters.versions) >= 2
    assert report["manager"]["retired_workers"] == 1
    events = {(e["what"], e["detail"].split()[1]) for e in read_rows(tmp_path, "event")}
    assert {("join", "rollout2"), ("leave", "rollout0")} <= events
    _check_nothing_lost(cfg, report, version)


def test_a_killed_trainer_restarts_from_its_checkpoint_and_loses_no_data(tmp_path, ray_cluster):
    cfg = load_config(None, TINY + [f"run_dir={tmp_path}", "trainer.total_steps=6",
                                    "trainer.checkpoint_every=2"])
    with _runtime(cfg) as rt:
        training = rt.train("run")
        follower = Follower(rt)
        _wait_version(rt, 3)  # a checkpoint at 2, one update after it
        os.kill(rt.trainer_pid(), signal.SIGKILL)  # the real process
        assert follower.follow(lambda: rt.train("run"), started=training) == cfg.trainer.total_steps
        report = finish(rt, follower)
    lines = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    restart = next(i for i, line in enumerate(lines) if line.get("event") == "trainer_restart")
    mark = lines[restart]
    # the kill lands at version 3 or later (a slow poll may let the trainer checkpoint at 4)
    resumed = mark["resumed_at"]
    assert resumed >= 2 and resumed % cfg.trainer.checkpoint_every == 0
    # what was trained after the checkpoint is lost with the process: its groups go back
    lost = {t["group_id"] for t in lines[:restart] if t["trained_at"] >= resumed}
    assert mark["requeued_groups"] >= len(lost)
    # the model's lineage: what was trained up to the checkpoint, then everything after the restart
    kept = [t for t in lines[:restart] if t["trained_at"] < resumed] + lines[restart + 1:]
    assert len({t["traj_id"] for t in kept}) == len(kept)  # nothing trained twice in the lineage
    groups = Counter(t["group_id"] for t in kept)
    assert set(groups.values()) == {cfg.rollout.group_size}
    # updates pushed after the checkpoint are lost; numbering goes on after the newest published
    updates = mark["resumed_at"] + cfg.trainer.total_steps - mark["continues_at"]
    assert len(groups) == updates * cfg.trainer.prompts_per_step
    acct = report["prompts"]
    assert acct["issued"] == acct["leased"] + acct["returned"] + acct["completed"]


def test_a_killed_relay_is_cut_out_and_training_goes_on(tmp_path, ray_cluster):
    cfg = load_config(None, TINY + [f"run_dir={tmp_path}", "trainer.total_steps=30",
                                    "relay.heartbeat_s=0.2", "relay.timeout_s=2"])
    with _runtime(cfg) as rt:
        training = rt.train("run")
        follower = Follower(rt)
        _wait_version(rt, 2)
        os.kill(rt.relays.pids["node1"], signal.SIGKILL)  # rollout1's relay, the chain's tail
        # the manager notices at its next relay check and repairs the chain
        assert follower.follow(lambda: rt.train("run"), started=training) == cfg.trainer.total_steps
        snap = ray.get(rt.workers["rollout1"].snapshot.remote())
        manager = rt.manager_stats()
        report = finish(rt, follower)
    assert manager["chain"] == ["node0"] and manager["dead_relays"] == 1
    assert max(snap.counters.versions) >= 3  # rollout1 kept pulling new versions via node0
    _check_nothing_lost(cfg, report, cfg.trainer.total_steps)
