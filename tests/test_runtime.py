"""The asynchronous runtime with real Ray actors, relays and the tiny model: every schedule
reaches N steps without losing or duplicating a prompt group; versions and staleness are what
the schedule promises; a rollout pulls new weights while the trainer is busy."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import ray

from laminar.config import load_config
from laminar.metrics import read_metrics, read_rows
from laminar.modes import MODES, run_training, schedule
from laminar.modes.common import start_weights
from waiting import answer
from laminar.runtime.cluster import ClusterRuntime
from laminar.runtime.placement import place

TINY = ["sft.enabled=false", "task.reverse.max_len=8", "rollout.max_new_tokens=9",
        "rollout.group_size=2", "rollout.num_workers=2", "cluster.virtual_nodes=2",
        "rollout.batch_groups=2", "trainer.prompts_per_step=4", "trainer.mini_batches=2",
        "trainer.threads=1", "trainer.total_steps=3", "rollout.engine.max_batch_size=8",
        "cluster.wait_timeout_s=120", "manager.interval_s=0.2", "task.eval_prompts=8"]


def test_place_one_relay_per_node():
    p = place(num_workers=5, virtual_nodes=2)
    assert p.relay_ids == ["node0", "node1"]
    assert p.worker_relay == {"rollout0": "node0", "rollout1": "node1", "rollout2": "node0",
                              "rollout3": "node1", "rollout4": "node0"}
    # a cluster: master relay on the driver's node "b"; rollouts on the other nodes, one relay each
    real = place(num_workers=3, virtual_nodes=1, ray_nodes=["a", "b", "c", "d"], head="b")
    assert real.relay_ids == ["node0", "node1", "node2", "node3"]
    assert real.relay_node == {"node0": "b", "node1": "a", "node2": "c", "node3": "d"}
    assert real.worker_relay == {"rollout0": "node1", "rollout1": "node2", "rollout2": "node3"}
    # fewer rollouts than nodes: a node without rollouts gets no relay
    few = place(num_workers=2, virtual_nodes=1, ray_nodes=["a", "b", "c", "d"], head="a")
    assert few.relay_node == {"node0": "a", "node1": "b", "node2": "c"}
    # the head hosts rollouts when asked, or when it is the only node
    shared = place(num_workers=3, virtual_nodes=1, ray_nodes=["a", "b"], head="a", rollouts_on_head=True)
    assert shared.worker_relay == {"rollout0": "node0", "rollout1": "node1", "rollout2": "node0"}
    alone = place(num_workers=2, virtual_nodes=1, ray_nodes=["a"], head="a")
    assert alone.relay_ids == ["node0"] and set(alone.worker_relay.values()) == {"node0"}


def _trained(run_dir):
    return [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]


# one_step, stream and partial run in the slow set: their policies are unit-tested in
# test_rollout_loop; the default suite keeps sync and laminar end to end on Ray
SLOW_MODES = ("one_step", "stream", "partial")


@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW_MODES else m
                                  for m in MODES])
def test_every_mode_reaches_n_steps_and_loses_nothing(mode, tmp_path, ray_cluster):
    cfg = load_config(None, TINY + [f"mode={mode}", f"run_dir={tmp_path}"])
    report = run_training(cfg)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]

    trained = _trained(tmp_path)
    assert len({t["traj_id"] for t in trained}) == len(trained)  # no sample trained twice
    per_group = Counter(t["group_id"] for t in trained)
    assert set(per_group.values()) == {2}  # whole GRPO groups only
    acct, buffer = report["prompts"], report["buffer"]
    assert len(per_group) == acct["consumed"] == 3 * 4
    # every group ever leased: trained, waiting in the buffer, in flight, or returned (pending)
    assert acct["issued"] == acct["leased"] + acct["returned"] + acct["completed"]
    assert acct["completed"] == acct["consumed"] + buffer["ready_groups"]

    for t in trained:  # staleness is trainer version at consumption - generating version
        assert t["staleness"] == t["trained_at"] - t["version"]
    if mode == "sync":
        assert {t["staleness"] for t in trained} == {0}
    if mode in ("one_step", "stream"):
        assert {t["staleness"] for t in trained} <= {0, 1}
    if mode != "partial":  # one trajectory, one version
        assert all(t["token_versions"] is None for t in trained)

    # held-out evaluation in every mode: at the start (step 0) and the end, each on one version
    evals = read_rows(tmp_path, "eval")
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 3 and evals[-1]["version"] >= 3
    assert all(e["num_prompts"] == cfg.task.eval_prompts for e in evals)
    assert report["heldout_last"] == evals[-1]
    spans = read_rows(tmp_path, "span")  # the timeline: every rollout and the trainer
    assert {s["who"] for s in spans} == {"rollout0", "rollout1", "trainer"}
    assert all(s["end"] >= s["start"] for s in spans)


def test_rollout_pulls_newest_version_while_trainer_is_mid_step(tmp_path, ray_cluster):
    cfg = load_config(None, TINY + ["mode=sync", f"run_dir={tmp_path}"])
    model_dir, _ = start_weights(cfg)
    with ClusterRuntime(cfg, model_dir, 0, schedule("sync").policy(cfg)) as rt:
        a, b = rt.workers.values()
        ray.get(a.generate_groups.remote(4))
        ray.get(rt.trainer.train_once.remote())  # version 1 is at the master relay
        busy = rt.trainer.train_once.remote()  # mid-step: waits for its next global batch
        assert ray.get(a.sync_to.remote(1)) == 1  # (the rollout's own deadline: wait_timeout_s)
        assert ray.get(b.sync_to.remote(1)) == 1  # the other node: via the chain
        ready, _ = ray.wait([busy], timeout=0)
        assert not ready  # the pulls did not need the trainer
        ray.get(b.generate_groups.remote(4))
        assert answer(busy, "the trainer's second update")["version"] == 2
        snaps = {w: ray.get(h.snapshot.remote()) for w, h in rt.workers.items()}
        assert snaps["rollout0"].counters.versions == [0, 1]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two cores")
def test_a_job_that_lends_the_trainers_cores_trains_and_cleans_up(tmp_path, ray_cluster):
    """cluster.cpu_affinity=lend end to end: the trainer pinned, the rollouts on the other core
    and borrowing the trainer's while it waits; every step trained, nothing twice, the flag
    gone at the end, this process's cores untouched."""
    from laminar.cores import loan_path

    before = os.sched_getaffinity(0)
    cfg = load_config(None, TINY + ["mode=laminar", "cluster.cpu_affinity=lend",
                                    f"run_dir={tmp_path}"])
    run_training(cfg)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    trained = _trained(tmp_path)
    assert len({t["traj_id"] for t in trained}) == len(trained)
    assert not os.path.exists(loan_path(cfg.resolved_run_dir))
    assert os.sched_getaffinity(0) == before
