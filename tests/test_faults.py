"""Failure isolation and elasticity with real actors: a killed rollout loses nothing and does not
stop training; rollouts join and leave a running job."""

from __future__ import annotations

import json
import time
from collections import Counter

import ray

from laminar.config import load_config
from laminar.modes.common import start_weights
from laminar.modes.driver import Follower, finish
from laminar.runtime import Runtime

TINY = ["sft.enabled=false", "task.reverse.max_len=12", "rollout.max_new_tokens=13",
        "rollout.group_size=2", "rollout.num_workers=2", "cluster.virtual_nodes=2",
        "rollout.batch_groups=2", "trainer.prompts_per_step=4", "trainer.threads=1",
        "rollout.engine.max_batch_size=8", "cluster.wait_timeout_s=120",
        "cluster.heartbeat_s=0.5", "manager.interval_s=0.2", "mode=laminar"]


def _start(rt, cfg):
    loops = [w.run_free.remote("laminar") for w in rt.workers.values()]
    loops.append(rt.manager.run.remote(repack=True))
    return loops, rt.trainer.run.remote(cfg.trainer.total_steps)


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
    cfg = load_config(None, TINY + [f"run_dir={tmp_path}", "trainer.total_steps=5"])
    model_dir, _ = start_weights(cfg)
    with Runtime(cfg, model_dir, max_outstanding=8) as rt:
        loops, training = _start(rt, cfg)
        follower = Follower(rt, cfg)
        _wait_version(rt, 1)
        victim = rt.workers["rollout0"]
        deadline = time.monotonic() + 60
        while ray.get(victim.snapshot.remote())["num_reqs"] == 0:  # kill it mid-generation
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ray.kill(victim, no_restart=True)
        assert follower.follow(lambda: rt.trainer.run.remote(cfg.trainer.total_steps),
                               started=training) == cfg.trainer.total_steps
        report = finish(rt, cfg, loops)
    manager = report["manager"]
    assert manager["dead_workers"] == 1 and manager["dead"] == ["rollout0"]
    assert manager["failover_trajectories"] > 0  # its in-flight work continued elsewhere
    _check_nothing_lost(cfg, report, cfg.trainer.total_steps)


def test_rollouts_join_and_leave_a_running_job(tmp_path, ray_cluster):
    cfg = load_config(None, TINY + [f"run_dir={tmp_path}", "trainer.total_steps=500"])
    model_dir, _ = start_weights(cfg)
    with Runtime(cfg, model_dir, max_outstanding=8) as rt:
        loops, training = _start(rt, cfg)
        follower = Follower(rt, cfg)
        _wait_version(rt, 1)
        wid, joined = rt.add_worker()
        loops.append(joined.run_free.remote("laminar"))
        deadline = time.monotonic() + 120
        while ray.get(joined.snapshot.remote())["counters"]["finished"] == 0:
            assert time.monotonic() < deadline, "the new rollout never finished a trajectory"
            time.sleep(0.05)
        ray.get(rt.manager.retire.remote("rollout0"), timeout=120)
        at_retire = len(ray.get(rt.trainer.metrics_since.remote(0)))
        _wait_version(rt, at_retire + 2)  # training goes on without rollout0
        rt.trainer.stop.remote()
        version = follower.follow(lambda: rt.trainer.run.remote(cfg.trainer.total_steps),
                                  started=training)
        snap = ray.get(joined.snapshot.remote())
        report = finish(rt, cfg, loops)
    assert wid == "rollout2"
    assert snap["counters"]["versions"][0] == 0 and len(snap["counters"]["versions"]) >= 2
    assert report["manager"]["retired_workers"] == 1
    _check_nothing_lost(cfg, report, version)


def test_a_killed_trainer_restarts_from_its_checkpoint_and_loses_no_data(tmp_path, ray_cluster):
    import os
    import signal

    cfg = load_config(None, TINY + [f"run_dir={tmp_path}", "trainer.total_steps=6",
                                    "trainer.checkpoint_every=2"])
    model_dir, _ = start_weights(cfg)
    with Runtime(cfg, model_dir, max_outstanding=8) as rt:
        loops, training = _start(rt, cfg)
        follower = Follower(rt, cfg)
        _wait_version(rt, 3)  # a checkpoint at 2, one update after it
        os.kill(ray.get(rt.trainer.pid.remote()), signal.SIGKILL)  # the real process
        assert follower.follow(lambda: rt.trainer.run.remote(cfg.trainer.total_steps),
                               started=training) == cfg.trainer.total_steps
        report = finish(rt, cfg, loops)
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
    import os
    import signal

    cfg = load_config(None, TINY + [f"run_dir={tmp_path}", "trainer.total_steps=30",
                                    "relay.heartbeat_s=0.2", "relay.timeout_s=2"])
    model_dir, _ = start_weights(cfg)
    with Runtime(cfg, model_dir, max_outstanding=8) as rt:
        loops, training = _start(rt, cfg)
        follower = Follower(rt, cfg)
        _wait_version(rt, 2)
        os.kill(rt.relays.pids["node1"], signal.SIGKILL)  # rollout1's relay, the chain's tail
        # the driver's follow loop notices at its next relay check and repairs the chain
        assert follower.follow(lambda: rt.trainer.run.remote(cfg.trainer.total_steps),
                               started=training) == cfg.trainer.total_steps
        snap = ray.get(rt.workers["rollout1"].snapshot.remote())
        order = list(rt.relays.plan.order)
        report = finish(rt, cfg, loops)
    assert order == ["node0"]
    assert max(snap["counters"]["versions"]) >= 3  # rollout1 kept pulling new versions via node0
    _check_nothing_lost(cfg, report, cfg.trainer.total_steps)
