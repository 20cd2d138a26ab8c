"""The OpenAI-compatible endpoint (`task.agent`, `rollout.openai_server`): an agent written
against the real `openai` client talks to a real HTTP server in this process while a real engine
generates its turns. What the trainer sees is exactly the engine's tokens plus the template's
rendering of the agent's new messages; the endpoint's answers (text, usage, log-probs) are those
tokens; requests without the secret, for an unknown session, or that rewrite the conversation
are refused; an agent that fails, stops early or overruns its turns ends its episode as the
environment API says. The last test trains three steps on Ray with an agent."""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import textwrap
import time
from pathlib import Path

import openai
import pytest

from laminar.config import ConfigError, load_config
from laminar.engine import Engine
from laminar.envs.episode import _RUNNER, Episodes, run_episodes
from laminar.envs.openai_agent import resolve_agent
from laminar.envs.openai_server import running_server, serve
from laminar.envs.template import TurnTemplate
from laminar.models import EOS_ID, PAD_ID, build_preset
from laminar.models.tokenizer import build_char_tokenizer
from laminar.tasks import build_task
from laminar.types import GenerationRequest, PromptGroup, SamplingParams
from harness import Recorder

AGENTS = '''
import asyncio
import openai

SEEN = {}   # sample index -> what the agent saw


def strict(client):
    """A client of the agent's own on the base URL and key it was given, which validates every
    response strictly against the OpenAI types."""
    return openai.AsyncOpenAI(base_url=str(client.base_url), api_key=client.api_key,
                              max_retries=0, _strict_response_validation=True)


async def three_turns(client, sample):
    c = strict(client)
    seen = SEEN[sample.index] = {"turns": [], "refused": []}
    try:  # refused, and the episode goes on
        await c.chat.completions.create(model="policy", stream=True,
                                        messages=[{"role": "user", "content": "x"}])
    except openai.BadRequestError as e:
        seen["refused"].append(e.body["message"])
    messages = [{"role": "system", "content": "S:"}, {"role": "user", "content": sample.prompt}]
    follow_ups = [[{"role": "user", "content": "\\nagain:"}],
                  [{"role": "tool", "content": "<t>"}, {"role": "user", "content": "?"}]]
    for k in range(3):
        r = await c.chat.completions.create(model="policy", messages=messages, logprobs=True,
                                            temperature=0.3, max_tokens=5)  # both ignored
        choice = r.choices[0]
        seen["turns"].append({"text": choice.message.content, "finish": choice.finish_reason,
                              "usage": r.usage.model_dump(), "model": r.model,
                              "logprobs": [t.logprob for t in choice.logprobs.content]})
        messages.append(choice.message if k == 1 else  # the client's own object works too
                        {"role": "assistant", "content": choice.message.content})
        if k < 2:
            messages += follow_ups[k]
    seen["follow_ups"] = follow_ups
    seen["first"] = messages[:2]
    return 0.25 * len(seen["turns"])


async def closes_client(client, sample):
    async with client:  # closes it: the other episodes' connections stay open
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
    return 1.0


async def edits_history(client, sample):
    r = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": sample.prompt}])
    await client.chat.completions.create(model="p", messages=[
        {"role": "user", "content": "something else"},
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": "next"}])
    return 1.0


async def raises(client, sample):
    await client.chat.completions.create(model="p", messages=[{"role": "user", "content": sample.prompt}])
    raise ValueError("the tool broke")


async def never_asks(client, sample):
    return 1.0


async def says_yes(client, sample):
    await client.completions.create(model="p", prompt=sample.prompt)
    return "yes"


async def overruns(client, sample, catch=True):
    """Asks forever; after the last turn its request is refused and it returns (or gives up)."""
    messages = [{"role": "user", "content": sample.prompt}]
    while True:
        try:
            r = await client.chat.completions.create(model="p", messages=messages)
        except openai.BadRequestError as e:
            if not catch:
                raise
            SEEN[("overrun", sample.index)] = e.code
            return 0.5
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "more"}]


async def gives_up(client, sample):
    return await overruns(client, sample, catch=False)


async def completes(client, sample):
    """The text endpoint: each prompt is the previous prompt, the completion and more text."""
    prompt, texts = sample.prompt, []
    for k in range(2):
        r = await strict(client).completions.create(model="p", prompt=prompt, logprobs=0)
        texts.append((r.choices[0].text, r.usage.completion_tokens, r.choices[0].logprobs.token_logprobs))
        prompt += r.choices[0].text + f"<obs{k}>"
    SEEN[("text", sample.index)] = texts
    return 1.0


async def stops(client, sample):
    """`stop` ends a turn at any of its strings, and the reply leaves the string out."""
    messages, replies = [{"role": "user", "content": sample.prompt}], []
    for stop in (list("abcdefghijklmnopqrstuvwxyz"), list("ABCDEFGHIJKLMNOPQRSTUVWXYZ")):
        r = await client.chat.completions.create(model="p", messages=messages, stop=stop)
        replies.append((r.choices[0].message.content, stop))
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "!"}]
    SEEN[("stops", sample.index)] = replies
    return 1.0


async def two_at_once(client, sample):
    m = [{"role": "user", "content": sample.prompt}]
    out = await asyncio.gather(client.chat.completions.create(model="p", messages=m),
                               client.chat.completions.create(model="p", messages=m),
                               return_exceptions=True)
    SEEN[("twice", sample.index)] = sorted(type(o).__name__ for o in out)
    return 1.0
'''

