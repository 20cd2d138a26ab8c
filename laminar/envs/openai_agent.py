"""Agents written against the OpenAI client, trained as environments (`task.agent`).

    # my_agent.py                                    task.agent: my_agent.py:run
    async def run(client: openai.AsyncOpenAI, sample) -> float:     rollout.openai_server: true
        messages = [{"role": "user", "content": sample.prompt}]
        reply = await client.chat.completions.create(model="policy", messages=messages)
        ...                                          # tools, more turns: append, ask again
        return reward                                # or (reward, info)

`AgentEnv` is a `TokenEnv` (laminar/envs/base.py), so versions, loss masks, repack, timeouts,
failures, metrics and evaluation work as for any environment. `reset` opens a session on this
process's endpoint (openai_server.py), starts the agent with a client whose base URL names the
session (the API key is the endpoint's secret) and waits for its first request: the request's
messages, through the template, are the prompt. Each `step` answers the waiting request with the
model's turn (its text, finish reason, token counts, log-probs on request) and waits for the
agent's next request — whose new messages become the observation tokens (loss mask 0) — or for
the agent to return its reward (the episode is done).

Token-exactness: the model's turns stay the engine's ids; a request must repeat the conversation
so far (the model's replies as they were sent) and add non-assistant messages after it, and only
those are rendered (template.py measures what the chat template puts between two assistant
turns). A request that edits the history fails the episode (`env_error`), as a diverged
transcript cannot be trained token-exactly. `/v1/completions` is the same with text: the next
prompt must start with the previous prompt plus the completion.

What a request may set: `stop` (strings that end the turn; the reply leaves the stop string
out, as OpenAI's does, while the context keeps its tokens) and `logprobs`. The rollout's
sampling (rollout.temperature, top_p, top_k) always applies and its budget (rollout.max_new_tokens,
model and observation tokens together, and task.max_turns) ends the episode, so `temperature`,
`top_p`, `max_tokens`, `seed` and the like are ignored; `stream`, `n` > 1, `tools`/`functions`,
`response_format` other than text, `top_logprobs`, and `echo`/`suffix`/`best_of` (completions)
are refused (400). After the last
turn (finish_reason `length` when the budget ran out), further requests are refused (400,
`context_length_exceeded`, also for a request whose new messages do not fit): the agent should
return its reward; one that raises instead is scored 0 (a truncated episode, not a failure).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import ssl
import time
from typing import Any, Callable, NamedTuple

from laminar.config import ConfigError
from laminar.envs.base import StepResult, TokenEnv, Turn
from laminar.envs.openai_server import MODEL, Call, Server, error, running_server
from laminar.envs.template import stop_sequences
from laminar.models.tokenizer import encode_prompt
from laminar.plugins import import_target
from laminar.types import PromptItem

ROLES = ("system", "developer", "user", "assistant", "tool")


class AgentError(RuntimeError):
    """The agent did something its episode cannot go on from (the message says what)."""


class BadRequest(ValueError):
    """A request the endpoint answers with 400 (the episode goes on: the agent may retry)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Finished(NamedTuple):
    """The agent's coroutine ended: its result, or the exception it raised."""

    result: Any
    error: BaseException | None


def resolve_agent(path: str) -> Callable[..., Any]:
    """`my_agent.py:run` or `package.module:run` -> the function, checked against the contract."""
    fn = import_target(path, "task.agent", "function")
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"task.agent='{path}' must be a coroutine function: `async def "
                          "run(client, sample) -> float`")
    try:
        inspect.signature(fn).bind("client", "sample")
    except TypeError:
        raise ConfigError(f"task.agent='{path}' must accept (client, sample); its signature is "
                          f"{inspect.signature(fn)}") from None
    try:
        import openai  # noqa: F401
    except ImportError:
        raise ConfigError(f"task.agent='{path}' is given an openai.AsyncOpenAI client, and the "
                          "`openai` package is not installed here: pip install openai") from None
    return fn


