"""Multi-turn environments: the token loop is exact (what the trainer sees is what the engine
generated plus the observations' ids, with the loss mask and log-probs lined up), with the
built-in template and with a chat template from a tokenizer directory; an environment that
raises, hangs or blocks fails its trajectory, not the caller; episodes move between rollouts
with their environment; `task.env` names a file beside the config."""

from __future__ import annotations

import copy
import textwrap
import time

import pytest
import torch

from laminar.config import ConfigError, load_config
from laminar.engine import Engine
from laminar.envs.episode import Episodes, run_episodes
from laminar.envs.template import TurnTemplate
from laminar.models import EOS_ID, PAD_ID, build_preset
from laminar.models.tokenizer import build_char_tokenizer, encode_prompt
from laminar.tasks import build_task
from laminar.trainer.batching import collate
from laminar.types import GenerationRequest, PromptGroup, SamplingParams
from harness import Recorder, World
from waiting import stepping, until

ENVS = '''
import asyncio, time
from laminar.envs import Env, StepResult

class Echo(Env):
    """Three turns: each turn's text comes back inside brackets; the reward is the turn count."""
    stop = ("]",)
    def __init__(self, tag="obs"):
        self.tag, self.seen = tag, []
    async def reset(self, sample):
        return sample.prompt
    async def step(self, text):
        self.seen.append(text)
        await asyncio.sleep(0.001)
        done = len(self.seen) == 3
        return StepResult(f"<{self.tag}{len(self.seen)}:{text[-3:]}>", len(self.seen) / 3, done,
                          {"exact_match": done})

class Forever(Echo):
    async def step(self, text):
        return StepResult("<more>", 0.25, False, {})

class Raises(Echo):
    async def step(self, text):
        raise RuntimeError("tool broke")

class Hangs(Echo):
    async def step(self, text):
        await asyncio.sleep(3600)

class Blocks(Echo):
    async def step(self, text):
        time.sleep(10.0)  # blocks the environment thread: a bug the runner survives
        return StepResult("", 0.0, True, {})

class Slow(Echo):
    async def step(self, text):
        await asyncio.sleep(3.0)  # the window in which the tests below look
        return StepResult("", 1.0, True, {})

class BadReset(Echo):
    async def reset(self, sample):
        raise ValueError("no such sample")
'''
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("user")
    (d / "my_envs.py").write_text(ENVS)
    return d


def config(env_dir, cls: str, *extra: str):
    """A job file beside my_envs.py naming the environment by a relative file path."""
    job = env_dir / f"job_{cls}.yaml"
    job.write_text(textwrap.dedent(f"""
        task: {{name: reverse, env: "my_envs.py:{cls}", max_turns: 3, env_timeout_s: 1.0,
                reverse: {{max_len: 6}}}}
        sft: {{enabled: false}}
        rollout: {{max_new_tokens: 40, group_size: 2, batch_groups: 2, stream_interval_s: 0}}
        trainer: {{prompts_per_step: 2}}
        """))
    return load_config(str(job), list(extra))


def engine(seed: int = 0) -> Recorder:
    return Recorder(Engine(build_preset("tiny", seed=seed), EOS_ID, PAD_ID, max_batch_size=8))


def check_exact(response_ids, logprobs, mask, generated, generated_logprobs, observations, tokenizer,
                ended_with_eos):
    """Model runs of the mask are the engine's tokens in order; env runs are the observations'
    ids; log-probs of model tokens are the engine's, of env tokens 0."""
    turns = TurnTemplate(tokenizer)
    model = [t for t, m in zip(response_ids, mask) if m]
    assert model == generated
    assert [lp for lp, m in zip(logprobs, mask) if m] == pytest.approx(generated_logprobs)
    runs, i = [], 0
    while i < len(mask):
        j = i
        while j < len(mask) and mask[j] == mask[i]:
            j += 1
        if mask[i] == 0:
            runs.append(response_ids[i:j])
            assert all(lp == 0.0 for lp in logprobs[i:j])
        i = j
    assert runs == [turns.observation_ids(o, e) for o, e in zip(observations, ended_with_eos)]


