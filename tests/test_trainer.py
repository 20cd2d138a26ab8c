"""Trainer pieces against hand-computed numbers: advantages, the clipped loss, batching."""

from __future__ import annotations

import math

import pytest
import torch

from laminar.config import TrainerConfig
from laminar.metrics import summarize
from laminar.models import build_preset
from laminar.trainer.advantage import group_advantages
from laminar.trainer.batching import collate, split_groups, token_budget_batches
from laminar.trainer.loss import abs_diff_summary, fresh_abs_diffs, policy_loss, token_logprobs
from laminar.trainer.trainer import NonFiniteTraining, Trainer
from laminar.types import Trajectory


def test_group_advantages_by_hand():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 0.3, 0.3], ["a", "a", "a", "a", "b", "b"])
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert adv[:4].tolist() == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], rel=1e-5)
    assert adv[4:].tolist() == [0.0, 0.0]  # equal rewards: no signal


def test_group_advantages_any_order():
    adv = group_advantages([2.0, 5.0, 4.0, 1.0], ["x", "y", "x", "y"])
    assert adv[0] < 0 < adv[2] and adv[3] < 0 < adv[1]
    assert float(adv[0] + adv[2]) == pytest.approx(0.0, abs=1e-6)


def test_clip_higher_loss_by_hand():
    ratios = torch.tensor([[1.5, 0.5], [0.5, 1.5]])
    logprobs = ratios.log()
    old = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, stats = policy_loss(logprobs, old, adv, mask, eps_low=0.2, eps_high=0.28)
    # A: max(-1.5, -1.28) = -1.28; max(-0.5, -0.8) = -0.5.  B: max(1.0, 1.6) = 1.6.  Mean of 3.
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 1.6) / 3, rel=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    loss_sum, _ = policy_loss(logprobs, old, adv, mask, num_tokens=6)  # mini-batch of 6 tokens
    assert loss_sum.item() == pytest.approx((-1.28 - 0.5 + 1.6) / 6, rel=1e-6)


def test_kl_term_by_hand():
    r = 1.5
    logprobs = torch.tensor([[math.log(r)]])
    loss, stats = policy_loss(logprobs, logprobs.detach(), torch.tensor([0.0]), torch.ones(1, 1),
                              ref_logprobs=torch.zeros(1, 1), kl_coef=0.1)
    k3 = 1 / r + math.log(r) - 1
    assert stats["kl"] == pytest.approx(k3, rel=1e-5)
    assert loss.item() == pytest.approx(0.1 * k3, rel=1e-5)


def test_behaviour_weights_scale_each_token_by_hand():
    ratios = torch.tensor([[1.1, 0.9]])
    mask = torch.ones(1, 2)
    w = torch.tensor([[2.0, 0.5]])
    loss, _ = policy_loss(ratios.log(), torch.zeros(1, 2), torch.tensor([1.0]), mask,
                          behaviour_weights=w)
    assert loss.item() == pytest.approx((-1.1 * 2.0 - 0.9 * 0.5) / 2, rel=1e-6)


def test_loss_gradient_vanishes_when_clipped():
    lp = torch.tensor([[math.log(2.0)]], requires_grad=True)
    loss, _ = policy_loss(lp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1))
    loss.backward()
    assert lp.grad.item() == 0.0  # ratio 2 > 1.28 with positive advantage: no push further


def test_token_logprobs_temperature():
    logits = torch.tensor([[[2.0, 0.0]]])
    lp = token_logprobs(logits, torch.tensor([[0]]), temperature=2.0)
    assert lp.item() == pytest.approx(math.log(math.e / (math.e + 1)), rel=1e-6)


def _traj(i, group, prompt, response, version=0, reward=0.0):
    return Trajectory(traj_id=f"{group}/{i}", group_id=group, prompt_ids=prompt,
                      response_ids=response, logprobs=[-0.1 * (k + 1) for k in range(len(response))],
                      version=version, reward=reward)


