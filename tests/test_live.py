"""The live view: plain lines (no control codes) off a terminal, the panel on one."""

from __future__ import annotations

import io
import re

from rich.console import Console

from laminar.live import LiveState, LiveView, RolloutLine, duration

STEP = {"kind": "step", "time": 12.0, "step": 7, "version": 7, "reward": 0.8123,
        "exact_match": 0.34, "response_len_p50": 6.0, "response_len_p99": 79.0,
        "throughput_tokens_per_s": 6000.4, "loss": 0.08049, "push_stall_s": 0.031,
        "staleness_hist": {"0": 120, "1": 8}, "logprob_abs_diff_all_p99": 0.4812,
        "logprob_abs_diff_p99": 2.9e-06, "is_ratio_p99": 1.294, "correction_masked": 0.0123,
        "entropy": 1.234}
EVAL = {"kind": "eval", "time": 13.0, "step": 5, "version": 6, "rollout": "rollout1",
        "greedy_exact_match": 0.45, "greedy_reward": 0.81, "sampled_exact_match": 0.38,
        "sampled_reward": 0.7, "num_prompts": 128, "eval_s": 2.08}
EVENT = {"kind": "event", "time": 14.0, "what": "repack",
         "detail": "moved 3 trajectories rollout0 -> rollout1"}
SPAN = {"kind": "span", "time": 14.5, "who": "rollout0", "what": "generate", "start": 1.0,
        "end": 2.0, "version": 7}
STATE = LiveState(step=8, rollouts=[
    RolloutLine("rollout0", 7, running=30, waiting=2, kv_util=0.62, tokens_per_s=5300.0,
                state="generating"),
    RolloutLine("rollout1", 6, running=0, waiting=0, kv_util=0.0, tokens_per_s=None,
                state="draining")],
    chain=[("master", 8), ("relay1", 8), ("relay2", None)])
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def feed(view: LiveView) -> None:
    with view:
        view.row({**STEP, "step": 6, "time": 10.0})
        view.row(EVAL)
        view.row(STEP)
        view.row(EVENT)
        view.row(SPAN)
        view.update(STATE)


def test_plain_lines() -> None:
    out = io.StringIO()
    feed(LiveView(30, "off", out))
    text = out.getvalue()
    assert "\x1b" not in text
    lines = text.splitlines()
    assert lines == [
        "step    6/30 | reward 0.812 | exact 0.34 | len p50 6 | p99 79 | tok/s 6000 | loss +0.0805",
        ("held-out (version 6, step 5): greedy exact 0.45, sampled 0.38, reward 0.81 "
         "(128 prompts, 2.1 s)"),
        ("step    7/30 | reward 0.812 | exact 0.34 | len p50 6 | p99 79 | tok/s 6000 | loss +0.0805"
         " | held-out 0.45"),
        "laminar: repack: moved 3 trajectories rollout0 -> rollout1",
    ]


def test_step_line_skips_missing_columns() -> None:
    out = io.StringIO()
    with LiveView(3, "off", out) as view:
        view.row({"kind": "step", "time": 1.0, "step": 1, "reward": 0.5,
                  "throughput_tokens_per_s": None, "loss": -0.01})
    assert out.getvalue() == "step    1/3 | reward 0.500 | loss -0.0100\n"


def test_auto_on_a_file_is_plain() -> None:
    out = io.StringIO()
    view = LiveView(30, "auto", out)
    assert not view.is_live
    feed(view)
    assert "\x1b" not in out.getvalue() and "━" not in out.getvalue()
    assert out.getvalue().startswith("step    6/30 | reward 0.812")


def test_live_panel_shows_rollouts_chain_and_events() -> None:
    out = io.StringIO()
    view = LiveView(30, "on", Console(file=out, force_terminal=True, width=120))
    assert view.is_live
    feed(view)
    raw = out.getvalue()
    assert "\x1b" in raw  # drawn in place
    text = ANSI.sub("", raw)
    final = text[text.rindex("laminar train"):]  # the last frame
    for needle in ("8/30", "ETA", "rollout0", "generating", "v7", "5,300", "62%", "rollout1",
                   "draining", "master v8", "relay1 v8", "relay2 -", "repack: moved 3 trajectories",
                   "reward 0.812", "held-out 0.45 (v6)", "loss +0.0805", "push stall 0.03 s",
                   "staleness", "120", "|Δlogp| p99 4.81e-01", "fresh 2.9e-06",
                   "ratio p99 1.29", "masked 1.2%", "entropy 1.23"):
        assert needle in final, needle
    assert "step    7/30 |" not in text  # no plain lines in live mode
    assert "generate" not in final.replace("generating", "")  # spans are not shown


def test_live_redraws_at_most_four_times_a_second() -> None:
    out = io.StringIO()
    view = LiveView(1000, "on", Console(file=out, force_terminal=True, width=100))
    with view:
        for step in range(1, 200):
            view.row({**STEP, "step": step, "time": step * 0.001})
        drawn = out.getvalue().count("laminar train")
    assert drawn <= 4  # the first frame, perhaps one redraw, and the final frame
    final = ANSI.sub("", out.getvalue())
    assert "199/1000" in final[final.rindex("laminar train"):]


def test_on_forces_live_even_into_a_plain_file() -> None:
    out = io.StringIO()
    feed(LiveView(30, "on", out))
    assert "\x1b" in out.getvalue() and "rollout0" in ANSI.sub("", out.getvalue())


def test_duration() -> None:
    assert [duration(s) for s in (5, 80, 3725)] == ["5s", "1m20s", "1h02m"]