def observations_of(ended_env):
    return [f"<obs{k + 1}:{text[-3:]}>" for k, text in enumerate(ended_env.seen)]


@pytest.mark.parametrize("chat", [False, True], ids=["built-in", "chat-template"])
def test_episode_tokens_are_exactly_generated_plus_observations(env_dir, tmp_path, chat):
    cfg = config(env_dir, "Echo")
    tokenizer = build_char_tokenizer()
    if chat:  # a Hugging Face tokenizer with a chat template, loaded from a local directory
        from transformers import AutoTokenizer

        tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}<eos>"
                                   "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
        tokenizer.save_pretrained(tmp_path / "tok")
        tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tok")
        assert TurnTemplate(tokenizer).name == "chat"
    task = build_task(cfg.task)
    episodes = Episodes(task, tokenizer, max_turns=3, timeout_s=5.0)
    envs = []
    real_make = task.make_env
    task.make_env = lambda: envs.append(real_make()) or envs[-1]
    eng = engine()
    params = SamplingParams(temperature=1.0, max_new_tokens=60, seed=1)
    items = task.train[:6]
    reqs = [(GenerationRequest(f"t{i}", [], copy.copy(params)), PromptGroup(f"g{i}", it, [], 1))
            for i, it in enumerate(items)]
    ended = {e.request.request_id: e for e in run_episodes(eng, episodes, reqs)}
    assert len(ended) == len(items)
    for (req, group), env in zip(reqs, envs):
        e = ended[req.request_id]
        assert req.prompt_ids == TurnTemplate(tokenizer).prompt_ids(group.item.prompt)
        # the environment saw the text of exactly the tokens generated in each turn
        turn_ids = []
        cur = []
        for tok, m in zip(req.output_ids, e.loss_mask):
            if m:
                cur.append(tok)
            elif cur:
                turn_ids.append(cur)
                cur = []
        turn_ids.append(cur)
        assert [tokenizer.decode(t, skip_special_tokens=True) for t in turn_ids[:len(env.seen)]] == env.seen
        ends = [t[-1] == tokenizer.eos_token_id for t in turn_ids]
        obs = observations_of(env)[:len(turn_ids) - 1]
        check_exact(req.output_ids, req.logprobs, e.loss_mask, eng.tokens[req.request_id],
                    eng.logprobs[req.request_id], obs, tokenizer, ends)
        assert e.turns == len(env.seen) <= 3
        if e.turns == 3:  # reward of the last step; exact match from its info
            assert e.reward == 1.0 and e.exact_match
    if chat:
        scripted_turns_render_as_the_chat_template(task, tokenizer)


def scripted_episode(task, tokenizer, item, turns, timeout_s: float = 10.0):
    """One episode whose model turns are given as (text, finish reason), not generated."""
    episodes = Episodes(task, tokenizer, max_turns=len(turns), timeout_s=timeout_s)
    req = GenerationRequest("s", [], SamplingParams(max_new_tokens=200))
    episodes.begin(req, PromptGroup("s", item, [], 1))

    def wait(get):
        return until("the environment's next turn", get, seen=lambda: dict(episodes.failed_by_reason),
                     poll_s=0.002)

    for text, reason in turns:
        wait(episodes.next_turns)
        ids = tokenizer.encode(text, add_special_tokens=False)
        ids += [tokenizer.eos_token_id] if reason == "eos" else []
        req.output_ids += ids
        req.logprobs += [-1.0] * len(ids)
        req.token_versions += [0] * len(ids)
        req.finish_reason = reason
        episodes.end_turn(req)
    return req, wait(episodes.finished)