def test_collate_aligns_behaviour_logprobs_with_the_predicting_positions():
    t = _traj(0, "g", [1, 10, 11], [20, 21, 2])
    b = collate([t, _traj(1, "g", [1, 12], [22])], torch.tensor([1.0, -1.0]), pad_token_id=0)
    assert b.input_ids[0].tolist() == [1, 10, 11, 20, 21, 2]
    # position 2 (token 11) predicts the first response token 20
    assert b.response_mask[0].tolist() == [0, 0, 1, 1, 1]
    assert b.targets[0, 2:].tolist() == [20, 21, 2]
    assert b.old_logprobs[0, 2:].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert b.response_mask[1].tolist() == [0, 1, 0, 0, 0]
    assert b.num_response_tokens == 4
    assert b.token_versions[0, 2:].tolist() == [0, 0, 0]  # one version per trajectory
    t.token_versions = [3, 3, 4]  # partial mode: per token
    assert collate([t], torch.tensor([1.0]), 0).token_versions[0].tolist() == [0, 0, 3, 3, 4]


def test_token_budget_batches():
    groups = token_budget_batches([5, 100, 6, 7, 50], max_tokens=20)
    assert groups == [[0, 2], [3], [4], [1]]  # 2*6=12 fits, 3*7=21 does not
    assert sorted(i for g in groups for i in g) == list(range(5))


def test_split_groups_keeps_groups_whole():
    trajs = [_traj(i, f"g{i // 2}", [1], [5]) for i in range(6)]
    parts = split_groups(trajs, 2)
    assert [[t.group_id for t in p] for p in parts] == [["g0", "g0", "g1", "g1"], ["g2", "g2"]]


def test_train_step_records_staleness_and_bumps_version():
    torch.manual_seed(0)
    model = build_preset("tiny")
    trainer = Trainer(model, TrainerConfig(lr=1e-3, mini_batches=2), pad_token_id=0)
    trainer.version = 3
    trajs = [_traj(i, f"g{i // 2}", [1, 5, 6], [7, 8, 2], version=i % 2 + 2, reward=float(i % 2))
             for i in range(4)]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = trainer.train_step(trajs)
    assert trainer.version == 4
    assert [t.staleness for t in trajs] == [1, 0, 1, 0]
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    # every mini-batch has a gradient, measured for the engine-trainer mismatch or not (the
    # second one is not: its weights are no published version's; a backward once sat under
    # that condition and the second update stepped Adam on no gradient)
    assert len(trainer.last_minibatches) == 2
    assert all(m["grad_norm"] > 0 for m in trainer.last_minibatches), trainer.last_minibatches
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_a_torn_audit_line_is_cut_back_to_the_last_complete_one(tmp_path):
    from laminar.trainer.service import drop_torn_last_line

    path = tmp_path / "trajectories.jsonl"
    path.write_text('{"a": 1}\n{"b": 2}\n{"c": ')
    drop_torn_last_line(path)
    assert path.read_text() == '{"a": 1}\n{"b": 2}\n'
    drop_torn_last_line(path)  # complete: unchanged
    assert path.read_text() == '{"a": 1}\n{"b": 2}\n'
    drop_torn_last_line(tmp_path / "missing.jsonl")  # no file: nothing to do


def test_a_torn_line_longer_than_the_read_block_is_cut_too(tmp_path):
    from laminar.trainer.service import drop_torn_last_line

    path = tmp_path / "t.jsonl"
    path.write_text('{"a": 1}\n' + "x" * 50)
    drop_torn_last_line(path, block=8)
    assert path.read_text() == '{"a": 1}\n'
    path.write_text("no newline at all")
    drop_torn_last_line(path, block=4)
    assert path.read_text() == ""


def _stale_batch():
    """Two groups whose recorded behaviour log-probs are far from the model's own."""
    return [_traj(i, f"g{i // 2}", [1, 5, 6], [7, 8, 2], version=0, reward=float(i % 2))
            for i in range(4)]


