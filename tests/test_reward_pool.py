"""Rewards in killable worker processes: a reward that raises, hangs, returns NaN / inf or a
value outside [0, 1] is tried again, then failed with its reason, and the pool goes on serving.
Real processes throughout: a hang really hangs and its worker is really killed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from functools import partial
from pathlib import Path

import pytest

from laminar.config import EnvLatencyConfig, TaskConfig, load_config
from laminar.engine import Engine
from laminar.models import EOS_ID, PAD_ID, build_preset
from laminar.models.tokenizer import build_char_tokenizer, decode_response, encode_prompt
from laminar.modes import schedule
from laminar.pools.experience import ExperienceBuffer
from laminar.pools.partials import PartialPool
from laminar.pools.prompts import PromptPool, PromptSampler
from laminar.rollout.finish import Finisher
from laminar.rollout.io import BoardWeights, LocalBuffer, LocalPartials, LocalPrompts, RolloutIO, WeightBoard
from laminar.rollout.loop import RolloutLoop
from laminar.rollout.requests import sampling_params
from laminar.tasks import Task, build_task
from laminar.tasks.reward_pool import InlineRewards, RewardPool, open_rewards
from laminar.tasks.rewards import similarity_reward
from laminar.types import GenerationRequest, PromptGroup, PromptItem
from waiting import stepping, until

# The response says what the reward does; each call appends its pid to the file named by the
# answer, so a test counts the tries and finds the process that ran them.
PLUGIN = '''
import os, time

def reward(prompt, response, answer):
    with open(answer, "a") as f:
        f.write(f"{os.getpid()}\\n")
    if response == "raise":
        raise RuntimeError("sandbox flaked")
    if response == "hang":
        time.sleep(3600)
    if response == "not a number":
        return None
    return {"nan": float("nan"), "inf": float("inf"), "big": 7.0, "negative": -0.5}.get(response, 0.5)
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "flaky_reward.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))  # the workers get the parent's sys.path
    return "flaky_reward:reward"


def wait_done(calls) -> None:
    until("the pool to finish its calls", lambda: all(c.done for c in calls), poll_s=0.01)


def tries(log: Path) -> list[int]:
    return [int(line) for line in log.read_text().split()] if log.exists() else []


def is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("response,reason", [
    ("raise", "error"), ("not a number", "error"), ("nan", "nan"), ("inf", "nan"),
    ("big", "out_of_range"), ("negative", "out_of_range")])
def test_a_bad_reward_is_retried_then_failed_with_its_reason(plugin, tmp_path, response, reason):
    pool = RewardPool(plugin, num_workers=1, timeout_s=30.0, retries=2)
    try:
        log = tmp_path / "calls"
        call = pool.submit("p", response, str(log))
        wait_done([call])
        assert call.failed == reason and call.reward == 0.0 and call.tries == 3
        assert len(tries(log)) == 3  # really called three times
        good = pool.submit("p", "fine", str(tmp_path / "good"))
        wait_done([good])
        assert (good.reward, good.failed, good.tries) == (0.5, None, 1)
    finally:
        pool.close()


def test_a_hanging_reward_is_killed_at_its_timeout_and_the_pool_goes_on(plugin, tmp_path):
    # 2 s a try: the other worker serves 3 quick calls well within it, even on a busy machine
    pool = RewardPool(plugin, num_workers=2, timeout_s=2.0, retries=1)
    try:
        log = tmp_path / "hang"
        t0 = time.monotonic()
        hang = pool.submit("p", "hang", str(log))
        behind = [pool.submit("p", "fine", str(tmp_path / f"ok{i}")) for i in range(3)]
        wait_done(behind)
        assert not hang.done  # the other worker served them meanwhile
        assert [(c.reward, c.failed, c.tries) for c in behind] == [(0.5, None, 1)] * 3
        wait_done([hang])
        assert hang.failed == "timeout" and hang.tries == 2 and "reward_timeout_s=2" in hang.error
        assert time.monotonic() - t0 >= 4.0  # two tries, each allowed its full 2 s
        pids = tries(log)
        assert len(pids) == 2 and pids[0] != pids[1]  # each try in a fresh worker
        assert all(is_gone(pid) for pid in pids)  # killed and reaped
        after = pool.submit("p", "fine", str(tmp_path / "after"))
        wait_done([after])
        assert (after.reward, after.failed) == (0.5, None)
    finally:
        pool.close()


def test_close_kills_the_workers(plugin, tmp_path):
    pool = RewardPool(plugin, num_workers=2, timeout_s=30.0, retries=0)
    calls = [pool.submit("p", "fine", str(tmp_path / f"c{i}")) for i in range(8)]
    wait_done(calls)
    pids = [w.pid for w in pool.workers]
    assert len(pids) == 2 and not any(is_gone(p) for p in pids)
    pool.close()
    assert all(is_gone(p) for p in pids) and pool.num_pending == 0


def test_workers_die_with_their_parent(plugin, tmp_path):
    """A parent killed with SIGKILL (no chance to close anything) takes its workers along,
    the busy one in a hang included."""
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(tmp_path)!r})
        from laminar.tasks.reward_pool import RewardPool
        pool = RewardPool({plugin!r}, num_workers=2, timeout_s=600.0, retries=0)
        pool.submit("p", "hang", {str(tmp_path / "h")!r})
        calls = [pool.submit("p", "fine", {str(tmp_path / "f")!r}) for _ in range(4)]
        while not all(c.done for c in calls) or not os.path.exists({str(tmp_path / "h")!r}):
            time.sleep(0.01)
        print(" ".join(str(w.pid) for w in pool.workers), flush=True)
        time.sleep(3600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and not any(is_gone(p) for p in pids)
    finally:
        parent.kill()
        parent.wait()
    # not our children: gone once init reaps them
    until(f"workers {pids} to die with their parent", lambda: all(is_gone(p) for p in pids),
          seen=lambda: [p for p in pids if not is_gone(p)])


def test_inline_rewards_keep_the_same_contract():
    calls = []

    def flaky(prompt, response, answer):
        calls.append(response)
        raise ValueError("bad")

    call = InlineRewards(flaky, retries=1).submit("p", "r", "a")
    assert (call.done, call.failed, call.tries, call.error) == (True, "error", 2, "ValueError: bad")
    assert calls == ["r", "r"]
    assert InlineRewards(similarity_reward).submit("p", "abc", "abc").reward == 1.0


def test_isolation_auto_is_inline_for_laminars_rewards_only(plugin):
    assert isinstance(open_rewards(TaskConfig()), InlineRewards)
    assert isinstance(open_rewards(TaskConfig(reward="laminar.tasks.rewards:exact_match_reward")),
                      InlineRewards)
    pool = open_rewards(TaskConfig(reward=plugin, reward_timeout_s=2.0, reward_retries=3))
    assert isinstance(pool, RewardPool) and (pool.timeout_s, pool.retries) == (2.0, 3)
    assert isinstance(open_rewards(TaskConfig(reward_isolation="process")), RewardPool)
    assert isinstance(open_rewards(TaskConfig(reward=plugin, reward_isolation="inline")), InlineRewards)


def test_finisher_hands_on_a_failed_trajectory_marked_and_counted(plugin, tmp_path):
    """The failed sample still leaves the finisher (its group must complete in the buffer),
    with its reason; `len` counts it until then, so the loop knows work is pending."""
    tok = build_char_tokenizer()
    task = Task("dataset", [], [], similarity_reward)
    finisher = Finisher(task, tok, EnvLatencyConfig(), 0,
                        RewardPool(plugin, num_workers=1, timeout_s=1.0, retries=0))
    try:
        for i, response in enumerate(["hang", "fine"]):
            item = PromptItem(0, "p", str(tmp_path / f"log{i}"))
            group = PromptGroup(f"g{i}", item, tok.encode("p"), 1)
            ids = tok.encode(response, add_special_tokens=False)
            finisher.add(GenerationRequest(f"g{i}/0", tok.encode("p"), output_ids=ids,
                                           logprobs=[-0.1] * len(ids), version=0,
                                           finish_reason="eos"), group)
        assert len(finisher) == 2
        out = []
        until("both samples to leave the finisher", lambda: out.extend(finisher.ready()) or len(out) == 2,
              poll_s=0.01)
        by_id = {t.traj_id: t for t in out}
        assert (by_id["g0/0"].failed, by_id["g0/0"].reward) == ("timeout", 0.0)
        assert (by_id["g1/0"].failed, by_id["g1/0"].reward) == (None, 0.5)
        assert len(finisher) == 0
        assert finisher.failed_by_reason == {"timeout": 1} and finisher.reward_errors == 1
    finally:
        finisher.close()


def test_the_loop_completes_groups_whose_samples_failed(tmp_path, monkeypatch):
    """The real rollout loop with a reward in worker processes that fails on odd-length
    responses: every group still completes in the experience buffer, each sample carries its
    outcome, and the loop's counters say how many failed and why."""
    (tmp_path / "odd_reward.py").write_text(
        "def reward(prompt, response, answer):\n"
        "    return float('nan') if len(response) % 2 else 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, ["sft.enabled=false", "task.reverse.max_len=6", "rollout.max_new_tokens=7",
                             "rollout.group_size=4", "trainer.prompts_per_step=3",
                             "task.reward=odd_reward:reward", "task.reward_retries=1"])
    tok = build_char_tokenizer()
    task = build_task(cfg.task)
    policy = schedule("sync").policy(cfg)
    prompts = PromptPool(PromptSampler(task.train, partial(encode_prompt, tok), 4, seed=0), 600.0,
                         policy.max_outstanding)
    buffer = ExperienceBuffer(4)
    io = RolloutIO(LocalPrompts(prompts), LocalPartials(PartialPool()), LocalBuffer(buffer),
                   BoardWeights(WeightBoard()))
    finisher = Finisher(task, tok, cfg.bench.env_latency, 0, open_rewards(cfg.task))
    loop = RolloutLoop("r0", Engine(build_preset("tiny", seed=0), EOS_ID, PAD_ID, max_batch_size=16),
                       io, policy, finisher, sampling_params(cfg), cfg.rollout, heartbeat_s=1.0)
    try:
        loop.request_groups(3)
        stepping("the batch to complete", loop.step, lambda: loop.batch_done)
    finally:
        finisher.close()
    samples = [t for g in buffer.complete for t in g]
    assert len(buffer.complete) == 3 and len(samples) == 12
    odd = [len(decode_response(tok, t.response_ids)) % 2 == 1 for t in samples]
    assert any(odd) and not all(odd)  # both outcomes, in the same groups (fixed seeds)
    assert [t.failed for t in samples] == ["nan" if o else None for o in odd]
    assert [t.reward for t in samples] == [0.0 if o else 0.5 for o in odd]
    counters = loop.snapshot().counters
    assert counters.reward_errors == sum(odd)
    assert counters.failed_by_reason == {"nan": sum(odd)}