def scripted_turns_render_as_the_chat_template(task, tokenizer):
    """Turns whose text re-encodes to the same ids (the random model's often do not: it emits ids
    past the tokenizer's vocabulary) give the transcript the chat template renders."""
    item = task.train[0]
    turns = [("abc]", "stop"), ("xy", "eos"), ("done", "eos")]
    req, ended = scripted_episode(task, tokenizer, item, turns)
    messages = [{"role": "user", "content": item.prompt}]
    for k, (text, _) in enumerate(turns):
        messages.append({"role": "assistant", "content": text})
        if k < 2:
            messages.append({"role": "tool", "content": f"<obs{k + 1}:{text[-3:]}>"})
    rendered = tokenizer.apply_chat_template(messages, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert ended[0].turns == 3 and ended[0].reward == 1.0
    assert req.prompt_ids + req.output_ids == rendered  # the model ended its last turn with <eos>
    model_ids = sum(len(tokenizer.encode(t, add_special_tokens=False)) + (r == "eos") for t, r in turns)
    assert ended[0].loss_mask.count(1) == model_ids


def test_failing_environments_fail_their_trajectory_and_are_counted(env_dir):
    tokenizer = build_char_tokenizer()
    eng = engine()
    params = SamplingParams(temperature=1.0, max_new_tokens=30, seed=3)
    results = {}
    for cls in ("Raises", "Hangs", "BadReset", "Forever"):
        task = build_task(config(env_dir, cls).task)
        episodes = Episodes(task, tokenizer, max_turns=3, timeout_s=0.5)
        t0 = time.monotonic()
        ended = run_episodes(eng, episodes, [(GenerationRequest(f"{cls}{i}", [], copy.copy(params)),
                                              PromptGroup(f"{cls}{i}", task.train[i], [], 1))
                                             for i in range(3)])
        results[cls] = (ended, dict(episodes.failed_by_reason), time.monotonic() - t0)
    ended, failed, _ = results["Raises"]
    assert all(e.failed == "env_error" and "tool broke" in e.error for e in ended)
    assert failed == {"env_error": 3}
    ended, failed, took = results["Hangs"]
    assert all(e.failed == "env_timeout" for e in ended) and failed == {"env_timeout": 3}
    assert took < 60.0  # the 0.5 s timeout ended them, not the hour-long hang
    assert all(e.failed == "env_error" and "no such sample" in e.error for e in results["BadReset"][0])
    ended, failed, _ = results["Forever"]  # never done: ended after max_turns, scored, not failed
    assert failed == {} and all(e.turns == 3 and e.failed is None and e.reward == 0.25
                                for e in ended if e.request.finish_reason != "length")


def test_an_environment_that_blocks_its_thread_times_out_and_the_next_episodes_run(env_dir):
    tokenizer = build_char_tokenizer()
    eng = engine()
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=5)
    blocks = build_task(config(env_dir, "Blocks").task)
    # the step blocks the thread for 10 s; at the 2 s timeout the thread has not beaten for
    # over EnvRunner's 1 s, so the runner leaves it (before, with a 0.5 s timeout, the next
    # episode queued behind the block and the test passed by 0.1 s on an idle machine)
    ended = run_episodes(eng, Episodes(blocks, tokenizer, 3, 2.0),
                         [(GenerationRequest("b0", [], params), PromptGroup("b0", blocks.train[0], [], 1))])
    assert ended[0].failed == "env_timeout"
    echo = build_task(config(env_dir, "Echo").task)  # the thread is still blocked: a fresh one runs it
    ended = run_episodes(eng, Episodes(echo, tokenizer, 3, 5.0),
                         [(GenerationRequest("e0", [], params), PromptGroup("e0", echo.train[0], [], 1))])
    assert ended[0].failed is None  # behind the block (8 s more) it would time out at 5 s


def test_env_path_errors_name_the_key(env_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"task.env='.*nope.py:Echo': no file"):
        build_task(load_config(None, [f"task.env={tmp_path}/nope.py:Echo"]).task)
    with pytest.raises(ConfigError, match="has no Class 'Missing'"):
        build_task(config(env_dir, "Missing").task)
    with pytest.raises(ConfigError, match="task.env_args"):
        build_task(config(env_dir, "Echo", "task.env_args={colour: red}").task)
    (tmp_path / "sync_env.py").write_text("class S:\n    def reset(self, s): ...\n    def step(self, t): ...\n")
    with pytest.raises(ConfigError, match="must be `async def`"):
        build_task(load_config(None, [f"task.env={tmp_path}/sync_env.py:S"]).task)