STOP_IDS = tuple(range(100, 128))  # the tiny random model's turns end after a few tokens
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    d = tmp_path_factory.mktemp("user")
    (d / "my_agents.py").write_text(AGENTS)
    return d / "my_agents.py"


def agent_task(path: Path, name: str):
    cfg = load_config(None, [f"task.agent={path}:{name}", "rollout.openai_server=true",
                             "task.reverse.max_len=6"])
    return build_task(cfg.task)


def run(task, tokenizer, n: int, max_turns: int = 4, budget: int = 400, timeout_s: float = 20.0):
    eng = Recorder(Engine(build_preset("tiny", seed=0), EOS_ID, PAD_ID, max_batch_size=8))
    params = SamplingParams(temperature=1.0, max_new_tokens=budget, stop_token_ids=STOP_IDS)
    reqs = [(GenerationRequest(f"t{i}", [], dataclasses.replace(params, seed=i)),
             PromptGroup(f"g{i}", item, [], 1)) for i, item in enumerate(task.train[:n])]
    episodes = Episodes(task, tokenizer, max_turns, timeout_s)
    ended = {e.request.request_id: e for e in run_episodes(eng, episodes, reqs)}
    return [(ended[req.request_id], group.item) for req, group in reqs], eng, episodes


def runs_of(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, mask value) of each run of equal mask values."""
    out, i = [], 0
    while i < len(mask):
        j = i
        while j < len(mask) and mask[j] == mask[i]:
            j += 1
        out.append((i, j, mask[i]))
        i = j
    return out


def chat_tokenizer(tmp_path):
    """A Hugging Face tokenizer with a chat template, loaded from a local directory."""
    from transformers import AutoTokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}<eos>"
                               "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    tokenizer.save_pretrained(tmp_path / "tok")
    return AutoTokenizer.from_pretrained(tmp_path / "tok")


@pytest.mark.parametrize("chat", [False, True], ids=["built-in", "chat-template"])
def test_agent_turns_are_the_engines_tokens(agents, tmp_path, chat):
    tokenizer = chat_tokenizer(tmp_path) if chat else build_char_tokenizer()
    template = TurnTemplate(tokenizer)
    assert template.name == ("chat" if chat else "built-in")
    task = agent_task(agents, "three_turns")
    seen_by = resolve_agent(f"{agents}:three_turns").__globals__["SEEN"]
    ended, eng, _ = run(task, tokenizer, n=4)
    for e, item in ended:
        seen, req = seen_by[item.index], e.request
        assert e.failed is None, e.error
        assert e.turns == 3 and e.reward == 0.75  # the agent's return value
        assert seen["refused"] == ["stream=true is not supported: the endpoint answers whole turns"]
        # what the trainer sees: the engine's own tokens, where the loss mask says model
        generated = eng.tokens[req.request_id]
        assert [t for t, m in zip(req.output_ids, e.loss_mask) if m] == generated
        assert [lp for lp, m in zip(req.logprobs, e.loss_mask) if m] == pytest.approx(
            eng.logprobs[req.request_id])
        assert req.prompt_ids == template.prompt_ids(seen["first"])
        runs = runs_of(e.loss_mask)
        model_runs = [(a, b) for a, b, m in runs if m]
        env_runs = [(a, b) for a, b, m in runs if not m]
        assert len(model_runs) == 3 and len(env_runs) == 2
        for (a, b), turn in zip(model_runs, seen["turns"]):  # what the agent got: those tokens
            ids = req.output_ids[a:b]
            assert turn["text"] == tokenizer.decode(ids, skip_special_tokens=True)
            assert turn["finish"] == "stop" and turn["model"] == "policy"
            assert turn["usage"]["completion_tokens"] == b - a
            assert turn["usage"]["prompt_tokens"] == len(req.prompt_ids) + a
            assert turn["logprobs"] == pytest.approx(req.logprobs[a:b])
        for (a, b), (_, end), follow in zip(env_runs, model_runs, seen["follow_ups"]):
            ended_with_eos = req.output_ids[end - 1] == tokenizer.eos_token_id
            assert req.output_ids[a:b] == template.observation_ids(follow, ended_with_eos)
    # the random model's ids are not what its text re-encodes to: exactness is not luck
    some = ended[0][0].request.output_ids
    text = tokenizer.decode(some, skip_special_tokens=True)
    assert tokenizer.encode(text, add_special_tokens=False) != some


def test_scripted_turns_render_as_the_chat_template(agents, tmp_path):
    """Turns given as text (one ended by EOS, one by a stop token): the whole transcript is the
    chat template's rendering of the agent's final conversation, token for token; the end token
    of the turn that lacked one is the environment's (masked)."""
    tokenizer = chat_tokenizer(tmp_path)
    task = agent_task(agents, "three_turns")
    item = task.train[5]
    episodes = Episodes(task, tokenizer, max_turns=4, timeout_s=10.0)
    req = GenerationRequest("s", [], SamplingParams(max_new_tokens=300))
    episodes.begin(req, PromptGroup("s", item, [], 1))
    for text, reason in [("abc", "eos"), ("xy", "stop"), ("done", "eos")]:
        while not episodes.next_turns():
            time.sleep(0.001)
        ids = tokenizer.encode(text, add_special_tokens=False)
        ids += [tokenizer.eos_token_id] if reason == "eos" else []
        req.output_ids += ids
        req.logprobs += [-1.0] * len(ids)
        req.token_versions += [0] * len(ids)
        req.finish_reason = reason
        episodes.end_turn(req)
    while not (ended := episodes.finished()):
        time.sleep(0.001)
    seen = resolve_agent(f"{agents}:three_turns").__globals__["SEEN"][item.index]
    assert ended[0].failed is None and ended[0].turns == 3 and ended[0].reward == 0.75
    assert [t["text"] for t in seen["turns"]] == ["abc", "xy", "done"]
    conversation = [*seen["first"], {"role": "assistant", "content": "abc"}, *seen["follow_ups"][0],
                    {"role": "assistant", "content": "xy"}, *seen["follow_ups"][1],
                    {"role": "assistant", "content": "done"}]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert req.prompt_ids + req.output_ids == rendered
    assert ended[0].loss_mask.count(1) == len("abc") + 1 + len("xy") + len("done") + 1


