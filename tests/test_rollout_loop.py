"""The rollout loop without Ray: the real engine on the tiny model, the real pools behind the
in-process doors, and each schedule's policy. Admission, drain on a new version, pull,
interrupt, export/adopt, and a finished trajectory carrying the version that generated it."""

from __future__ import annotations

import pytest

from laminar.config import load_config
from laminar.modes import schedule
from laminar.rollout.policy import LoopState
from harness import World, step_until

OVERRIDES = ["sft.enabled=false", "task.reverse.max_len=6", "rollout.max_new_tokens=7",
             "rollout.group_size=2", "rollout.batch_groups=2", "rollout.stream_every=2",
             "rollout.stream_interval_s=0", "rollout.version_lag=2", "trainer.prompts_per_step=2",
             "rollout.max_outstanding_batches=4"]
CFG = load_config(None, OVERRIDES)
pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------- policies, pure


def state(**kw) -> LoopState:
    base = dict(version=0, newest=0, sync_to=None, num_in_flight=0, num_leased=0,
                num_requested=0, free_groups=2, held=False)
    return LoopState(**{**base, **kw})


def test_global_batch_policy_leases_only_what_was_requested_and_pulls_at_the_sync():
    p = schedule("sync").policy(CFG)
    assert p.decide(state(num_requested=3)).lease == 3
    assert p.decide(state(num_requested=0, newest=5)).lease == 0  # a newer version alone: nothing
    assert not p.decide(state(newest=5)).pull
    assert p.decide(state(newest=1, sync_to=1)).pull
    assert not p.decide(state(newest=0, sync_to=1)).pull  # not at the relay yet
    assert not p.mixes_versions and not p.repacks


def test_laminar_policy_tops_up_then_drains_once_lag_versions_are_ahead():
    p = schedule("laminar").policy(CFG)
    assert p.decide(state(newest=1)).lease == 2 and not p.decide(state(newest=1)).draining
    assert p.decide(state(newest=1, held=True)).lease == 0
    drain = p.decide(state(newest=2, num_in_flight=3))
    assert drain.draining and drain.lease == 0 and not drain.start and not drain.pull
    assert p.decide(state(newest=2, num_in_flight=0)).pull
    assert not p.decide(state(newest=2, num_in_flight=0, held=True)).pull  # being repacked
    # a global sync for a version only one ahead (less than the lag): drain and pull it too;
    # under load a rollout that had pulled 7 waited for good for the last version, 8
    sync = p.decide(state(version=7, newest=8, sync_to=8, num_in_flight=4))
    assert sync.draining and not sync.start and not sync.pull
    assert p.decide(state(version=7, newest=8, sync_to=8, num_in_flight=0)).pull
    assert not p.decide(state(version=7, newest=7, sync_to=8)).draining  # not at the relay yet
    assert p.repacks and not p.mixes_versions


def test_partial_policy_interrupts_when_the_update_arrives():
    p = schedule("partial").policy(CFG)
    assert p.decide(state(newest=3)).lease == 2 and not p.decide(state(newest=3)).interrupt
    assert p.decide(state(newest=1, sync_to=1, num_in_flight=4)).interrupt
    assert p.mixes_versions and not p.repacks


# ------------------------------------------------------------------------- the loop


def test_a_requested_batch_reaches_the_buffer_and_leaves_nothing_behind():
    w = World(CFG, "sync")
    loop = w.loop()
    loop.request_groups(3)
    step_until(loop, lambda: loop.batch_done)
    assert len(w.buffer.complete) == 3 and len(w.partials) == 0
    assert w.prompts.accounting()["completed"] == 3 and not w.prompts.leases
    assert {t.version for t in w.trained()} == {0} and all(t.token_versions is None for t in w.trained())
    snap = loop.snapshot()
    assert snap.counters.finished == 6 and snap.num_in_flight == 0 and snap.counters.generated_tokens > 0
    loop.step()
    assert loop.snapshot().counters.batches == 1  # one lease; nothing more without a request