def test_collate_trains_only_model_tokens():
    from laminar.types import Trajectory

    t = Trajectory("g/0", "g", [1, 5], [7, 8, 9, 10], [-0.5, 0.0, 0.0, -0.25], 0, 1.0,
                   loss_mask=[1, 0, 0, 1], turns=2)
    batch = collate([t], torch.tensor([1.0]), PAD_ID)
    assert batch.response_mask[0].tolist() == [0.0, 1.0, 0.0, 0.0, 1.0]  # position 0 predicts
    assert batch.old_logprobs[0].tolist() == [0.0, -0.5, 0.0, 0.0, -0.25]  # the prompt's 2nd id


def test_rollout_loop_runs_episodes_and_repack_moves_them_with_their_environment(env_dir):
    cfg = config(env_dir, "Echo", "rollout.max_new_tokens=60", "rollout.batch_groups=1")
    world = World(cfg)
    a, b = world.loop("a"), world.loop("b")
    a.request_groups(1)
    # step a until an episode is decoding its second turn, then move everything a decodes to b
    stepping("an episode of a to decode its second turn", a.step, lambda: any(
        ep.turns >= 1 and ep.call is None and rid in a.in_flight
        for rid, ep in a.finisher.episodes.live.items()))
    import pickle

    moved = pickle.loads(pickle.dumps(a.export()))  # as a Ray call to another process would
    assert moved and all(m.episode is not None and m.episode.request is m.request for m in moved)
    assert any(m.episode.env.seen for m in moved)  # mid-episode, its environment's state along
    assert b.adopt(moved)
    a.release()
    stepping("the moved group to complete", lambda: a.step() | b.step(),
             lambda: len(world.buffer.complete) >= 1)
    trajs = world.buffer.complete[0]
    assert {t.traj_id for t in trajs} == {f"{trajs[0].group_id}/0", f"{trajs[0].group_id}/1"}
    for t in trajs:
        assert t.failed is None and 1 <= t.turns <= 3
        mask = t.loss_mask or [1] * len(t.response_ids)
        assert len(mask) == len(t.response_ids) == len(t.logprobs)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, mask) if not m)
    assert b.counters.adopted == len(moved) and a.counters.exported == len(moved)
    records = a.take_records()
    assert records["turns"] or b.take_records()["turns"]


def test_episodes_in_their_tools_do_not_hold_back_new_groups(env_dir):
    """rollout.batch_groups bounds what the engine generates: while a group's episodes wait on
    a slow tool, the next group starts (it waited for the tool before); the group in its tool
    still holds the weights, and the tool's answer arrives without a poll of every call."""
    cfg = config(env_dir, "Slow", "rollout.batch_groups=1", "task.env_timeout_s=30")
    world = World(cfg)
    a = world.loop("a")
    episodes = a.finisher.episodes
    stepping("the first group's two episodes to wait on their tool", a.step,
             lambda: len(episodes.calling) == 2 and all(
                 ep.call_kind == "step" for ep in episodes.calling.values()))
    first = set(episodes.calling)
    stepping("a second group to start while the first waits", a.step,
             lambda: a.counters.batches >= 2)
    assert first <= set(episodes.calling)  # the first group is still in its tool
    assert a.num_active > 2
    stepping("both groups in the buffer", a.step, lambda: len(world.buffer.complete) >= 2)
    assert all(t.failed is None for g in world.buffer.complete for t in g)