def test_completions_endpoint_continues_the_text(agents):
    tokenizer = build_char_tokenizer()
    task = agent_task(agents, "completes")
    seen_by = resolve_agent(f"{agents}:completes").__globals__["SEEN"]
    ended, eng, _ = run(task, tokenizer, n=2)
    for e, item in ended:
        req = e.request
        assert e.failed is None and e.turns == 2 and e.reward == 1.0
        (a, b), (c, d) = [(a, b) for a, b, m in runs_of(e.loss_mask) if m]
        texts = seen_by[("text", item.index)]
        assert [t[0] for t in texts] == [tokenizer.decode(req.output_ids[x:y], skip_special_tokens=True)
                                         for x, y in ((a, b), (c, d))]
        assert [t[1] for t in texts] == [b - a, d - c]
        assert texts[0][2] == pytest.approx(req.logprobs[a:b])
        assert req.output_ids[b:c] == tokenizer.encode("<obs0>", add_special_tokens=False)
        assert [t for t, m in zip(req.output_ids, e.loss_mask) if m] == eng.tokens[req.request_id]


def test_stop_strings_end_a_turn(agents):
    tokenizer = build_char_tokenizer()
    seen = resolve_agent(f"{agents}:stops").__globals__["SEEN"]
    ended, _, _ = run(agent_task(agents, "stops"), tokenizer, n=6)
    by_stop = 0
    for e, item in ended:
        req = e.request
        assert e.failed is None and e.turns == 2
        model_runs = [(a, b) for a, b, m in runs_of(e.loss_mask) if m]
        for (a, b), (reply, stop) in zip(model_runs, seen[("stops", item.index)]):
            text = tokenizer.decode(req.output_ids[a:b], skip_special_tokens=True)
            stop = [stop] if isinstance(stop, str) else stop
            assert not any(s in text[:-1] for s in stop)  # nothing past the first stop string
            if text and text[-1] in "".join(stop):
                assert reply == text[:-1]
                by_stop += 1
            else:
                assert reply == text
    assert by_stop >= 3, by_stop