@pytest.mark.parametrize("correction", ["none", "decoupled"])
def test_recomputed_old_logprobs_are_the_weights_at_the_start_of_the_global_batch(correction):
    """The first mini-batch is exactly on-policy against the recomputed log-probs (ratio 1),
    whatever the rollout recorded; the second sees the weights the first one moved."""
    torch.manual_seed(0)
    trainer = Trainer(build_preset("tiny"), TrainerConfig(
        lr=1e-2, mini_batches=2, old_logprobs="recompute", correction=correction), pad_token_id=0)
    trainer.train_step(_stale_batch())
    first, second = trainer.last_minibatches
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert second["ratio_mean"] != pytest.approx(1.0, abs=1e-6)
    if correction == "decoupled":  # weight = pi_prox / pi_behaviour, far from 1 for this data
        assert first["correction_weight_mean"] != pytest.approx(1.0, abs=1e-3)


def test_rollout_old_logprobs_use_what_the_engine_recorded():
    torch.manual_seed(0)
    trainer = Trainer(build_preset("tiny"), TrainerConfig(mini_batches=2), pad_token_id=0)
    trainer.train_step(_stale_batch())
    assert trainer.last_minibatches[0]["ratio_mean"] != pytest.approx(1.0, abs=1e-3)


def _trained(trajs):
    torch.manual_seed(0)
    model = build_preset("tiny", seed=0)
    trainer = Trainer(model, TrainerConfig(lr=1e-2), pad_token_id=0)
    return model, trainer.train_step(trajs)


def test_failed_samples_are_left_out_and_their_group_trains_on_the_others():
    """A sample whose reward failed completes its group in the buffer but not the gradient:
    training on the group with it gives the very weights of training on the group without
    it; a group whose samples all failed contributes nothing."""
    def batch():
        group = [_traj(i, "g", [1, 5, 6], [7 + i, 8, 2], reward=r)
                 for i, r in enumerate([1.0, 0.0, 0.5, 0.2])]
        failed = _traj(4, "g", [1, 5, 6], [30, 31, 32, 2], reward=0.0)
        dead = [_traj(i, "h", [1, 9], [10 + i, 2]) for i in range(2)]
        failed.failed, dead[0].failed, dead[1].failed = "timeout", "error", "nan"
        return group, [failed, *dead]

    group, failed = batch()
    with_failed, stats = _trained(group + failed)
    without, _ = _trained(batch()[0])
    start = build_preset("tiny", seed=0)
    assert math.isfinite(stats["loss"]) and stats["nonfinite_skipped"] == 0
    assert all(torch.equal(a, b) for a, b in zip(with_failed.parameters(), without.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(with_failed.parameters(), start.parameters()))
    summary = summarize(group + failed)
    assert summary["failed_trajectories"] == 3
    assert summary["reward"] == pytest.approx((1.0 + 0.0 + 0.5 + 0.2) / 4)  # the scored ones


def test_a_nonfinite_loss_skips_the_update_and_k_in_a_row_stop_training(caplog):
    torch.manual_seed(0)
    model = build_preset("tiny")
    trainer = Trainer(model, TrainerConfig(lr=1e-2, max_nonfinite_steps=3), pad_token_id=0)

    def batch(nan: bool):
        trajs = [_traj(i, "g", [1, 5, 6], [7 + i, 8, 2], reward=float(i)) for i in range(2)]
        if nan:
            trajs[1].logprobs[0] = float("nan")  # a corrupt behaviour log-prob
        return trajs

    before = [p.detach().clone() for p in model.parameters()]
    stats = trainer.train_step(batch(nan=True))
    assert stats["nonfinite_skipped"] == 1 and "loss" not in stats and trainer.version == 1
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # no step taken
    assert not trainer.optimizer.state  # and Adam's moments untouched
    assert "trainer step 1: skipped an optimizer update" in caplog.text
    trainer.train_step(batch(nan=True))
    assert trainer.train_step(batch(nan=False))["nonfinite_skipped"] == 0  # resets the count
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    trainer.train_step(batch(nan=True))
    trainer.train_step(batch(nan=True))
    with pytest.raises(NonFiniteTraining, match=r"3 optimizer updates in a row up to step 6"):
        trainer.train_step(batch(nan=True))


# ------------------------------------------------------------- engine-trainer log-prob mismatch


def test_engine_trainer_mismatch_by_hand():
    """Only trained tokens (mask 1) that the trainer's own version sampled count."""
    trainer_lp = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-0.5, -0.5, -0.5, -0.5]])
    engine_lp = torch.tensor([[-1.1, -2.0, -2.7, -9.0], [-0.5, -0.9, 0.0, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0]])  # 0: padding, observation
    versions = torch.tensor([[4, 4, 4, 4], [4, 3, 4, 4]])  # [1, 1] sampled by version 3: stale
    diffs = fresh_abs_diffs(trainer_lp, engine_lp, mask, versions, 4)
    assert diffs.tolist() == pytest.approx([0.1, 0.0, 0.3, 0.0, 0.0], abs=1e-6)
    summary = abs_diff_summary([diffs[:2], diffs[2:]])  # micro-batches and ranks concatenate
    assert summary["logprob_abs_diff_mean"] == pytest.approx(0.08, abs=1e-6)
    # p99 interpolates linearly between order statistics: 0.1 + 0.96 * (0.3 - 0.1)
    assert summary["logprob_abs_diff_p99"] == pytest.approx(0.292, abs=1e-6)
    import numpy as np

    assert summary["logprob_abs_diff_p99"] == pytest.approx(float(np.percentile(diffs, 99)), abs=1e-6)
    assert fresh_abs_diffs(trainer_lp, engine_lp, mask, versions, 3).tolist() == pytest.approx([0.4])
    none = {"logprob_abs_diff_mean": None, "logprob_abs_diff_p99": None}
    assert fresh_abs_diffs(trainer_lp, engine_lp, mask, versions, 5).numel() == 0
    assert abs_diff_summary([fresh_abs_diffs(trainer_lp, engine_lp, mask, versions, 5)]) == none
    assert abs_diff_summary([]) == none