def test_an_evaluation_waiting_on_its_tools_lets_the_loop_nap(env_dir):
    """A multi-turn evaluation whose episodes all wait on their tools has nothing to do: the
    loop's step says so and the loop naps (it spun a core through every tool-heavy evaluation
    before); the evaluation still finishes when the tools answer."""
    from laminar.rollout.evals import EvalJob, Evaluator
    from laminar.rollout.finish import make_episodes
    from laminar.rollout.requests import sampling_params

    cfg = config(env_dir, "Slow", "task.env_timeout_s=30")
    world = World(cfg)
    world.publish(0, seed=0)
    loop = world.loop()
    loop.held = True  # no training work: only the evaluation
    loop.evaluator = Evaluator(lambda: Engine(copy.deepcopy(world.model), EOS_ID, PAD_ID,
                                              max_batch_size=8, version=0),
                               world.tokenizer, world.task,
                               episodes=make_episodes(cfg, world.task, world.tokenizer))
    loop.request_eval(EvalJob("e", 0, 0, world.task.eval[:2], sampling_params(cfg)))
    episodes = loop.evaluator.episodes
    stepping("every episode of the evaluation in its tool", loop.step,
             lambda: len(episodes.calling) == 4 and all(
                 ep.call_kind == "step" for ep in episodes.calling.values()))
    assert not loop.step()  # nothing to decode until a tool answers (3 s)
    results: list = []
    stepping("the evaluation to finish", loop.step,
             lambda: results.extend(loop.take_records()["evals"]) or results)
    assert results[0]["num_prompts"] == 2 and results[0]["greedy_reward"] == 1.0


def test_a_reward_is_the_one_turn_case_of_the_environment_api():
    """RewardEnv through the episode loop scores what the one-turn reward path scores."""
    from laminar.envs import RewardEnv
    from laminar.tasks.rewards import similarity_reward

    task = build_task(load_config(None, ["task.reverse.max_len=6"]).task)
    tokenizer = build_char_tokenizer()
    task.make_env = lambda: RewardEnv(similarity_reward)
    eng = engine()
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7)
    items = task.train[:6]
    ended = run_episodes(eng, Episodes(task, tokenizer, max_turns=4, timeout_s=5.0),
                         [(GenerationRequest(f"r{i}", [], copy.copy(params)),
                           PromptGroup(f"r{i}", it, [], 1)) for i, it in enumerate(items)])
    for e in ended:
        text = tokenizer.decode(e.request.output_ids, skip_special_tokens=True)
        scored = task.score(e.group.item, text)
        assert e.turns == 1 and e.loss_mask == [1] * len(e.request.output_ids)
        assert (e.reward, e.exact_match) == (scored.reward, scored.exact_match)
        assert e.request.prompt_ids == encode_prompt(tokenizer, e.group.item.prompt)


def test_the_worked_example_in_docs_agentic_md_runs(tmp_path):
    """docs/agentic.md's Calculator, copied from the page, through a scripted episode with the
    real sandbox: a tool call, its output as the observation, the answer scored."""
    import re
    from pathlib import Path

    from laminar.sandbox import SandboxError, resolve_backend
    from laminar.types import PromptItem

    try:
        resolve_backend(load_config(None, []).sandbox)
    except SandboxError as e:
        pytest.skip(f"no sandbox here: {e}")
    page = (Path(__file__).parent.parent / "docs" / "agentic.md").read_text()
    code = re.search(r"```python\n(# my_envs.py.*?)```", page, re.S).group(1)
    (tmp_path / "my_envs.py").write_text(code)
    task = build_task(load_config(None, [f"task.env={tmp_path}/my_envs.py:Calculator"]).task)
    task.train = [PromptItem(0, "Q:6*7\n", "42")]
    tokenizer = build_char_tokenizer()
    req, ended = scripted_episode(task, tokenizer, task.train[0],
                                  [("<py>print(6*7)</py>", "stop"), ("42", "eos")])
    assert ended[0].failed is None and ended[0].reward == 1.0 and ended[0].exact_match
    text = tokenizer.decode(req.output_ids, skip_special_tokens=True)
    assert text == "<py>print(6*7)</py>\n<out>42\n</out>\nA:42", text
