"""Relays as Ray actors (one per node in a real cluster), with a real tiny model end to end."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import torch

from laminar.config import RelayConfig
from laminar.engine.hf import HFEngine
from laminar.models.builder import build_preset
from laminar.relay.client import Puller, Pusher
from laminar.relay.actor import RelayGroup
from waiting import until

SECRET = b"ray-test-secret"


def wait_latest(ray, actor, version: int) -> None:
    def latest():
        return (ray.get(actor.latest.remote()) or {}).get("version")
    until(f"the relay to reach version {version}", lambda: latest() == version,
          seen=lambda: f"version {latest()}")


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_relay_actors_broadcast_repair_and_replace_the_master(ray_cluster):
    ray = ray_cluster
    job = f"ray{uuid.uuid4().hex[:6]}"
    # timeouts no loaded machine reaches: nothing here is meant to be declared dead
    cfg = RelayConfig(timeout_s=60.0, heartbeat_s=0.5, chunk_bytes=128 << 10)
    group = RelayGroup(["a", "b", "c"], job, SECRET, cfg)
    try:
        trainer_model = build_preset("tiny", seed=1)
        pusher = Pusher(group.plan, SECRET, cfg)
        assert pusher.push(trainer_model.state_dict(), 1).master == "a"
        for actor in group.actors.values():
            wait_latest(ray, actor, 1)

        # a rollout on node c: ask cheaply, then copy into a model and into an engine
        rollout_model = build_preset("tiny", seed=2)
        puller = Puller(group.infos["c"], cfg)
        assert puller.newest_version() == 1
        assert not same_weights(rollout_model, trainer_model)
        assert puller.pull_latest(rollout_model) == 1
        assert same_weights(rollout_model, trainer_model)
        assert puller.pull_latest(rollout_model) is None  # nothing newer
        engine = HFEngine(build_preset("tiny", seed=3), eos_token_id=2, pad_token_id=0)
        assert Puller(group.infos["b"], cfg).pull_latest(engine) == 1
        assert engine.version == 1 and same_weights(engine.model, trainer_model)

        # the actor's own publish (a trainer on another machine would call this through Ray)
        with torch.no_grad():
            for p in trainer_model.parameters():
                p.add_(1.0)
        ray.get(group.actors["a"].publish.remote(trainer_model.state_dict(), 2))
        wait_latest(ray, group.actors["c"], 2)
        assert puller.pull_latest(rollout_model) == 2 and same_weights(rollout_model, trainer_model)

        # a middle relay's process dies: the group notices and the chain carries on without it
        os.kill(group.pids["b"], signal.SIGKILL)
        assert group.check() == ["b"]
        assert group.plan.order == ("a", "c")
        pusher.set_plan(group.plan)
        pusher.push(trainer_model.state_dict(), 3)
        wait_latest(ray, group.actors["c"], 3)

        # the master dies: the next push goes to its successor
        os.kill(group.pids["a"], signal.SIGKILL)  # its sockets close with the process
        result = pusher.push(trainer_model.state_dict(), 4)
        assert (result.master, result.failed_masters) == ("c", ["a"])
        assert group.check() == ["a"] and group.master == "c"
        assert puller.pull_latest(rollout_model) == 4
    finally:
        group.shutdown()
    assert not list(Path("/dev/shm").glob(f"lam-{job}-*"))


def test_a_link_cut_between_two_live_relays_is_tried_again(ray_cluster):
    """Relay b is frozen (SIGSTOP) while a feeds it a version: a's handshake times out and a
    cuts b out of its own plan, feeding c. b then thaws and answers heartbeats again, but no
    one feeds it: the group's next check sees a link cut between two live relays, gives the
    relays the group's plan back, and b gets the next version (before, it kept its last one
    for good, and so did its rollouts)."""
    from laminar.relay.actor import cut_links

    ray = ray_cluster
    job = f"ray{uuid.uuid4().hex[:6]}"
    # a's handshake with the frozen b times out after 5 s; a live relay answers well within it
    cfg = RelayConfig(timeout_s=5.0, heartbeat_s=0.2, chunk_bytes=64 << 10)
    group = RelayGroup(["a", "b", "c"], job, SECRET, cfg)
    state = build_preset("tiny", seed=1).state_dict()
    try:
        pusher = Pusher(group.plan, SECRET, cfg)
        pusher.push(state, 1)
        for actor in group.actors.values():
            wait_latest(ray, actor, 1)
        os.kill(group.pids["b"], signal.SIGSTOP)
        try:
            pusher.push(state, 2)
            until("a to cut the frozen b out",
                  lambda: ray.get(group.actors["a"].heartbeat.remote())["successor"] == "c")
            wait_latest(ray, group.actors["c"], 2)  # a feeds c directly now
        finally:
            os.kill(group.pids["b"], signal.SIGCONT)
        beats = {i: ray.get(a.heartbeat.remote()) for i, a in group.actors.items()}
        assert cut_links(group.plan, {i: b["successor"] for i, b in beats.items()}) == [("a", "b")]
        # b answers: not dead; the group's check gives the relays its plan back
        until("the group's check to link a to b again", lambda: group.find_dead() == [] and
              ray.get(group.actors["a"].heartbeat.remote())["successor"] == "b")
        pusher.push(state, 3)
        for relay in ("b", "c"):
            wait_latest(ray, group.actors[relay], 3)
    finally:
        group.shutdown()


def test_a_cut_link_is_tried_at_once_then_less_and_less_often():
    from laminar.relay.actor import links_due

    link, other = ("a", "b"), ("b", "c")
    due, plan = links_due([link], {}, now=100.0)
    assert due == [link] and plan == {link: (110.0, 10.0)}
    assert links_due([link], plan, now=105.0) == ([], plan)  # not yet
    due, plan = links_due([link, other], plan, now=110.0)
    assert due == [link, other] and plan == {link: (130.0, 20.0), other: (120.0, 10.0)}
    for _ in range(10):
        _, plan = links_due([link], plan, now=plan[link][0])
    assert plan[link][1] == 300.0  # capped
    assert links_due([], plan, now=10_000.0) == ([], {})  # healed: forgotten
