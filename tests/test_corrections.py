"""Each off-policy correction's formula on hand-made ratios (laminar/trainer/corrections.py),
the step-row summaries of the mismatch (loss.py), and a trainer batch mixing versions v and
v - 4 weighted as the formula says."""

import math

import pytest
import torch

from laminar.config import CorrectionConfig, TrainerConfig
from laminar.models.builder import build_preset
from laminar.trainer.advantage import group_advantages
from laminar.trainer.batching import collate
from laminar.trainer.corrections import (correction_weights, decoupled, geo_mask, icepop, m2po,
                                         mis, tis)
from laminar.trainer.loss import mismatch_summary, policy_loss, token_entropy
from laminar.trainer.trainer import Trainer
from laminar.types import Trajectory

# two sequences; row 0 has 3 trained tokens, row 1 has 2 (its last position is padding)
RHO = torch.tensor([[0.25, 1.0, 4.0], [1.5, 8.0, 1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
LOG_RHO = RHO.log()


def rows(w):
    return [[pytest.approx(x, rel=1e-5, abs=1e-7) for x in row] for row in w.tolist()]


def test_tis_truncates_each_token_or_the_sequence_at_the_cap():
    assert tis(LOG_RHO, MASK, cap=2.0).tolist() == rows(torch.tensor([[0.25, 1.0, 2.0],
                                                                      [1.5, 2.0, 0.0]]))
    # sequence level: prod rho = 1.0 (row 0) and 12 (row 1, the padded 1.0 left out)
    assert tis(LOG_RHO, MASK, cap=2.0, level="sequence").tolist() == rows(
        torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))


def test_mis_drops_what_leaves_the_band_and_keeps_the_rest_at_one():
    assert mis(LOG_RHO, MASK, low=0.5, high=2.0).tolist() == rows(torch.tensor([[0, 1, 0],
                                                                               [1, 0, 0.0]]))
    assert mis(LOG_RHO, MASK, low=0.5, high=2.0, level="sequence").tolist() == rows(
        torch.tensor([[1, 1, 1], [0, 0, 0.0]]))


def test_icepop_keeps_rho_inside_its_band_and_zero_outside():
    assert icepop(LOG_RHO, MASK).tolist() == rows(torch.tensor([[0.0, 1.0, 4.0], [1.5, 0.0, 0.0]]))
    assert icepop(LOG_RHO, MASK, low=0.2, high=10).tolist() == rows(RHO * MASK)


def test_geo_mask_bands_the_geometric_mean_of_each_sequence():
    # row 0: (0.25 * 1 * 4) ** (1/3) = 1; row 1: (1.5 * 8) ** (1/2) = 3.46
    assert geo_mask(LOG_RHO, MASK).tolist() == rows(torch.tensor([[1, 1, 1], [0, 0, 0.0]]))
    assert geo_mask(LOG_RHO, MASK, low=0.9, high=3.5).tolist() == rows(MASK)
    assert geo_mask(LOG_RHO, MASK, low=0.9, high=3.4).tolist() == rows(torch.tensor(
        [[1, 1, 1], [0, 0, 0.0]]))


def test_decoupled_weighs_by_rho_and_drops_above_the_cap():
    assert decoupled(LOG_RHO, MASK, cap=5.0).tolist() == rows(torch.tensor([[0.25, 1.0, 4.0],
                                                                           [1.5, 0.0, 0.0]]))


def test_m2po_drops_the_largest_second_moments_until_the_mean_is_under_tau():
    # (log rho)^2: 1.922, 0, 1.922, 0.164, 4.324; ascending prefix means: 0, 0.082, 0.695, ...
    assert m2po(LOG_RHO, MASK, tau=0.1).tolist() == rows(torch.tensor([[0, 1, 0], [1, 0, 0.0]]))
    assert m2po(LOG_RHO, MASK, tau=0.7).tolist() == rows(torch.tensor([[1, 1, 0], [1, 0, 0.0]]))
    assert m2po(LOG_RHO, MASK, tau=100).tolist() == rows(MASK)
    # one tie at the threshold: only as many as the bound allows are kept
    assert m2po(LOG_RHO, MASK, tau=1.05).sum() == 4  # 0, 0.164, 1.922 -> 0.695; +1.922 -> 1.0


def test_m2po_keeps_nothing_when_even_the_smallest_moment_is_above_tau():
    assert m2po(torch.full((1, 2), math.log(3.0)), torch.ones(1, 2), tau=0.04).sum() == 0


def test_correction_weights_report_the_shares_dropped_and_truncated():
    w, stats = correction_weights(CorrectionConfig(kind="tis"), LOG_RHO, MASK)
    assert stats["correction_clipped"] == pytest.approx(2 / 5)  # 4.0 and 8.0 over cap 2
    assert stats["correction_masked"] == 0.0
    assert stats["correction_weight_mean"] == pytest.approx((0.25 + 1 + 2 + 1.5 + 2) / 5)
    w, stats = correction_weights(CorrectionConfig(kind="icepop"), LOG_RHO, MASK)
    assert stats["correction_masked"] == pytest.approx(2 / 5) and stats["correction_clipped"] == 0
    assert correction_weights(CorrectionConfig(), LOG_RHO, MASK) == (None, {})


def test_weights_scale_the_clipped_surrogate_token_by_token():
    """policy_loss multiplies each token's PPO-clip term by its weight: a dropped token adds
    nothing, a truncated one counts `cap` times."""
    lp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    w = tis(LOG_RHO, MASK, cap=2.0)
    loss, _ = policy_loss(lp, torch.zeros(2, 3), adv, MASK, behaviour_weights=w)
    # ratio 1 everywhere: per-token term -A, times the weight, summed, / 5 tokens
    assert float(loss.detach()) == pytest.approx((-(0.25 + 1 + 2) + (1.5 + 2)) / 5)


def test_mismatch_summary_pins_its_formulas():
    log_r = torch.tensor([0.0, 0.1, -0.2, 0.5])
    s = mismatch_summary([log_r[:1], log_r[1:]])
    assert s["logprob_abs_diff_all_mean"] == pytest.approx(0.8 / 4)
    assert s["mismatch_kl_k3"] == pytest.approx(float((log_r.exp() - 1 - log_r).mean()))
    ordered = sorted(log_r.tolist())
    assert s["is_ratio_p50"] == pytest.approx(math.exp((ordered[1] + ordered[2]) / 2))
    assert s["is_ratio_p1"] == pytest.approx(math.exp(ordered[0] + 0.03 * (ordered[1] - ordered[0])))
    assert s["is_ratio_p99"] == pytest.approx(math.exp(ordered[2] + 0.97 * (ordered[3] - ordered[2])))
    assert set(mismatch_summary([]).values()) == {None}


def test_token_entropy_of_uniform_and_certain_distributions():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    assert token_entropy(logits, torch.tensor([[1.0, 0.0]])) == pytest.approx(math.log(4))
    assert token_entropy(logits, torch.tensor([[0.0, 1.0]])) == pytest.approx(0.0, abs=1e-6)


def _traj(i, version, logprobs, reward):
    return Trajectory(traj_id=f"g/{i}", group_id="g", prompt_ids=[1, 5], response_ids=[7, 8, 2],
                      logprobs=logprobs, version=version, reward=reward)


@pytest.mark.parametrize("kind", ["tis", "icepop", "decoupled", "m2po", "mis", "geo_mask"])
def test_a_batch_mixing_versions_v_and_v_minus_4_is_weighted_as_the_formula_says(kind):
    """Trainer at version 8: one trajectory sampled by version 8 (behaviour log-probs = the
    trainer's own), one by version 4 (behaviour log-probs of other weights, here shifted). The
    loss equals policy_loss with the correction's weights of pi_prox / pi_behaviour, computed
    by hand from the trainer's log-probs."""
    torch.manual_seed(0)
    cfg = TrainerConfig(lr=1e-3, correction=kind)
    trainer = Trainer(build_preset("tiny"), cfg, pad_token_id=0)
    trainer.version = 8
    fresh, stale = _traj(0, 8, [0.0] * 3, 1.0), _traj(1, 4, [0.0] * 3, 0.0)
    own = trainer.sequence_logprobs(trainer.model, collate([fresh, stale], torch.zeros(2), 0))
    fresh.logprobs = own[0, 1:4].tolist()
    stale.logprobs = (own[1, 1:4] + torch.tensor([-1.2, 0.3, 2.0])).tolist()  # version 4's
    batch = collate([fresh, stale], group_advantages([1.0, 0.0], ["g", "g"]), 0)
    with torch.no_grad():
        prox = trainer.sequence_logprobs(trainer.model, batch)
        w, _ = correction_weights(cfg.correction, prox - batch.old_logprobs, batch.response_mask)
        mask = batch.response_mask * (w > 0)
        want, _ = policy_loss(prox, prox, batch.advantages, mask, cfg.eps_low, cfg.eps_high,
                              num_tokens=6, behaviour_weights=w)
    # the fresh row's weights are the formula at rho = 1; the stale row's at rho = exp(shift)
    rho = torch.tensor([[1.0, 1.0, 1.0], [math.exp(1.2), math.exp(-0.3), math.exp(-2.0)]])
    by_hand, _ = correction_weights(cfg.correction, rho.log(), torch.ones(2, 3))
    assert w[:, 1:4].tolist() == rows(by_hand)
    stats = trainer.train_step([fresh, stale])
    assert stats["loss"] == pytest.approx(float(want), rel=1e-5, abs=1e-7)
    # log rho sorted: -2, -0.3, 0, 0, 0, 1.2; the 99th percentile lies at 4.95 of 0..5
    assert stats["is_ratio_p99"] == pytest.approx(math.exp(0.95 * 1.2), rel=1e-4)
    dropped = int((by_hand == 0).sum())
    assert stats["correction_dropped_tokens"] == dropped
    assert stats["correction_masked"] == pytest.approx(dropped / 6)


@pytest.mark.parametrize("perturb", [0.0, 0.05])
def test_the_mismatch_over_every_token_is_zero_for_the_same_weights_and_not_for_perturbed(perturb):
    """Behaviour log-probs from the trainer's own weights (recompute, fp32): every new metric is
    ~0 (ratio 1); from a copy with noise on its weights, they are not."""
    import copy

    torch.manual_seed(0)
    trainer = Trainer(build_preset("tiny"), TrainerConfig(old_logprobs="recompute"), pad_token_id=0)
    behaviour = copy.deepcopy(trainer.model)
    with torch.no_grad():
        for p in behaviour.parameters():
            p.add_(perturb * torch.randn_like(p))
    trajs = [Trajectory(traj_id=f"g/{i}", group_id="g", prompt_ids=[1, 5 + i], response_ids=[7, 8 + i, 2],
                        logprobs=[0.0] * 3, version=0, reward=float(i % 2)) for i in range(4)]
    lp = trainer.sequence_logprobs(behaviour, collate(trajs, torch.zeros(4), 0))
    for row, t in enumerate(trajs):
        t.logprobs = lp[row, 1:4].tolist()
    stats = trainer.train_step(trajs)
    if perturb == 0.0:
        assert stats["logprob_abs_diff_all_p99"] < 1e-5 and abs(stats["mismatch_kl_k3"]) < 1e-9
        assert stats["is_ratio_p1"] == pytest.approx(1.0, abs=1e-5) == stats["is_ratio_p99"]
    else:
        assert stats["logprob_abs_diff_all_mean"] > 1e-3 and stats["mismatch_kl_k3"] > 0
        assert stats["is_ratio_p1"] < 1.0 < stats["is_ratio_p99"]
    # staleness 0 here: the fresh-token metric sees the same tokens
    assert stats["logprob_abs_diff_p99"] == pytest.approx(stats["logprob_abs_diff_all_p99"], rel=1e-5, abs=1e-9)


E2E = ["cluster.backend=local", "sft.enabled=false", "task.reverse.max_len=8",
       "rollout.max_new_tokens=9", "rollout.group_size=4", "trainer.prompts_per_step=4",
       "task.eval_prompts=4", "trainer.threads=1", "trainer.lr=1e-3", "trainer.total_steps=5",
       "trainer.checkpoint_every=0", "metrics.tensorboard=false", "metrics.live=off"]
STEP_KEYS = ("logprob_abs_diff_mean", "logprob_abs_diff_p99", "logprob_abs_diff_all_mean",
             "logprob_abs_diff_all_p99", "mismatch_kl_k3", "is_ratio_p1", "is_ratio_p50",
             "is_ratio_p99", "entropy")
CORRECTION_KEYS = ("correction_weight_mean", "correction_masked", "correction_clipped",
                   "correction_dropped_tokens")


@pytest.mark.parametrize("kind", ["none", "tis", "mis", "icepop", "geo_mask", "decoupled", "m2po"])
def test_a_five_step_run_per_correction_writes_the_new_metrics(kind, tmp_path):
    """The one-process runtime (sync: every sample fresh, so the native engine's fp32 numerics
    are the whole mismatch and every correction keeps every token); ~2 s each."""
    from laminar.config import load_config
    from laminar.metrics import read_metrics
    from laminar.modes import run_training

    cfg = load_config("examples/reverse-sync.yaml", E2E + [f"run_dir={tmp_path}",
                                                           f"trainer.correction={kind}"])
    run_training(cfg)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        for key in STEP_KEYS + (CORRECTION_KEYS if kind != "none" else ()):
            assert r[key] is not None, (key, r)
        assert r["logprob_abs_diff_all_p99"] < 1e-4 and abs(r["mismatch_kl_k3"]) < 1e-8
        assert r["is_ratio_p1"] == pytest.approx(1.0, abs=1e-4) == r["is_ratio_p99"]
        assert 0.0 < r["entropy"]
        if kind not in ("none", "geo_mask"):  # geo_mask's band [0.99, 1.01] holds too
            assert r["correction_dropped_tokens"] == 0 and r["correction_masked"] == 0.0
