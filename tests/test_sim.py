"""Simulator building blocks: decode curve, replica, workload, fitted costs, CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from laminar.sim import costs, paper
from laminar.sim.cli import main as simulate_main
from laminar.sim.costs import DecodeCurve
from laminar.sim.replica import Replica
from laminar.sim.workload import LengthDistribution, Traj, Workload


def traj(i: int, target: int, prompt: int = 10) -> Traj:
    return Traj(i, i, prompt, target)


def test_steps_s_is_the_sum_of_single_steps_and_steps_within_inverts_it():
    c = DecodeCurve(base_s=0.01, per_seq_s=1e-4, per_kv_s=1e-7)
    b, kv = 32, 5000
    by_hand = sum(c.step_s(b, kv + b * i) for i in range(100))
    assert c.steps_s(b, kv, 100) == pytest.approx(by_hand)
    for dt in (0.0, 0.005, 0.3, by_hand, by_hand + 1e-9, 7.0):
        n = c.steps_within(b, kv, dt)
        assert c.steps_s(b, kv, n) <= dt * (1 + 1e-9) and c.steps_s(b, kv, n + 1) > dt


def test_replica_decodes_exact_tokens_and_releases_its_kv():
    c = DecodeCurve(0.01, 1e-4, 1e-7)
    r = Replica(0, c, kv_capacity=10**6, max_running=64, prefill=lambda t, s: 0.0)
    trajs = [traj(i, 5 + 7 * i) for i in range(10)]
    r.add(0.0, trajs)
    finished = []
    while (t := r.next_time()) is not None:
        finished += r.advance_to(t)
    assert sorted(tr.traj_id for tr in finished) == list(range(10))
    assert r.generated == sum(tr.target for tr in trajs)
    assert r.kv == 0 and r.is_idle
    # All ten started together, so the last one took exactly 68 steps at shrinking batches.
    batches = [sum(tr.target > s for tr in trajs) for s in range(68)]
    expected = sum(c.step_s(b, 0) for b in batches)
    assert r.t == pytest.approx(expected, rel=0.05)  # kv term aside, exact step accounting


def test_replica_preempts_when_the_kv_is_full_and_still_finishes_everything():
    c = DecodeCurve(0.01, 0.0, 0.0)
    r = Replica(0, c, kv_capacity=400, max_running=64, prefill=lambda t, s: 0.001 * t)
    trajs = [traj(i, 60) for i in range(8)]  # 8 x 70 tokens cannot all fit in 400
    r.add(0.0, trajs)
    while (t := r.next_time()) is not None:
        r.advance_to(t)
        assert r.kv <= r.kv_capacity
    assert r.num_preempted > 0
    assert r.generated == 8 * 60 and all(tr.done == 60 for tr in trajs)


def test_replica_quantum_keeps_tokens_exact():
    c = DecodeCurve(0.01, 1e-4, 0.0)
    for q in (1, 16):
        r = Replica(0, c, 10**6, 64, lambda t, s: 0.0, quantum=q)
        trajs = [traj(i, 3 + 11 * i) for i in range(20)]
        r.add(0.0, trajs)
        while (t := r.next_time()) is not None:
            r.advance_to(t)
        assert r.generated == sum(tr.target for tr in trajs)


def test_abort_returns_partial_progress_and_resuming_finishes_the_rest():
    c = DecodeCurve(0.01, 0.0, 0.0)
    a = Replica(0, c, 10**6, 64, lambda t, s: 0.0)
    b = Replica(1, c, 10**6, 64, lambda t, s: 0.0)
    trajs = [traj(i, 100) for i in range(4)]
    a.add(0.0, trajs)
    finished, moved = a.abort_all(0.305)  # 30 whole steps fit before t
    assert not finished and len(moved) == 4 and all(tr.done == 30 for tr in moved)
    assert a.generated == 120 and a.kv == 0 and a.is_idle
    b.add(0.305, moved)
    while (t := b.next_time()) is not None:
        b.advance_to(t)
    assert b.generated == 4 * 70 and b.t == pytest.approx(0.305 + 0.70)


def test_lengths_follow_fig17_and_groups_share_difficulty():
    for model, points in paper.FIG17_QUANTILES.items():
        w = Workload(LengthDistribution.from_points(points), samples=16, group_corr=0.5, seed=0)
        lens = np.array([tr.target for g in w.groups(2000) for tr in g])
        for q in (0.5, 0.9, 0.99):
            assert np.quantile(lens, q) == pytest.approx(points[q], rel=0.05), (model, q)
        assert lens.max() <= 16384
    w = Workload(LengthDistribution.from_points(paper.FIG17_QUANTILES["32b"]), 16, 0.5, seed=1)
    g = np.log([[tr.target for tr in grp] for grp in w.groups(500)])
    within = g.var(axis=1).mean()
    assert within < 0.7 * g.var()  # samples of a prompt are closer than random pairs


def test_decode_fit_reproduces_fig4():
    for (name, tp), pts in paper.FIG4_DECODE_MS.items():
        c = costs.decode_curve(costs.QWEN25[name], tp)
        for b, ms in pts.items():
            assert c.step_s(b, b * paper.FIG4_SEQ_LEN) * 1e3 == pytest.approx(ms, rel=0.12)


def test_chain_model_is_appendix_d_at_the_optimal_chunk_count():
    m, t_byte, t_start, p = 65e9, 1 / 150e9, 5e-4, 64

    def eq1(k: float) -> float:  # T(p, k) = (p + k - 2) (M/k T_byte + T_start)
        return (p + k - 2) * (m / k * t_byte + t_start)

    k_star = math.sqrt((p - 2) * m * t_byte / t_start)
    assert costs.chain_s(m, p, t_byte, t_start) == pytest.approx(eq1(k_star))
    assert eq1(k_star) < min(eq1(k_star / 2), eq1(k_star * 2))


def test_weight_movement_matches_fig14_and_fig18():
    for name, d in paper.FIG14.items():
        m = costs.QWEN25[name]
        for n, s in zip(paper.FIG14_ROLLOUT_GPUS, d["global_sync"]):
            assert costs.global_sync_s(m, n) == pytest.approx(s, rel=0.12)
        assert costs.relay_pull_s(m) == pytest.approx(d["laminar_best"], rel=0.05)
    for machines, s in zip(paper.FIG18_MACHINES, paper.FIG18["32b"]):  # the fitted row
        assert costs.relay_broadcast_s(costs.QWEN25["32b"], machines) == pytest.approx(s, rel=0.1)


def test_cli_single_point_writes_json(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert simulate_main(["--model", "72b", "--gpus", "64", "--quick", "--out", str(out),
                          "--plot", str(tmp_path / "p.png")]) == 0
    data = json.loads(out.read_text())
    assert set(data["throughput_by_mode"]) == set(paper.MODES)
    assert all(v > 0 for v in data["throughput_by_mode"].values())
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "laminar" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--model", "9b"], "invalid choice"),
    (["--model", "7b", "--gpus", "100"], "allowed for 7b: 16, 32, 64, 128, 256"),
    (["--mode", "fast"], "invalid choice"),
])
def test_cli_bad_arguments_exit_2_with_a_clear_message(argv, message, capsys):
    assert simulate_main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_calibration_file_errors_name_the_key(tmp_path, capsys):
    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps({"trainer_mfu": 0.3, "warp_factor": 9}))
    assert simulate_main(["--calibration", str(bad)]) == 2
    assert "warp_factor" in capsys.readouterr().err


def test_cli_local_calibration_predicts_every_mode(tmp_path):
    cal = tmp_path / "local.json"
    cal.write_text(json.dumps({"local": {
        "decode_latency_ms_by_batch": {"1": 8.0, "16": 10.0, "64": 16.0},
        "kv_capacity_tokens": 4096, "rollout_workers": 2, "prompts": 8, "samples": 4}}))
    out = tmp_path / "o.json"
    assert simulate_main(["--calibration", str(cal), "--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["throughput_by_mode"]) == set(paper.MODES)


def test_tool_call_pauses_a_trajectory_without_holding_the_batch():
    c = DecodeCurve(0.01, 0.0, 0.0)
    r = Replica(0, c, 10**6, 64, lambda t, s: 0.0)
    agent = traj(0, 100)
    agent.tool_at, agent.tool_s = (50,), (1.0,)
    plain = traj(1, 120)
    r.add(0.0, [agent, plain])
    finished = {}
    while (t := r.next_time()) is not None:
        if 0.6 < t < 1.4:  # during the call: out of the batch and its KV, still the replica's
            assert agent.state == 4 and r.n_running == 1 and r.num_reqs == 2
            assert r.kv == plain.prompt_len + (r.step - plain.admit_step)
        for tr in r.advance_to(t):
            finished[tr.traj_id] = t
    assert finished[1] == pytest.approx(1.2)  # never waited for the tool call
    assert finished[0] == pytest.approx(0.5 + 1.0 + 0.5)  # decode, tool, decode
    assert r.generated == 220


def test_a_trajectory_moved_during_a_tool_call_keeps_waiting_for_its_result():
    c = DecodeCurve(0.01, 0.0, 0.0)
    a, b = (Replica(i, c, 10**6, 64, lambda t, s: 0.0) for i in range(2))
    agent = traj(0, 100)
    agent.tool_at, agent.tool_s = (50,), (1.0,)
    a.add(0.0, [agent])
    _, moved = a.abort_all(0.8)  # the call started at 0.5 and returns at 1.5
    assert moved == [agent] and agent.done == 50 and a.is_idle
    b.add(0.8, moved)
    assert b.num_reqs == 1 and b.next_time() == pytest.approx(1.5)
    while (t := b.next_time()) is not None:
        b.advance_to(t)
    assert agent.state == 2 and b.t == pytest.approx(2.0)


def test_agentic_workload_runs_every_mode_and_conserves_tokens():
    from laminar.sim.calibration import Calibration
    from laminar.sim.run import simulate

    cal = Calibration(decode_quantum=64, tool_calls_max=4, tool_median_s=5.0)
    for mode in paper.MODES:
        r = simulate(mode, "72b", 64, cal, warmup=1, measure=1)
        t = r.tokens
        assert t["generated"] == t["trained"] + t["buffered"] + t["in_flight"] + t["discarded"]


def _naive_engine(trajs: list[Traj], c: DecodeCurve, cap: int, max_running: int) -> dict:
    """Reference: one decode step at a time, same admission and preemption rules."""
    t, kv, running, waiting, out = 0.0, 0, [], list(trajs), {}
    done = {tr.traj_id: 0 for tr in trajs}
    limit = cap * 0.99
    while running or waiting:
        while waiting and len(running) < max_running:
            ctx = waiting[0].prompt_len + done[waiting[0].traj_id]
            if running and kv + ctx + len(running) + 1 > limit:
                break
            running.append(waiting.pop(0))
            kv += ctx
        while len(running) > 1 and kv + len(running) > cap:
            tr = running.pop()
            kv -= tr.prompt_len + done[tr.traj_id]
            waiting.insert(0, tr)
        t += c.step_s(len(running), kv)
        kv += len(running)
        for tr in list(running):
            done[tr.traj_id] += 1
            if done[tr.traj_id] == tr.target:
                running.remove(tr)
                kv -= tr.prompt_len + tr.target
                out[tr.traj_id] = t
    return out


def test_closed_form_segments_match_a_naive_step_by_step_engine():
    rng = np.random.default_rng(0)
    c = DecodeCurve(0.004, 2e-4, 3e-7)
    for trial in range(5):
        trajs = [Traj(i, i, int(rng.integers(5, 40)), int(rng.integers(1, 120)))
                 for i in range(int(rng.integers(5, 40)))]
        cap, max_running = int(rng.integers(600, 3000)), int(rng.integers(4, 32))
        expected = _naive_engine([Traj(tr.traj_id, tr.group, tr.prompt_len, tr.target)
                                  for tr in trajs], c, cap, max_running)
        r = Replica(0, c, cap, max_running, lambda tok, sq: 0.0, quantum=1)
        r.add(0.0, trajs)
        got = {}
        while (t := r.next_time()) is not None:
            for tr in r.advance_to(t):
                got[tr.traj_id] = t
        assert got.keys() == expected.keys()
        for k in got:
            assert got[k] == pytest.approx(expected[k], rel=1e-9), (trial, k)


def test_megatron_pipeline_bubble_is_1f1b_and_grows_with_strong_scaling():
    # 1e6 tokens per optimizer step over 10 data-parallel ranks = 1e5 tokens each, cut into
    # 32K-token micro-batches = 4 micro-batches; 4 stages: (4 + 3) / 4.
    assert costs.pipeline_stretch(1e6, 10, 4, 32768) == pytest.approx(7 / 4)
    assert costs.pipeline_stretch(1e6, 10, 1, 32768) == 1.0  # no pipeline, no bubble
    assert costs.pipeline_stretch(1e6, 10, 4, float("inf")) == 1.0
    m, tokens, sq = costs.QWEN25["72b"], 10e6, 0.0
    tp_pp = paper.AREAL_TRAIN_TP_PP["72b"]

    def gpu_seconds(g: int, pp: tuple[int, int]) -> float:
        return g * costs.train_s(m, g, tokens, sq, 4, 0.3, pp, 32768)

    # Without a pipeline, GPU-seconds of compute do not change with the GPU count (until the
    # FSDP floor); with AReaL's PP 4 they grow: fewer micro-batches per rank, more bubble.
    assert gpu_seconds(640, tp_pp) > 1.3 * gpu_seconds(64, tp_pp)
    assert gpu_seconds(64, tp_pp) > gpu_seconds(64, (1, 1))


def test_rollout_kv_budget_per_mode_and_fixed_update_cost():
    from laminar.sim.calibration import Calibration
    from laminar.sim.core import paper_setup

    def kv(mode: str, cal: Calibration) -> int:
        return paper_setup(mode, "32b", 64, cal).kv_capacity

    tuned, verl_kv = Calibration(async_baselines_mem_util=0.8), Calibration()
    same = Calibration(colocated_mem_util=0.5, async_baselines_mem_util=0.5)
    # each verl rollout has its own budget; by default one_step and stream keep verl's 0.5
    assert kv("sync", same) == kv("one_step", same) == kv("stream", verl_kv)
    assert kv("sync", verl_kv) < kv("one_step", verl_kv)
    assert kv("one_step", tuned) == kv("laminar", tuned) > kv("sync", tuned)
    assert kv("laminar", verl_kv) == kv("laminar", tuned)
    gb = costs.QWEN25["32b"].weight_bytes / 1e9
    cal = Calibration(trainer_update_s=40.0, trainer_update_s_per_gb=0.5)
    assert paper_setup("laminar", "32b", 64, cal).update_overhead_s == pytest.approx(40 + 0.5 * gb)


def test_fit_cache_key_covers_fields_outside_the_search():
    from laminar.sim.calibration import Calibration
    from laminar.sim.fit import Evaluator

    base = Calibration()
    # a field the search does not vary still changes what is simulated: never a cache hit
    assert Evaluator.key("sync", base) != Evaluator.key("sync", base.with_overrides(
        colocated_mem_util=0.5))
    # a searched field reaches only the modes it applies to
    other = base.with_overrides(partial_trainer_mfu=0.3)
    assert Evaluator.key("sync", base) == Evaluator.key("sync", other)
    assert Evaluator.key("partial", base) != Evaluator.key("partial", other)