class AgentEnv(TokenEnv):
    def __init__(self, agent: Callable[..., Any], name: str = "agent") -> None:
        self.agent, self.name = agent, name
        self.server: Server | None = None
        self.session: Any = None
        self.runner: asyncio.Task | None = None
        self.pool: Any = None  # the agent client's connection pool
        self.template: Any = None
        self.route = ""  # "chat" or "completion", fixed by the first request
        self.history: list[dict[str, str]] | str = []  # what the next request must start with
        self.call: Call | None = None  # the request the model is answering
        self.num_context = 0  # tokens before the model's next turn: prompt and transcript
        self.turns = 0
        self.refusing = ""  # why requests are refused (set after the last turn)
        self.refused = False  # a request was refused for a limit: an agent that raises scored 0
        self.stops: tuple[str, ...] = ()  # the waiting request's `stop` strings

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("an agent's episode is a coroutine running in this process; it cannot move")

    # ------------------------------------------------------------------------- the episode

    async def reset_ids(self, sample: PromptItem, template: Any) -> list[int]:
        import openai

        self.template = template
        self.server = server = await running_server()
        self.session = server.open()
        # a connection pool per episode: one pool shared by hundreds of waiting requests spends
        # quadratic time matching requests to connections (httpcore)
        self.pool = openai.DefaultAsyncHttpxClient(verify=_tls_context())
        client = openai.AsyncOpenAI(base_url=server.base_url(self.session.id), api_key=server.secret,
                                    max_retries=0, timeout=None, http_client=self.pool)
        self.runner = asyncio.ensure_future(self._run(client, sample))
        while True:
            event = await self.session.inbox.get()
            if isinstance(event, Finished):
                raise AgentError(f"{self.name} ended before its first request"
                                 + _raised(event.error))
            try:
                ids = self._first(event)
                self._set_stops(event)
            except BadRequest as e:
                event.reply(*error(400, str(e), param=e.param))
                continue
            self.call, self.num_context = event, len(ids)
            return ids

    async def step_ids(self, turn: Turn) -> StepResult:
        self._answer(turn)
        while True:
            event = await self.session.inbox.get()
            if isinstance(event, Finished):
                return self._finished(event)
            if self.refusing:
                self.refused = True
                event.reply(*error(400, self.refusing, "context_length_exceeded", "messages"))
                continue
            try:
                new = self._extension(event)
                ids = self._render(new, ended_with_eos=turn.finish_reason == "eos")
                self._set_stops(event)
            except BadRequest as e:
                event.reply(*error(400, str(e), param=e.param))
                continue
            except AgentError as e:
                event.reply(*error(400, str(e), "diverged_history", "messages"))
                raise
            if len(ids) >= turn.room:
                self.refusing, self.refused = (f"the episode's token budget is spent: the new "
                                               f"messages take {len(ids)} tokens and {turn.room - 1} "
                                               "are left (rollout.max_new_tokens); return your "
                                               "reward"), True
                event.reply(*error(400, self.refusing, "context_length_exceeded", "messages"))
                continue
            self.history = self.history + new
            self.call = event
            self.num_context += len(ids)
            return StepResult(ids, 0.0, False, {})

    async def close(self) -> None:
        if self.runner is not None and not self.runner.done():
            self.runner.cancel()
            await asyncio.gather(self.runner, return_exceptions=True)
        if self.server is not None and self.session is not None:
            self.server.close(self.session)
        if self.pool is not None:
            await self.pool.aclose()

    async def _run(self, client: Any, sample: PromptItem) -> None:
        try:
            result = await self.agent(client, sample)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the agent's own failure: its episode's to report
            self.session.inbox.put_nowait(Finished(None, e))
            return
        self.session.inbox.put_nowait(Finished(result, None))

    def _finished(self, event: Finished) -> StepResult:
        if event.error is not None:
            if self.refused:  # it gave up on a refused request: a truncated episode
                return StepResult([], 0.0, True, {"truncated": True})
            raise AgentError(f"{self.name}{_raised(event.error)}")
        result, info = event.result, {}
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
            result, info = result
        if not isinstance(result, (int, float)) or not math.isfinite(result):  # bools count
            raise AgentError(f"{self.name} returned {event.result!r:.80}, not a finite reward "
                             "(a float, or (reward, info dict))")
        return StepResult([], float(result), True, info)

    # ------------------------------------------------------------------------- requests

    def _first(self, call: Call) -> list[int]:
        self.route = call.route
        if call.route == "chat":
            self.history = _chat_request(call.body)
            return self.template.prompt_ids(_for_template(self.history))
        self.history = _completion_request(call.body)
        return encode_prompt(self.template.tokenizer, self.history)

    def _extension(self, call: Call) -> list[dict[str, str]] | str:
        """What the request adds after the conversation so far (BadRequest: malformed;
        AgentError: it does not extend the conversation)."""
        if call.route != self.route:
            raise AgentError(f"this episode began with /v1/{_path(self.route)}; a request to "
                             f"/v1/{_path(call.route)} cannot continue it")
        if call.route == "completion":
            prompt, known = _completion_request(call.body), self.history
            if not prompt.startswith(known) or len(prompt) == len(known):
                raise AgentError("the prompt does not extend the previous prompt and completion "
                                 f"(they end {known[-40:]!r}; the prompt has {prompt[:len(known)][-40:]!r} "
                                 "there); an episode's text only grows")
            return prompt[len(known):]
        messages, known = _chat_request(call.body), self.history
        for i, (sent, got) in enumerate(zip(known, messages)):
            if sent != got:
                raise AgentError(f"the request's messages do not extend the conversation so far: "
                                 f"message {i} was {_show(sent)} and is now {_show(got)}; an "
                                 "episode is one conversation, its history only grows (the "
                                 "model's replies exactly as returned)")
        new = messages[len(known):]
        if not new:
            raise AgentError(f"the request has {len(messages)} messages and adds none after the "
                             f"model's reply (the conversation so far has {len(known)})")
        if any(m["role"] == "assistant" for m in new):
            raise AgentError("the request adds an assistant message after the model's reply; "
                             "assistant turns are the model's own tokens, not the agent's to write")
        return new

    def _set_stops(self, call: Call) -> None:
        stop = call.body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
            raise BadRequest("stop must be a string or a list of non-empty strings", "stop")
        self.stops = tuple(stops)
        self.turn_stops = stop_sequences(self.template.tokenizer, self.stops)

    def _render(self, new: list[dict[str, str]] | str, ended_with_eos: bool) -> list[int]:
        if isinstance(new, str):
            return list(self.template.tokenizer.encode(new, add_special_tokens=False))
        return self.template.observation_ids(_for_template(new), ended_with_eos)

    def _answer(self, turn: Turn) -> None:
        """Reply to the waiting request with the model's turn."""
        call, self.call = self.call, None
        self.turns += 1
        text = turn.text
        if turn.finish_reason == "stop":  # the stop string is left out of the reply, as OpenAI's
            text = next((text[:-len(s)] for s in self.stops if text.endswith(s)), text)
        finish = "length" if turn.finish_reason == "length" else "stop"
        usage = {"prompt_tokens": self.num_context, "completion_tokens": len(turn.token_ids),
                 "total_tokens": self.num_context + len(turn.token_ids)}
        model = call.body.get("model") if isinstance(call.body.get("model"), str) else MODEL
        head = {"created": int(time.time()), "model": model, "usage": usage}
        if call.route == "chat":
            logprobs = None
            if call.body.get("logprobs"):
                logprobs = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                                         "top_logprobs": []} for t, lp in self._tokens(turn)],
                            "refusal": None}
            call.reply(200, {"id": f"chatcmpl-{self.session.id}-{self.turns}",
                             "object": "chat.completion", **head, "choices": [{
                                 "index": 0, "finish_reason": finish, "logprobs": logprobs,
                                 "message": {"role": "assistant", "content": text}}]})
            self.history = [*self.history, {"role": "assistant", "content": text}]
        else:
            logprobs = None
            if call.body.get("logprobs") is not None:
                pairs = self._tokens(turn)
                offsets = [len(self.history)]
                for t, _ in pairs[:-1]:
                    offsets.append(offsets[-1] + len(t))
                logprobs = {"tokens": [t for t, _ in pairs], "token_logprobs": [lp for _, lp in pairs],
                            "top_logprobs": None, "text_offset": offsets[:len(pairs)]}
            call.reply(200, {"id": f"cmpl-{self.session.id}-{self.turns}",
                             "object": "text_completion", **head, "choices": [{
                                 "index": 0, "finish_reason": finish, "logprobs": logprobs,
                                 "text": text}]})
            self.history = self.history + text
        self.num_context += len(turn.token_ids)
        if turn.last:
            self.refusing = ("the episode's last turn is over (task.max_turns or the token budget "
                             "rollout.max_new_tokens); return your reward")

    def _tokens(self, turn: Turn) -> list[tuple[str, float]]:
        tokenizer = self.template.tokenizer
        return [(tokenizer.decode([t]), lp) for t, lp in zip(turn.token_ids, turn.logprobs)]


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """Built once (~20 ms): a client's pool would otherwise build its own. Plain HTTP never
    uses it."""
    return ssl.create_default_context()


