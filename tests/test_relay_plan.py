"""Chain plans are pure: build, repair (one link changes), new master, late join."""

import pytest

from laminar.relay.plan import ChainPlan, RelayInfo, build_chain, choose_master, join, repair, to_cut


def relays(n: int) -> list[RelayInfo]:
    return [RelayInfo(f"r{i}", "127.0.0.1", 7000 + i) for i in range(n)]


def test_build_chain_puts_master_first_and_keeps_given_order():
    plan = build_chain(relays(4), master="r2")
    assert plan.order == ("r2", "r0", "r1", "r3")
    assert plan.master == "r2"
    assert plan.successor("r2") == "r0" and plan.successor("r3") is None
    assert plan.predecessor("r0") == "r2" and plan.predecessor("r2") is None


def test_repair_of_a_middle_relay_changes_exactly_one_link():
    plan = build_chain(relays(5))
    fixed = repair(plan, "r2")
    assert fixed.order == ("r0", "r1", "r3", "r4")
    assert plan.links() - fixed.links() == {("r1", "r2"), ("r2", "r3")}  # the dead relay's links
    assert fixed.links() - plan.links() == {("r1", "r3")}  # the only new connection
    assert fixed.epoch == plan.epoch + 1


def test_repair_of_the_tail_adds_no_link():
    plan = build_chain(relays(3))
    fixed = repair(plan, "r2")
    assert fixed.links() == {("r0", "r1")}


def test_master_death_promotes_its_successor_and_keeps_the_rest():
    plan = build_chain(relays(4))
    assert choose_master(plan, ["r0"]) == "r1"
    fixed = repair(plan, "r0")
    assert fixed.master == "r1"
    assert fixed.links() == {("r1", "r2"), ("r2", "r3")}
    assert choose_master(plan, ["r0", "r1", "r2", "r3"]) is None


def test_repair_of_an_unknown_relay_is_a_no_op():
    plan = build_chain(relays(2))
    assert repair(plan, "nope") is plan


def test_join_appends_at_the_tail():
    plan = join(build_chain(relays(2)), RelayInfo("late", "127.0.0.1", 9000))
    assert plan.order == ("r0", "r1", "late") and plan.predecessor("late") == "r1"
    with pytest.raises(ValueError, match="already in the chain"):
        join(plan, RelayInfo("r0", "127.0.0.1", 1))


def test_plan_round_trips_through_json_dicts():
    plan = build_chain(relays(3), master="r1", epoch=7)
    assert ChainPlan.from_dict(plan.to_dict()) == plan


def test_bad_plans_are_rejected_with_the_offending_ids():
    with pytest.raises(ValueError, match="duplicate"):
        ChainPlan(("a", "a"), {"a": RelayInfo("a", "h", 1)})
    with pytest.raises(ValueError, match="without an address"):
        ChainPlan(("a", "b"), {"a": RelayInfo("a", "h", 1)})
    with pytest.raises(ValueError, match="master 'x'"):
        build_chain(relays(2), master="x")


def test_a_health_check_cuts_the_gone_and_the_silent_but_never_the_last_relay():
    order = ["r0", "r1", "r2"]
    assert to_cut(order, gone=["r1"], silent=[]) == ["r1"]
    assert to_cut(order, gone=["r2"], silent=["r0"]) == ["r0", "r2"]  # the rest still has r1
    # the only relay went silent (a loaded machine): cutting it would strand every rollout
    assert to_cut(["r0"], gone=[], silent=["r0"]) == []
    # all silent or gone: the gone go, the silent stay
    assert to_cut(order, gone=["r0"], silent=["r1", "r2"]) == ["r0"]
    assert to_cut(order, gone=order, silent=[]) == order  # nothing left to keep: they are dead
    assert to_cut(order, gone=[], silent=["nope"]) == []  # not in the chain
