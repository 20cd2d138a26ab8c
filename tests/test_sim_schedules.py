"""The five simulated schedules: closed-form toys, determinism, conservation, repack."""

from __future__ import annotations

import dataclasses

import pytest

from laminar.sim import paper
from laminar.sim.calibration import Calibration
from laminar.sim.local import local_setup
from laminar.sim.run import simulate
from laminar.sim.schedules import SCHEDULES
from laminar.sim.schedules import laminar as laminar_schedule

STEP_MS = 10.0  # every decode step costs 10 ms, whatever the batch
LEN, PROMPT = 50, 10  # every response 50 tokens, every prompt 10
PROMPTS, SAMPLES = 8, 4  # global batch: 8 groups of 4 = 32 trajectories
TOKENS = PROMPTS * SAMPLES * (PROMPT + LEN)  # 1920 per global batch
GEN_S = LEN * STEP_MS / 1e3  # 0.5 s: a batch decodes in lockstep


def toy(mode: str, stream_minibatches: bool = False, **kw) -> object:
    """A setup whose answer is known by hand: flat decode curve, huge KV, free prefill,
    constant lengths, trainer time = s_per_token * tokens + per-step overhead."""
    local = dict(decode_latency_ms_by_batch={1: STEP_MS, 64: STEP_MS}, kv_capacity_tokens=10**9,
                 max_running=10**6, prefill_ms_per_token=0.0, trainer_s_per_token=1e-4,
                 trainer_step_overhead_s=0.0, lengths={0.5: LEN, 0.9: LEN, 1.0: LEN},
                 prompt_median=PROMPT, prompt_sigma=0.0, rollout_workers=4, prompts=PROMPTS,
                 samples=SAMPLES, minibatches=1, sync_s=0.0, push_s=0.0, broadcast_s=0.0,
                 pull_s=0.0)
    local.update(kw)
    cal = Calibration(inflight_batches=1.0, partial_inflight_batches=1.0,
                      stream_minibatches=stream_minibatches)
    return local_setup(mode, local, cal)


def period(mode: str, **kw) -> float:
    return TOKENS / SCHEDULES[mode](toy(mode, **kw), 2, 3).throughput


def test_sync_is_generation_plus_training_plus_sync():
    train = TOKENS * 1e-4  # 0.192 s
    assert period("sync", sync_s=0.05) == pytest.approx(GEN_S + train + 0.05)


def test_environment_latency_after_the_last_token_delays_the_batch():
    # A constant 0.3 s reward sandbox after every trajectory: sync waits for it.
    train = TOKENS * 1e-4
    assert period("sync", env_median_s=0.3, env_sigma=0.0) == pytest.approx(GEN_S + 0.3 + train)


def test_sync_controller_is_serial_work_before_the_trainer():
    # 4 mini-batches; the controller (1e-4 s/token) is as slow as the trainer, so only the
    # last mini-batch's training is not hidden behind it.
    p = period("sync", controller_s_per_token=1e-4, minibatches=4)
    assert p == pytest.approx(GEN_S + TOKENS * 1e-4 + TOKENS * 1e-4 / 4)


@pytest.mark.parametrize("mode", ["one_step", "stream"])
def test_one_step_and_stream_overlap_generation_with_training(mode):
    # Generation-bound: the trainer (0.192 s) hides behind generation (0.5 s).
    assert period(mode) == pytest.approx(GEN_S)
    # Trainer-bound (s_per_token 5e-4 -> 0.96 s): generation hides behind training.
    assert period(mode, trainer_s_per_token=5e-4) == pytest.approx(TOKENS * 5e-4)


def test_stream_hides_the_weight_sync_when_the_trainer_is_the_bottleneck():
    """Trainer-bound with a 0.1 s sync: one_step's trainer waits at every barrier for the
    sync; stream's trainer keeps consuming mini-batches, so the sync is off its path."""
    kw = dict(trainer_s_per_token=5e-4, sync_s=0.1)
    assert period("one_step", **kw) == pytest.approx(TOKENS * 5e-4 + 0.1)
    assert period("stream", **kw) == pytest.approx(TOKENS * 5e-4)


@pytest.mark.parametrize("mode", ["laminar", "partial"])
def test_asynchronous_modes_are_trainer_bound_when_rollouts_are_fast(mode):
    # Training 0.96 s per batch, generation 0.5 s: the trainer never waits after warm-up.
    assert period(mode, trainer_s_per_token=5e-4) == pytest.approx(TOKENS * 5e-4, rel=1e-6)


@pytest.mark.parametrize("mode", ["laminar", "partial"])
def test_streamed_minibatches_keep_a_trainer_bound_period(mode):
    """Taking each of 2 mini-batches as soon as its groups are complete trains the same
    tokens in the same trainer time: a trainer-bound period does not change."""
    kw = dict(trainer_s_per_token=5e-4, minibatches=2)
    streamed = SCHEDULES[mode](toy(mode, stream_minibatches=True, **kw), 2, 3)
    assert TOKENS / streamed.throughput == pytest.approx(TOKENS * 5e-4, rel=1e-6)
    t = streamed.tokens
    assert t["generated"] == t["trained"] + t["buffered"] + t["in_flight"] + t["discarded"]


def test_laminar_trainer_pays_only_the_push_stall():
    assert period("laminar", trainer_s_per_token=5e-4, push_s=0.05) == pytest.approx(
        TOKENS * 5e-4 + 0.05)