# ----------------------------------------------------------------------------- request bodies


def _common(body: dict[str, Any]) -> None:
    if body.get("stream"):
        raise BadRequest("stream=true is not supported: the endpoint answers whole turns", "stream")
    if body.get("n") not in (None, 1):
        raise BadRequest(f"n={body.get('n')!r}: an episode is one conversation, n must be 1 "
                         "(GRPO's samples per prompt are rollout.group_size)", "n")


def _chat_request(body: dict[str, Any]) -> list[dict[str, str]]:
    _common(body)
    for key in ("tools", "functions"):
        if body.get(key):
            raise BadRequest(f"{key} are not supported: the policy writes text; let it write "
                             "tool calls in its message and parse them in the agent", key)
    fmt = body.get("response_format")
    if fmt and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise BadRequest("response_format other than text is not supported (nothing constrains "
                         "the policy's sampling)", "response_format")
    if body.get("top_logprobs"):
        raise BadRequest("top_logprobs is not supported (logprobs=true gives each sampled "
                         "token's log-prob)", "top_logprobs")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(m: Any, i: int) -> dict[str, str]:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise BadRequest(f"messages[{i}] must be an object with role one of {', '.join(ROLES)}",
                         "messages")
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise BadRequest(f"messages[{i}].content must be text (tool calls are not supported: the "
                         "model's tool calls are text in its message)", "messages")
    return {"role": m["role"], "content": content}


def _completion_request(body: dict[str, Any]) -> str:
    _common(body)
    for key in ("echo", "suffix"):
        if body.get(key):
            raise BadRequest(f"{key} is not supported", key)
    if body.get("best_of") not in (None, 1):
        raise BadRequest("best_of must be 1", "best_of")
    if body.get("logprobs") not in (None, 0):
        raise BadRequest("logprobs must be 0 (each sampled token's log-prob) or absent: "
                         "alternatives are not recorded", "logprobs")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt must be one non-empty string", "prompt")
    return prompt


def _for_template(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Chat templates know `system`, not OpenAI's newer `developer`."""
    return [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]


def _path(route: str) -> str:
    return "chat/completions" if route == "chat" else "completions"


def _show(m: dict[str, str]) -> str:
    content = m["content"] if len(m["content"]) <= 40 else m["content"][:37] + "..."
    return f"{m['role']} {content!r}"


def _raised(e: BaseException | None) -> str:
    if e is None:
        return ""
    cause = e.__cause__ or e.__context__  # the client's own errors wrap the transport's
    why = f"; from {type(cause).__name__}: {cause!r:.200}" if cause is not None else ""
    return f" (it raised {type(e).__name__}: {e}{why})"