def _engine_logprobs_of(trainer, trajs):
    """Record, as an engine would, the log-probs of the trainer's current weights."""
    with torch.no_grad():
        lp = trainer.sequence_logprobs(trainer.model, collate(trajs, torch.zeros(len(trajs)), 0))
    for row, t in enumerate(trajs):
        start = len(t.prompt_ids) - 1
        t.logprobs = lp[row, start:start + len(t.response_ids)].tolist()


@pytest.mark.parametrize("mode", ["rollout", "recompute"])
def test_the_mismatch_uses_the_weights_the_version_was_published_with(mode):
    """Trajectories whose engine log-probs are the version's own: |diff| ~ 0. Without a
    proximal copy only tokens trained before the global batch's first optimizer step are
    compared (after it the weights are no version's); with one (recompute) every mini-batch
    is; stale tokens never are."""
    torch.manual_seed(0)
    trainer = Trainer(build_preset("tiny"), TrainerConfig(lr=1e-2, mini_batches=2,
                                                          old_logprobs=mode), pad_token_id=0)
    trainer.version = 2
    fresh = [_traj(i, "g", [1, 5, 6 + i], [7, 8 + i, 9, 2], version=2, reward=float(i % 2))
             for i in range(4)]
    _engine_logprobs_of(trainer, fresh)
    stale = [_traj(4 + i, "s", [1, 5], [7, 2], version=1, reward=float(i)) for i in range(2)]
    stats = trainer.train_step(fresh + stale)  # mini-batches: group g, then s
    assert stats["logprob_abs_diff_mean"] < 1e-6 and stats["logprob_abs_diff_p99"] < 1e-6
    # the fresh tokens trained second: compared only against the proximal copy
    for t in fresh:
        t.version = 3
    _engine_logprobs_of(trainer, fresh)
    stats = trainer.train_step(stale + fresh)  # s first (a step), then g
    if mode == "rollout":
        assert stats["logprob_abs_diff_mean"] is None and stats["logprob_abs_diff_p99"] is None
    else:
        assert stats["logprob_abs_diff_p99"] < 1e-6
    # the moved weights would have shown: the second mini-batch's log-probs are far off
    assert trainer.last_minibatches[1]["ratio_mean"] != pytest.approx(1.0, abs=1e-4)
    stats = trainer.train_step(fresh)  # version 4 now: every token stale
    assert stats["logprob_abs_diff_mean"] is None and stats["logprob_abs_diff_p99"] is None