def test_laminar_drains_pulls_and_keeps_one_version_per_trajectory():
    w = World(CFG, "laminar")
    loop = w.loop()
    step_until(loop, lambda: loop.in_flight)
    assert len(loop.in_flight) == 4  # batch_groups x group_size admitted at once
    w.publish(1, seed=1)  # one version ahead: below the lag, keeps admitting with v0
    loop.step()
    assert not loop.draining and loop.engine.version == 0
    w.publish(2, seed=2)
    loop.step()
    assert loop.draining
    started = loop.counters.batches
    step_until(loop, lambda: loop.engine.version == 2)
    assert loop.counters.batches == started  # nothing started while draining
    step_until(loop, lambda: any(t.version == 2 for t in w.trained()))
    versions = {t.version for t in w.trained()}
    assert versions == {0, 2} and all(t.token_versions is None for t in w.trained())
    assert loop.snapshot().counters.versions == [0, 2]


def test_partial_interrupts_in_flight_work_and_each_token_keeps_its_version():
    cfg = load_config(None, [*OVERRIDES, "rollout.max_new_tokens=40", "task.reverse.max_len=30"])
    w = World(cfg, "partial")
    loop = w.loop()
    step_until(loop, lambda: loop.in_flight and all(len(r.output_ids) >= 2 for r, _ in loop.in_flight.values()))
    w.publish(1, seed=1)
    loop.request_version(1)
    loop.step()
    assert loop.engine.version == 1 and loop.counters.swaps == 1 and loop.counters.reprefill_tokens > 0
    step_until(loop, lambda: any(t.token_versions for t in w.trained()))
    mixed = next(t for t in w.trained() if t.token_versions)
    assert mixed.version == 0 and mixed.token_versions[0] == 0 and mixed.token_versions[-1] == 1
    assert len(mixed.token_versions) == len(mixed.response_ids)


def test_exported_work_finishes_elsewhere_exactly_as_it_would_have():
    """Repack: the moved trajectory's greedy tokens equal those of an unmoved run."""
    greedy = load_config(None, [*OVERRIDES, "rollout.temperature=0"])
    alone = World(greedy, "laminar")
    ref = alone.loop()
    step_until(ref, lambda: len(alone.buffer.complete) >= 2)
    expected = {t.traj_id: t.response_ids for t in alone.trained()}

    w = World(greedy, "laminar")
    src = w.loop("src")
    dst = w.loop("dst", schedule("sync").policy(greedy))  # admits nothing of its own
    step_until(src, lambda: src.in_flight and all(r.output_ids for r, _ in src.in_flight.values()))
    moved = src.export()
    assert moved and src.held and not src.in_flight
    src.step()
    assert not src.in_flight  # held: no new admissions until released
    assert dst.adopt(moved)
    w.partials.reassign([m.request.request_id for m in moved], "dst", [m.request for m in moved])
    step_until(dst, lambda: not dst.in_flight and not dst.has_work)
    got = {t.traj_id: t.response_ids for t in w.trained()}
    assert got and all(got[k] == expected[k] for k in got)
    assert dst.snapshot().counters.adopted == len(moved) and src.snapshot().counters.exported == len(moved)


def test_adopt_refuses_other_versions_unless_the_schedule_mixes_them():
    w = World(CFG, "laminar")
    src = w.loop("src")
    step_until(src, lambda: src.in_flight and all(r.output_ids for r, _ in src.in_flight.values()))
    moved = src.export()
    other = w.loop("other")
    w.publish(5, seed=5)
    other.engine.load_weights(w.board.tensors, 5)
    assert not other.adopt(moved)  # laminar: a trajectory never changes version
    mixing = World(CFG, "partial").loop()
    mixing.engine.load_weights(w.board.tensors, 5)
    assert mixing.adopt(moved)

