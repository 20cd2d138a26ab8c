"""The trainer group on a real Ray cluster: `laminar train` with two trainer ranks (the
process group, placement group, shard push to the master relay and sharded checkpoints all
real), a killed rank restarting the group, and the errors a user can make."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter

import pytest
import ray

from laminar.config import ConfigError, load_config
from laminar.metrics import read_metrics
from laminar.modes import run_training
from test_faults import TINY as FAULTS_TINY
from test_faults import _check_lineage, _runtime, _wait_version
from test_runtime import TINY
from waiting import until

TWO = ["trainer.world_size=2", "trainer.threads=1"]


@pytest.mark.slow  # two ranks = one rank is pinned by test_trainer_dist in the default suite
def test_laminar_train_with_two_trainer_ranks(tmp_path, ray_cluster):
    cfg = load_config(None, TINY + TWO + ["mode=laminar", f"run_dir={tmp_path}",
                                          "trainer.checkpoint_every=2"])
    report = run_training(cfg)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["push_stall_s"] > 0 and r["loss"] == r["loss"] for r in rows)  # pushed; not NaN
    for r in rows:  # the ranks' fresh tokens (when a step has some) against the native engine
        assert r["engine_backend"] == "native"
        assert r["logprob_abs_diff_p99"] is None or 0.0 <= r["logprob_abs_diff_p99"] < 1e-4
    assert report["exactly_once"]["ok"]
    trained = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert set(Counter(t["group_id"] for t in trained).values()) == {2}
    assert len(trained) == 3 * 4 * 2
    for step in (2, 3):  # sharded checkpoints with their Hugging Face export
        ckpt = tmp_path / "checkpoints" / f"step_{step:06d}"
        assert (ckpt / "dcp" / ".metadata").is_file() and (ckpt / "model" / "model.safetensors").is_file()
    assert report["heldout_last"]["version"] >= 3  # a rollout evaluated a version the ranks pushed


@pytest.mark.slow
def test_a_killed_rank_restarts_the_trainer_group_from_its_checkpoint(tmp_path, ray_cluster):
    """SIGKILL rank 1 after the checkpoint of update 2: rank 0's next collective fails, it
    exits, Ray starts it again, and the new group loads the checkpoint (at world size 2) and
    trains on; the lineage holds every group once."""
    from laminar.modes.driver import Follower, finish

    cfg = load_config(None, FAULTS_TINY + TWO + [f"run_dir={tmp_path}", "trainer.total_steps=6",
                                                 "trainer.checkpoint_every=2"])
    with _runtime(cfg) as rt:
        training = rt.train("run")
        follower = Follower(rt)
        rank0, rank1 = ray.get(rt.trainer.pids.remote())
        _wait_version(rt, 3)
        os.kill(rank1, signal.SIGKILL)
        steps = follower.follow(lambda: rt.train("run"), started=training)
        pids = until("the new trainer group", lambda: _pids(rt))
        report = finish(rt, follower)
    assert steps == cfg.trainer.total_steps
    assert rank0 not in pids and rank1 not in pids and len(pids) == 2
    [mark] = _check_lineage(cfg, report, steps)
    assert mark["resumed_at"] >= 2 and mark["resumed_at"] % cfg.trainer.checkpoint_every == 0


def _pids(rt):
    try:
        return ray.get(rt.trainer.pids.remote(), timeout=30)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # restarting
        return None


def test_a_world_size_the_cluster_cannot_hold_is_one_clear_error(tmp_path, ray_cluster):
    cpus = int(ray.cluster_resources()["CPU"])
    cfg = load_config(None, TINY + [f"run_dir={tmp_path}", f"trainer.world_size={cpus + 1}",
                                    "trainer.threads=1"])
    with pytest.raises(ConfigError) as e:
        run_training(cfg)
    message = str(e.value)
    assert f"trainer.world_size={cpus + 1}: {cpus + 1} trainer ranks of {{CPU: 1}} each do not " \
           f"fit: only {cpus} can be placed" in message
    assert "lower trainer.world_size or trainer.threads" in message
    assert not ray.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_the_one_process_backend_refuses_several_ranks():
    with pytest.raises(ConfigError, match=r"trainer.world_size=2 starts one trainer process per "
                                          r"rank, which needs cluster.backend=ray"):
        load_config(None, ["trainer.world_size=2", "cluster.backend=local"])


def test_a_rank_that_does_not_see_the_run_directory_is_one_clear_error(tmp_path):
    """On a cluster without a shared filesystem the ranks' checkpoint shards would land on
    different disks: a rank refuses to start unless it reads the token rank 0 wrote."""
    from laminar.trainer.actor import SEEN, TrainerRank

    cfg = load_config(None, [f"run_dir={tmp_path}", *TWO])
    with pytest.raises(ConfigError, match=r"trainer rank 1 on .* does not see the run directory "
                                          r".*set run_dir to a folder every trainer node mounts"):
        TrainerRank(cfg, None, 1).start("127.0.0.1", 1, "token")
    (tmp_path / SEEN).write_text("another group's token")
    with pytest.raises(ConfigError, match="does not see the run directory"):
        TrainerRank(cfg, None, 1).start("127.0.0.1", 1, "token")


@pytest.mark.slow
def test_two_trainer_ranks_on_two_nodes(tmp_path):
    """A namespaced cluster of two nodes (own IP, own /dev/shm and /tmp each): rank 0 on the
    head with the master relay, rank 1 spread to the other node. With RUN_DIR in /tmp the
    other node cannot see it: one clear error. With RUN_DIR on the shared disk the job trains:
    gloo across the veth, the model shipped to rank 1, the push gathered on rank 0 (rank 1
    cannot map the head's shared memory), the sharded checkpoints side by side. With
    cluster.trainer_placement=pack both ranks sit on the head and write their own rows."""
    import shutil
    import subprocess
    import sys
    import uuid
    from pathlib import Path

    from laminar.devcluster.nscluster import NamespacedCluster

    ok, why = NamespacedCluster.available()
    if not ok:
        pytest.skip(f"namespaced cluster unavailable: {why}")
    repo = Path(__file__).parent.parent
    shared = repo / ".cache" / f"test-trainer-ranks-{uuid.uuid4().hex[:6]}"
    # short name: Ray's socket paths; 2 CPUs a node, so that `pack` can put both ranks on one
    cluster = NamespacedCluster(2, name=f"tr{os.getpid()}", cpus_per_node=2)

    def train(run_dir, *extra):
        cmd = [sys.executable, "-m", "laminar.cli", "train", "examples/reverse.yaml",
               f"cluster.address={cluster.address}", f"run_dir={run_dir}", *TINY, *TWO, *extra,
               "mode=laminar", "trainer.total_steps=4", "trainer.checkpoint_every=2",
               "metrics.live=off", "metrics.tensorboard=false"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=repo)
    try:
        cluster.up()
        private = train(tmp_path / "run")
        assert private.returncode == 2 and "Traceback" not in private.stderr, private.stderr[-3000:]
        assert f"trainer rank 1 on {cluster.node_ips[1]} does not see the run directory" in private.stderr
        good = train(shared / "run")
        out = good.stdout + good.stderr
        assert good.returncode == 0, out[-4000:]
        assert "exactly-once check: passed" in good.stdout
        assert "rank 0 gathers the rows (ranks [1] are on another machine)" in out
        ckpts = sorted(p.relative_to(shared) for p in (shared / "run" / "checkpoints").rglob("*"))
        for step in (2, 4):
            assert (shared / "run" / "checkpoints" / f"step_{step:06d}" / "dcp" / ".metadata").is_file(), ckpts
        assert len(list((shared / "run" / "checkpoints" / "step_000004" / "dcp").glob("*.distcp"))) == 2
        packed = train(shared / "packed", "cluster.trainer_placement=pack")
        out = packed.stdout + packed.stderr
        assert packed.returncode == 0, out[-4000:]
        assert "each of the 2 ranks writes its own rows" in out
    finally:
        cluster.down()
        shutil.rmtree(shared, ignore_errors=True)