def test_laminar_rollout_bound_rate_is_replicas_times_batch_over_batch_time():
    # 4 rollouts lease 2 groups each = one global batch per 0.5 s; training (0.192 s) hides.
    assert period("laminar") == pytest.approx(GEN_S)


def test_partial_rollout_pays_a_swap_on_every_update():
    """Rollout-bound partial rollout: each update interrupts everyone for the sync, so the
    period exceeds the pure generation time; laminar has no such global pause."""
    assert period("partial", sync_s=0.1) > GEN_S + 0.05
    assert period("laminar", sync_s=0.1) == pytest.approx(GEN_S)


@pytest.mark.parametrize("mode", paper.MODES)
def test_same_seed_same_result_other_seed_differs(mode):
    cal = Calibration(decode_quantum=64)
    a = simulate(mode, "72b", 64, cal, seed=1, warmup=1, measure=1).as_dict()
    b = simulate(mode, "72b", 64, cal, seed=1, warmup=1, measure=1).as_dict()
    c = simulate(mode, "72b", 64, cal, seed=2, warmup=1, measure=1).as_dict()
    assert a == b
    assert a["throughput"] != c["throughput"]


@pytest.mark.parametrize("mode", paper.MODES)
@pytest.mark.parametrize("stream", [False, True])
def test_tokens_are_conserved(mode, stream):
    """Every decoded token is trained, buffered, still in flight, or discarded — once."""
    cal = Calibration(decode_quantum=64, stream_minibatches=stream)
    r = simulate(mode, "72b", 64, cal, warmup=1, measure=1)
    t = r.tokens
    assert t["generated"] == t["trained"] + t["buffered"] + t["in_flight"] + t["discarded"]
    assert t["trained"] > 0


def test_repack_moves_tails_within_a_version_and_never_mixes_versions():
    cal = Calibration(decode_quantum=16)
    from laminar.sim.core import paper_setup

    on = laminar_schedule.run(paper_setup("laminar", "32b", 128, cal), 1, 2, repack=True)
    off = laminar_schedule.run(paper_setup("laminar", "32b", 128, cal), 1, 2, repack=False)
    assert on.repacks > 0 and on.moved_trajs >= on.repacks
    assert off.repacks == 0
    assert on.mixed_version_trajs == 0  # a trajectory keeps its one version when it moves
    assert min(on.staleness) >= 0


def test_partial_rollout_mixes_versions_and_the_others_do_not():
    cal = Calibration(decode_quantum=64)
    # A trainer faster than the rollouts and eta = 1 keep the backlog short, so interrupted
    # (mixed-version) trajectories reach the trainer within a few updates.
    fast = cal.with_overrides(max_outstanding_batches=2.0, partial_trainer_mfu=1.0,
                              trainer_update_s_per_gb=0.0)
    r = simulate("partial", "72b", 64, fast, warmup=1, measure=2)
    assert r.mixed_version_trajs > 0
    assert max(r.staleness) <= 2  # eta = 1 bounds how late a leased group is consumed
    for mode in ("sync", "one_step", "stream"):
        r = simulate(mode, "72b", 64, cal, warmup=1, measure=1)
        assert r.mixed_version_trajs == 0
        assert max(r.staleness) <= (0 if mode == "sync" else 1)


def test_train_pipeline_controller_streams_and_the_trainer_waits_for_train_after():
    """train_pipeline in closed form: two mini-batches of 10 tokens, controller 0.1 s/token
    (1 s each), trainer 1e-4 s/token (toy). Ready at 1 s and 2 s; the trainer may not start
    before 3 s (one_step: the whole batch generated). The controller streams (done at 2 s
    and 3 s), so only the training remains after 3 s."""
    from laminar.sim.schedules.common import train_pipeline
    from laminar.sim.workload import Traj

    setup = toy("one_step", controller_s_per_token=0.1)
    parts = [(float(i), [Traj(i, i, prompt_len=0, target=10)]) for i in (1, 2)]
    ctrl, trainer, _ = train_pipeline(setup, parts, 0.0, 0.0, train_after=3.0)
    assert ctrl == pytest.approx(3.0)
    assert trainer == pytest.approx(3.0 + 2 * 10 * 1e-4)
    # All ready at the barrier instead (the pre-streaming one_step): the controller's 2 s
    # come after it, and the trainer finishes one controller step after that.
    late = [(3.0, p) for _, p in parts]
    ctrl, trainer, _ = train_pipeline(setup, late, 0.0, 0.0, train_after=3.0)
    assert ctrl == pytest.approx(5.0)
    assert trainer == pytest.approx(5.0 + 10 * 1e-4)


def test_laminar_waits_for_trajectories_still_in_the_environment():
    """Regression: with a finite admission window (max_outstanding_batches) the rollouts
    lease one batch, decode it in 0.5 s and then all sit idle while its trajectories are in
    the reward environment for 6 s, past the 5 s repack check. That is no stall (it raised
    one): the batch arrives when the environment answers, trains, and admission reopens."""
    setup = toy("laminar", env_median_s=6.0, env_sigma=0.0)
    setup = dataclasses.replace(setup, cal=setup.cal.with_overrides(max_outstanding_batches=1.0))
    assert setup.cal.repack_check_s < 6.0
    r = SCHEDULES["laminar"](setup, 2, 3)
    assert TOKENS / r.throughput == pytest.approx(GEN_S + 6.0 + TOKENS * 1e-4)
