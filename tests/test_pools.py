"""Pools as plain objects: leases, dead owners, partial state, idempotent buffer, staleness."""

from __future__ import annotations

import pytest

from laminar.pools.experience import ExperienceBuffer
from laminar.pools.partials import PartialPool
from laminar.pools.prompts import PromptPool, PromptSampler
from laminar.types import GenerationRequest, PromptItem, TokenDelta, Trajectory

ITEMS = [PromptItem(i, f"p{i}=", f"a{i}") for i in range(5)]


def encode(text):
    return [1] + [ord(c) % 100 for c in text]


def test_sampler_epochs_cover_every_prompt_and_resume():
    s = PromptSampler(ITEMS, encode, num_samples=2, seed=3)
    first = [s.next_group().item.index for _ in range(5)]
    assert sorted(first) == list(range(5))
    state = s.state_dict()
    nxt = [s.next_group() for _ in range(3)]
    again = PromptSampler(ITEMS, encode, num_samples=2, seed=3)
    again.load_state_dict(state)
    assert [g.group_id for g in again.next_groups(3)] == [g.group_id for g in nxt]
    assert nxt[0].group_id.startswith("e1-")


def test_dead_owner_leases_return_first_and_accounting_holds():
    pool = PromptPool(PromptSampler(ITEMS, encode, 2, seed=0), lease_timeout_s=10)
    a = pool.lease("rollout-a", 2, now=0.0)
    b = pool.lease("rollout-b", 1, now=0.0)
    assert pool.complete(b[0].group_id)
    assert not pool.complete(b[0].group_id)  # twice: refused
    returned = pool.release_owner("rollout-a", keep={a[1].group_id})
    assert returned == [a[0].group_id]
    again = pool.lease("rollout-c", 2, now=1.0)
    assert again[0].group_id == a[0].group_id  # re-issued before fresh prompts
    assert again[1].group_id not in {g.group_id for g in a + b}
    acct = pool.accounting()
    assert acct == {"issued": 4, "leased": 3, "returned": 0, "completed": 1, "consumed": 0}


def test_admission_control_bounds_outstanding_groups():
    pool = PromptPool(PromptSampler(ITEMS, encode, 2), max_outstanding=3)
    assert len(pool.lease("a", 2, now=0.0)) == 2
    got = pool.lease("b", 2, now=0.0)
    assert len(got) == 1  # 3 outstanding: the bound
    assert pool.lease("b", 1, now=0.0) == []
    pool.complete(got[0].group_id)
    assert pool.lease("b", 1, now=0.0) == []  # completed but not trained still counts
    pool.mark_consumed(1)
    assert len(pool.lease("b", 5, now=0.0)) == 1


def test_expired_owners_and_renewal():
    pool = PromptPool(PromptSampler(ITEMS, encode, 2), lease_timeout_s=10)
    pool.lease("x", 1, now=0.0)
    pool.lease("y", 1, now=0.0)
    pool.renew("y", now=8.0)
    assert pool.expired_owners(now=12.0) == {"x"}


def test_prompt_pool_state_restores_pending_groups():
    pool = PromptPool(PromptSampler(ITEMS, encode, 2, seed=1))
    leased = pool.lease("x", 2, now=0.0)
    state = pool.state_dict()
    fresh = PromptPool(PromptSampler(ITEMS, encode, 2, seed=1))
    fresh.load_state_dict(state)
    regained = fresh.lease("y", 3, now=0.0)
    assert [g.group_id for g in regained[:2]] == [g.group_id for g in leased]
    assert regained[0].prompt_ids == leased[0].prompt_ids


def test_partial_pool_streams_and_moves_entries():
    pool = PartialPool()
    group = PromptSampler(ITEMS, encode, 2).next_group()
    reqs = [GenerationRequest(f"{group.group_id}/{i}", group.prompt_ids) for i in range(2)]
    pool.register("a", group, reqs)
    tid = reqs[0].request_id
    assert pool.update("a", [TokenDelta(tid, [5, 6], [-0.1, -0.2], token_versions=[3, 3])]) == 1
    assert pool.update("b", [TokenDelta(tid, [7], [-0.3], token_versions=[3])]) == 0  # not the owner
    entry = pool.entries[tid]
    assert entry.request.output_ids == [5, 6] and entry.request.version == 3
    aborted = GenerationRequest(tid, group.prompt_ids, output_ids=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3],
                                token_versions=[3, 3, 4], version=3)
    pool.reassign([tid], "b", [aborted])
    assert pool.entries[tid].owner == "b"
    assert pool.entries[tid].request.output_ids == [5, 6, 7]
    assert pool.entries[tid].request.token_versions == [3, 3, 4]
    assert [e.request.request_id for e in pool.owned_by("a")] == [reqs[1].request_id]
    pool.remove([tid])
    assert len(pool) == 1 and pool.group_ids() == {group.group_id}


def _t(gid, i, version=0):
    return Trajectory(f"{gid}/{i}", gid, [1], [2], [-0.1], version=version, reward=float(i))


def test_buffer_put_is_idempotent_and_releases_whole_groups():
    buf = ExperienceBuffer(group_size=2)
    assert not buf.put(_t("g1", 0))
    assert not buf.put(_t("g1", 0))  # retried put
    assert buf.sample(1, trainer_version=0) is None
    assert buf.put(_t("g2", 0)) is False
    assert buf.put(_t("g2", 1)) is True
    assert buf.put(_t("g1", 1)) is True
    got = buf.sample(2, trainer_version=0)
    assert [[t.traj_id for t in g] for g in got] == [["g2/0", "g2/1"], ["g1/0", "g1/1"]]  # FIFO
    assert buf.stats.duplicates == 1 and buf.stats.groups_released == 2
    assert buf.sample(1, 0) is None


def test_custom_policy_is_checked():
    buf = ExperienceBuffer(group_size=1, policy=lambda groups, n, v: [0, 0])
    buf.put(_t("a", 0))
    buf.put(_t("b", 0))
    with pytest.raises(ValueError, match="sampling policy returned"):
        buf.sample(2, 0)


def test_pool_specs_build_the_pools_of_a_job_from_its_config():
    """Both runtimes assemble the pools from `pool_specs` (in process, or one Ray actor each)."""
    from laminar.config import load_config
    from laminar.pools.build import POOLS, pool_specs

    cfg = load_config(None, ["rollout.group_size=3", "cluster.wait_timeout_s=50", "task.seed=4"])
    specs = pool_specs(cfg, ITEMS, encode, max_outstanding=7, db=None)
    prompts, partials, buffer = (specs[k].build() for k in POOLS)
    assert isinstance(partials, PartialPool) and len(partials) == 0
    assert prompts.lease_timeout_s == 100 and prompts.max_outstanding == 7
    assert buffer.group_size == 3
    again = PromptSampler(ITEMS, encode, num_samples=3, seed=4)
    assert [prompts.sampler.next_group().item.index for _ in range(5)] == \
        [again.next_group().item.index for _ in range(5)]