def test_agent_failures_end_the_episode_as_the_environment_api_says(agents):
    tokenizer = build_char_tokenizer()
    seen = resolve_agent(f"{agents}:overruns").__globals__["SEEN"]
    outcome = {}
    for name in ("closes_client", "edits_history", "raises", "never_asks", "says_yes", "overruns", "gives_up",
                 "two_at_once"):
        ended, _, episodes = run(agent_task(agents, name), tokenizer, n=2, max_turns=2)
        outcome[name] = ([e for e, _ in ended], dict(episodes.failed_by_reason))
    ended, failed = outcome["closes_client"]
    assert failed == {} and all(e.reward == 1.0 for e in ended)
    ended, failed = outcome["edits_history"]
    assert failed == {"env_error": 2}
    assert all("do not extend the conversation so far: message 0 was user" in e.error and
               "is now user 'something else'" in e.error for e in ended)
    ended, failed = outcome["raises"]
    assert failed == {"env_error": 2} and all("ValueError: the tool broke" in e.error for e in ended)
    ended, failed = outcome["never_asks"]
    assert all("ended before its first request" in e.error for e in ended)
    ended, failed = outcome["says_yes"]
    assert all("returned 'yes', not a finite reward" in e.error for e in ended)
    # past task.max_turns: the request is refused; an agent that returns keeps its reward, one
    # that raises is a truncated episode scored 0 (neither is a failure)
    ended, failed = outcome["overruns"]
    assert failed == {} and all(e.turns == 2 and e.reward == 0.5 for e in ended)
    assert {seen[("overrun", i)] for i in (0, 1)} == {"context_length_exceeded"}
    ended, failed = outcome["gives_up"]
    assert failed == {} and all(e.turns == 2 and e.reward == 0.0 for e in ended)
    ended, failed = outcome["two_at_once"]
    assert failed == {} and all(e.reward == 1.0 for e in ended)
    assert {tuple(seen[("twice", i)]) for i in (0, 1)} == {("ChatCompletion", "ConflictError")}


def test_budget_ends_with_length_and_refuses_what_does_not_fit(agents):
    """A small budget: a turn cut by it says finish_reason=length, and the next request is
    refused; the agent's return is the reward."""
    tokenizer = build_char_tokenizer()
    ended, _, episodes = run(agent_task(agents, "overruns"), tokenizer, n=4, max_turns=50, budget=12)
    assert episodes.failed_by_reason == {}
    assert all(e.reward == 0.5 and len(e.request.output_ids) <= 12 for e, _ in ended)


def test_hundreds_of_episodes_at_once(agents):
    """A held-out evaluation begins hundreds of episodes together: every agent's request gets
    through (no connection cap, no refused connection) and is answered."""
    ended, _, episodes = run(agent_task(agents, "raises"), build_char_tokenizer(), n=300,
                             max_turns=1, timeout_s=60.0)
    assert all(e.turns == 1 for e, _ in ended)
    assert episodes.failed_by_reason == {"env_error": 300}  # each raised after its answer
    assert all("ValueError: the tool broke" in e.error for e, _ in ended)


def test_an_ended_episode_counts_until_collected(agents):
    """Regression: an episode that ended between two hand-ons was counted nowhere, so a
    rollout reported its batch done one group short; with cluster.backend=local the trainer then
    waited for that group while nothing stepped the loop (a sync run hung)."""
    task = agent_task(agents, "never_asks")
    episodes = Episodes(task, build_char_tokenizer(), 2, 10.0)
    episodes.begin(GenerationRequest("s", [], SamplingParams(max_new_tokens=20)),
                   PromptGroup("s", task.train[0], [], 1))
    while not episodes.ended:
        episodes.poll()
        time.sleep(0.001)
    assert episodes.num_outside_engine == 1 and len(episodes.finished()) == 1
    assert episodes.num_outside_engine == 0


def test_episode_of_an_agent_stays_on_its_rollout(agents):
    """Repack moves episodes with their environment; an agent's is a running coroutine."""
    tokenizer = build_char_tokenizer()
    task = agent_task(agents, "raises")
    episodes = Episodes(task, tokenizer, 2, 10.0)
    req = GenerationRequest("s", [], SamplingParams(max_new_tokens=20))
    episodes.begin(req, PromptGroup("s", task.train[0], [], 1))
    while not episodes.next_turns():  # reset done: the first request is in, the turn decodes
        pass
    assert episodes.detach("s") is None and "s" in episodes.live
    episodes.close()


def raw(url: str, method: str, path: str, key: str | None) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    conn.request(method, path, body=b"{}", headers=headers)
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def test_requests_need_the_secret_and_a_live_session():
    server = _RUNNER.submit(running_server()).result(timeout=10)
    status, body = raw(server.url, "POST", "/s/abc/v1/chat/completions", None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert raw(server.url, "GET", "/v1/models", "wrong")[0] == 401
    status, body = raw(server.url, "POST", "/s/abc/v1/chat/completions", server.secret)
    assert status == 404 and body["error"]["code"] == "session_not_found"
    assert raw(server.url, "GET", "/v1/nothing", server.secret)[0] == 404

    async def with_client():
        c = openai.AsyncOpenAI(base_url=server.base_url("nosuch"), api_key=server.secret, max_retries=0)
        models = await c.models.list()
        with pytest.raises(openai.NotFoundError, match="no session 'nosuch'"):
            await c.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
        bad = c.with_options(api_key="not the secret")
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
        return [m.id for m in models.data]

    assert asyncio.run(with_client()) == ["laminar"]
    # a rollout's settings replace an endpoint started earlier in the process with defaults
    # (cluster.backend=local: the warm start's evaluation ran its agents first)
    rollout = serve("127.0.0.1", 0, "the-job-secret", _RUNNER)
    assert rollout.url != server.url and rollout.secret == "the-job-secret"
    assert raw(rollout.url, "GET", "/v1/models", "the-job-secret")[0] == 200
    assert raw(rollout.url, "GET", "/v1/models", server.secret)[0] == 401
    with pytest.raises(ConnectionRefusedError):
        raw(server.url, "GET", "/v1/models", server.secret)


def test_agent_config_errors_name_the_key(tmp_path):
    (tmp_path / "a.py").write_text("def sync(client, sample):\n    return 1.0\n"
                                   "async def one(client):\n    return 1.0\n")
    base = ["rollout.openai_server=true"]
    with pytest.raises(ConfigError, match=r"task.agent='.*a.py:sync' must be a coroutine function"):
        build_task(load_config(None, [*base, f"task.agent={tmp_path}/a.py:sync"]).task)
    with pytest.raises(ConfigError, match=r"must accept \(client, sample\)"):
        build_task(load_config(None, [*base, f"task.agent={tmp_path}/a.py:one"]).task)
    with pytest.raises(ConfigError, match=r"task.agent='.*nope.py:run': no file"):
        build_task(load_config(None, [*base, f"task.agent={tmp_path}/nope.py:run"]).task)
    with pytest.raises(ConfigError, match="set rollout.openai_server=true"):
        load_config(None, [f"task.agent={tmp_path}/a.py:one"])
    with pytest.raises(ConfigError, match="rollout.openai_port"):
        load_config(None, [*base, f"task.agent={tmp_path}/a.py:one", "rollout.openai_port=70000"])
    from laminar.envs.openai_server import serve_rollout

    cfg = load_config(None, [*base, f"task.agent={tmp_path}/a.py:one", "rollout.openai_host=nic9"])
    with pytest.raises(ConfigError, match="rollout.openai_host='nic9' is not an interface"):
        serve_rollout(cfg, "r0")


E2E_AGENT = '''
import json
import openai
from laminar.tasks.rewards import similarity

async def run(client, sample):
    """Two turns: the prompt, then "=" (the model tries again); scored by its last answer."""
    messages = [{{"role": "user", "content": sample.prompt}}]
    r = await client.chat.completions.create(model="policy", messages=messages)
    first, last = r.usage, r.usage
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        messages += [{{"role": "assistant", "content": text}}, {{"role": "user", "content": "="}}]
        try:
            r = await client.chat.completions.create(model="policy", messages=messages)
            text, last = r.choices[0].message.content, r.usage
        except openai.BadRequestError:  # "=" did not fit in the budget
            pass
    reward = round(similarity(text, sample.answer), 4)
    with open({log!r}, "a") as f:  # what the endpoint said, to compare with what was trained
        f.write(json.dumps({{"reward": reward,
                             "response_len": last.total_tokens - first.prompt_tokens}}) + "\\n")
    return reward
'''


def test_training_with_an_agent_on_ray(tmp_path, ray_cluster):
    """Three steps on Ray: rollouts serve the endpoint, the agent's episodes are trained, and
    every trained trajectory is one the agent saw: its reward, and its length as the endpoint's
    usage counted it (prompt and completion tokens, no re-tokenization)."""
    from collections import Counter

    from laminar.metrics import read_metrics
    from laminar.modes import run_training

    log = tmp_path / "agent.jsonl"
    (tmp_path / "agent.py").write_text(E2E_AGENT.format(log=str(log)))
    run_dir = tmp_path / "run"
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(f"""
        task: {{name: reverse, agent: "agent.py:run", max_turns: 2, reverse: {{max_len: 6}},
                eval_prompts: 4}}
        sft: {{enabled: false}}
        mode: laminar
        rollout: {{openai_server: true, num_workers: 1, max_new_tokens: 24, group_size: 2,
                   batch_groups: 2, engine: {{max_batch_size: 8}}}}
        cluster: {{wait_timeout_s: 120}}
        trainer: {{prompts_per_step: 2, total_steps: 3, threads: 1, eval_every: 0}}
        metrics: {{tensorboard: false}}
        run_dir: {run_dir}
        """))
    report = run_training(load_config(str(job), []))
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    trained = [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(trained) == len({t["traj_id"] for t in trained}) == 3 * 2 * 2
    assert all(t["failed"] is None for t in trained)
    seen = Counter((r["reward"], r["response_len"])
                   for r in map(json.loads, log.read_text().splitlines()))
    assert Counter((t["reward"], t["response_len"]) for t in trained) <= seen
    assert any(2 in r["turns"] for r in rows), "no episode took its second turn"
    assert report["exactly_once"]["ok"]
