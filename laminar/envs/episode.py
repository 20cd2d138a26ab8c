"""The token loop of multi-turn episodes, shared by the rollout loop and evaluation. No Ray.

    episodes = Episodes(task, tokenizer, max_turns=4, timeout_s=30)
    episodes.begin(request, group)        # a fresh environment; reset(sample) runs
    for req, group in episodes.next_turns():   # reset done / observation appended: decode it
        engine.add(req)
    ... the engine finishes a turn (EOS, a stop string, the budget) ...
    episodes.end_turn(request)            # step(turn text) runs
    for done in episodes.finished():      # an Ended: the request, reward, exact match, mask
        ...

Environment calls are coroutines on one asyncio loop in a daemon thread (`EnvRunner`), so many
episodes wait on their tools at once while the caller keeps decoding, and each call is bounded
by `timeout_s`: a call that raises or outlives it ends its episode as failed (`env_error`,
`env_timeout`), never the caller. An environment that blocks the loop (a synchronous sleep in an
`async def`) stalls the other episodes' calls until each of them times out; after a timeout
the runner starts a fresh loop so later episodes are not stuck behind it (the blocked thread is
abandoned: Python cannot kill a thread).

Tokens: the request's `output_ids` hold the whole transcript after the prompt, model and
environment tokens alike; the environment's are recorded as spans (`Episode.env_spans`) and get
log-prob 0, the turn's version and a loss mask of 0 (`Ended.loss_mask`). Generated tokens are
never decoded and re-encoded into the transcript: the environment sees the turn's text
(decoded from exactly its ids) and only its observation is encoded (laminar/envs/template.py).
A `TokenEnv` renders its own prompt and observations from the template and receives each turn's
ids (`Turn`); its ids are appended as they are.
The budget `params.max_new_tokens` covers model and environment tokens together; an
observation that does not fit ends the episode (with the step's reward, as the budget does).

Writes to a request (its prompt after reset, its stop sequences, an observation appended to
`output_ids`, `finish_reason` on failure) happen only while it is in no engine: before its first
`add`, or after the engine finished its turn (`end_turn` checks that it has), and before it is
added again. That is the rule of laminar/engine/protocol.py: while a request is inside an engine
only the engine writes its outputs; the next turn is a resume (prompt + transcript re-prefilled).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from laminar.engine.protocol import RolloutEngine
from laminar.envs.base import TokenEnv, Turn
from laminar.envs.template import TurnTemplate, stop_sequences
from laminar.models.tokenizer import decode_response
from laminar.types import GenerationRequest, PromptGroup

log = logging.getLogger("laminar.envs")


class EnvRunner:
    """One asyncio loop on a daemon thread for a process's environment calls."""

    BEAT_S = 0.1  # the loop notes the time this often; silent for 10 beats = blocked

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.lock = threading.Lock()
        self.beat = time.monotonic()

    def _start(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.new_event_loop()

        def tick() -> None:
            if self.loop is loop:
                self.beat = time.monotonic()
                loop.call_later(self.BEAT_S, tick)

        self.beat, self.loop = time.monotonic(), loop
        loop.call_soon(tick)
        threading.Thread(target=loop.run_forever, name="laminar-env", daemon=True).start()
        return loop

    def submit(self, coro: Any) -> cf.Future:
        with self.lock:
            loop = self.loop or self._start()
            return asyncio.run_coroutine_threadsafe(coro, loop)

    def restart_if_blocked(self) -> bool:
        """Leave a loop that stopped beating (an environment blocked it); the next call starts
        a fresh one."""
        with self.lock:
            if self.loop is None or time.monotonic() - self.beat < 10 * self.BEAT_S:
                return False
            log.warning("an environment blocked the environment thread for %.1f s (a blocking "
                        "call inside `async def`?); continuing on a fresh thread",
                        time.monotonic() - self.beat)
            self.loop = None
            return True


_RUNNER = EnvRunner()  # one per process: every rollout loop and evaluator in it shares it
TIMEOUT_SCAN_S = 0.1  # how often `Episodes.poll` looks for calls over their timeout


@dataclass
class Episode:
    env: Any  # the laminar.envs.Env instance (moves with the trajectory when picklable)
    request: GenerationRequest
    group: PromptGroup
    turns: int = 0  # model turns finished
    turn_start: int = 0  # index in output_ids where the current model turn starts
    env_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) env tokens
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    call: Any = None  # the pending environment call (a Future), None while decoding
    call_kind: str = ""  # "reset" or "step"
    call_at: float = 0.0  # monotonic start of the pending call

    def __getstate__(self) -> dict[str, Any]:  # moved between processes only while decoding
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        state["call"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)


@dataclass
class Ended:
    request: GenerationRequest
    group: PromptGroup
    reward: float
    exact_match: bool
    turns: int
    loss_mask: list[int]  # per output id: 1 generated by the model, 0 written by the environment
    failed: str | None = None  # env_error / env_timeout, with `error`
    error: str | None = None


def loss_mask(num_tokens: int, env_spans: list[tuple[int, int]]) -> list[int]:
    mask = [1] * num_tokens
    for start, end in env_spans:
        mask[start:end] = [0] * (end - start)
    return mask


class Episodes:
    def __init__(self, task: Any, tokenizer: Any, max_turns: int, timeout_s: float,
                 runner: EnvRunner | None = None) -> None:
        self.task, self.tokenizer = task, tokenizer
        self.max_turns, self.timeout_s = max_turns, timeout_s
        self.runner = runner or _RUNNER
        self.template = TurnTemplate(tokenizer)
        self.stops = stop_sequences(tokenizer, tuple(task.stop))
        self.live: dict[str, Episode] = {}  # every episode begun and not ended
        self.calling: dict[str, Episode] = {}  # those in an environment call
        # calls that returned, appended by the environment thread (a done callback): `poll`
        # handles these instead of asking every pending call whether it is done, which cost
        # more CPU than the engine on a rollout with hundreds of episodes in their tools
        self.arrived: deque[tuple[Episode, cf.Future]] = deque()
        self.next_timeout_scan = 0.0
        self.ready: list[Episode] = []  # their call returned: next turn to decode
        self.ended: list[Ended] = []
        self.latencies: list[float] = []  # seconds per environment step call, since the last take
        self.turn_counts: list[int] = []  # turns per ended episode, since the last take
        self.failed_by_reason: Counter[str] = Counter()
        self.tool_calls: Counter[str] = Counter()  # info["tool_status"] of the steps, counted

    # ---------------------------------------------------------------- the caller's side

    def begin(self, req: GenerationRequest, group: PromptGroup) -> None:
        """A new episode for `req` (its prompt is replaced by the template of reset's answer)."""
        req.params = dataclasses.replace(req.params, stop_sequences=self.stops)
        ep = Episode(None, req, group)
        self.live[req.request_id] = ep
        try:
            ep.env = env = self.task.make_env()
            self._call(ep, "reset", env.reset_ids(group.item, self.template)
                       if isinstance(env, TokenEnv) else env.reset(group.item))
        except Exception as e:  # a user's constructor or a reset that is not a coroutine
            self._fail(ep, "env_error", f"starting the environment raised {type(e).__name__}: {e}")

    def end_turn(self, req: GenerationRequest) -> None:
        """The engine finished a model turn of `req`: hand its text to the environment."""
        if req.finish_reason is None:  # the engine still owns it: nothing here may write it
            raise RuntimeError(f"end_turn('{req.request_id}'): its engine has not finished the "
                               "turn (finish_reason is None); end a turn on its finish delta")
        ep = self.live[req.request_id]
        ep.turns += 1
        ids = req.output_ids[ep.turn_start:]
        text = decode_response(self.tokenizer, ids)
        try:
            if isinstance(ep.env, TokenEnv):
                last = ep.turns >= self.max_turns or req.finish_reason == "length"
                room = req.params.max_new_tokens - len(req.output_ids)
                turn = Turn(text, list(ids), list(req.logprobs[ep.turn_start:]),
                            req.finish_reason or "stop", last, room)
                self._call(ep, "step", ep.env.step_ids(turn))
            else:
                self._call(ep, "step", ep.env.step(text))
        except Exception as e:
            self._fail(ep, "env_error", f"step raised {type(e).__name__}: {e}")

    def next_turns(self) -> list[tuple[GenerationRequest, PromptGroup]]:
        """Requests whose next model turn can be decoded now."""
        self.poll()
        out, self.ready = [(ep.request, ep.group) for ep in self.ready], []
        return out

    def finished(self) -> list[Ended]:
        self.poll()
        out, self.ended = self.ended, []
        return out

    @property
    def num_waiting(self) -> int:
        """Episodes in an environment call."""
        return len(self.calling)

    @property
    def num_outside_engine(self) -> int:
        """Episodes in an environment call, waiting for their next turn to be decoded, or ended
        and not collected yet (a batch is not done while its last episode sits there)."""
        return self.num_waiting + len(self.ready) + len(self.ended)

    def __len__(self) -> int:
        """Episodes begun and not ended (decoding, in their environment, or ready)."""
        return len(self.live)

    def detach(self, rid: str) -> Episode | None:
        """Hand a decoding episode over (repack): it leaves with its environment; None when it
        is in an environment call or its environment cannot be pickled (it stays here)."""
        ep = self.live.get(rid)
        if ep is None or ep.call is not None:
            return None
        try:
            import pickle

            pickle.dumps(ep.env)
        except Exception:
            return None
        return self.live.pop(rid)

    def attach(self, ep: Episode) -> None:
        """Continue an episode handed over from elsewhere (it is decoding its turn)."""
        self.live[ep.request.request_id] = ep

    def take_stats(self) -> tuple[list[float], list[int]]:
        lat, turns = self.latencies, self.turn_counts
        self.latencies, self.turn_counts = [], []
        return lat, turns

    def close(self) -> None:
        """End every live episode's environment (a rollout stopping)."""
        for ep in self.live.values():
            self._close_env(ep)
        self.live.clear()
        self.calling.clear()

    # ---------------------------------------------------------------- environment calls

    def _call(self, ep: Episode, kind: str, coro: Any) -> None:
        ep.call_kind, ep.call_at = kind, time.monotonic()
        ep.call = call = self.runner.submit(coro)
        self.calling[ep.request.request_id] = ep
        call.add_done_callback(lambda done: self.arrived.append((ep, done)))

    def poll(self) -> None:
        """Handle the environment calls that returned since the last poll; end the episodes
        whose call outlived `timeout_s` (looked for every TIMEOUT_SCAN_S)."""
        now = time.monotonic()
        while self.arrived:
            ep, call = self.arrived.popleft()
            if ep.call is not call:  # timed out (and cancelled) before, or ended elsewhere
                continue
            self._returned(ep, call, now)
        if now >= self.next_timeout_scan:
            self.next_timeout_scan = now + TIMEOUT_SCAN_S
            for ep in [ep for ep in self.calling.values() if now - ep.call_at > self.timeout_s]:
                call = ep.call
                self._clear_call(ep)
                call.cancel()
                self.runner.restart_if_blocked()
                self._fail(ep, "env_timeout", f"{ep.call_kind} took over {self.timeout_s:g} s "
                           "(task.env_timeout_s)")

    def _clear_call(self, ep: Episode) -> None:
        ep.call = None
        self.calling.pop(ep.request.request_id, None)

    def _returned(self, ep: Episode, call: cf.Future, now: float) -> None:
        self._clear_call(ep)
        try:
            result = call.result()
        except Exception as e:  # a user's environment may raise anything
            self._fail(ep, "env_error", f"{ep.call_kind} raised {type(e).__name__}: {e}")
            return
        if ep.call_kind == "reset":
            self._after_reset(ep, result)
        else:
            self.latencies.append(now - ep.call_at)
            self._after_step(ep, result)

    def _after_reset(self, ep: Episode, observation: Any) -> None:
        tokens = isinstance(ep.env, TokenEnv)
        if not (_is_ids(observation) if tokens else isinstance(observation, str)):
            self._fail(ep, "env_error", f"reset returned {type(observation).__name__}, not "
                       f"{'a list of token ids' if tokens else 'str'}")
            return
        req = ep.request
        req.prompt_ids = list(observation) if tokens else self.template.prompt_ids(observation)
        req.output_ids, req.logprobs, req.token_versions = [], [], []
        if tokens:
            self._turn_stops(ep)
        self.ready.append(ep)

    def _after_step(self, ep: Episode, result: Any) -> None:
        try:
            observation, reward, done, info = result
            reward, done, info = float(reward), bool(done), dict(info or {})
        except Exception:
            self._fail(ep, "env_error", f"step returned {result!r:.80}, not (observation, "
                       "reward, done, info)")
            return
        ep.reward, ep.info = reward, info
        if isinstance(info.get("tool_status"), str):
            self.tool_calls[info["tool_status"]] += 1
        req = ep.request
        if done or ep.turns >= self.max_turns or req.finish_reason == "length":
            self._end(ep)
            return
        if isinstance(ep.env, TokenEnv):
            if not _is_ids(observation):
                self._fail(ep, "env_error", f"step_ids returned an observation of type "
                           f"{type(observation).__name__}, not a list of token ids")
                return
            ids = list(observation)
            self._turn_stops(ep)
        else:
            ids = self.template.observation_ids(str(observation), req.finish_reason == "eos")
        room = req.params.max_new_tokens - len(req.output_ids)
        if len(ids) >= room:  # no room for the observation and a next turn
            self._end(ep)
            return
        start = len(req.output_ids)
        version = req.token_versions[-1] if req.token_versions else req.version
        req.output_ids.extend(ids)
        req.logprobs.extend([0.0] * len(ids))
        req.token_versions.extend([version] * len(ids))
        ep.env_spans.append((start, len(req.output_ids)))
        ep.turn_start = len(req.output_ids)
        req.finish_reason = None
        self.ready.append(ep)

    def _turn_stops(self, ep: Episode) -> None:
        """A TokenEnv may set its next turn's stop sequences."""
        stops = ep.env.turn_stops
        if stops is not None:
            ep.request.params = dataclasses.replace(ep.request.params, stop_sequences=stops)

    def _end(self, ep: Episode, failed: str | None = None, error: str | None = None) -> None:
        self.live.pop(ep.request.request_id, None)
        self._clear_call(ep)
        req = ep.request
        exact = bool(ep.info.get("exact_match", ep.reward >= 1.0)) if not failed else False
        self.ended.append(Ended(req, ep.group, 0.0 if failed else ep.reward, exact, ep.turns,
                                loss_mask(len(req.output_ids), ep.env_spans), failed, error))
        self.turn_counts.append(ep.turns)
        self._close_env(ep)

    def _fail(self, ep: Episode, reason: str, error: str) -> None:
        if not self.failed_by_reason[reason]:
            log.warning("episode %s failed (%s: %s); the trajectory is left out of training, and "
                        "such failures are counted", ep.request.request_id, reason, error)
        self.failed_by_reason[reason] += 1
        if ep.request.finish_reason is None:
            ep.request.finish_reason = "stop"
        self._end(ep, reason, error)

    def _close_env(self, ep: Episode) -> None:
        close = getattr(ep.env, "close", None)
        if close is None:
            return
        try:
            self.runner.submit(asyncio.wait_for(close(), self.timeout_s))
        except Exception:  # closing is best effort
            pass


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) for i in value)


def step_episodes(engine: RolloutEngine, episodes: Episodes) -> tuple[bool, list[Ended]]:
    """One round for an engine that runs only episodes (an evaluation's): start the turns that
    are ready, one engine step (finished turns go to their environment), collect the ended
    episodes. Returns (whether the engine stepped, the ended episodes)."""
    for req, _ in episodes.next_turns():
        engine.add(req)
    stepped = engine.has_unfinished()
    if stepped:
        for delta in engine.step():
            if delta.finish_reason is not None and delta.request_id in episodes.live:
                episodes.end_turn(episodes.live[delta.request_id].request)
    return stepped, episodes.finished()


def run_episodes(engine: RolloutEngine, episodes: Episodes,
                 requests: list[tuple[GenerationRequest, PromptGroup]],
                 poll_s: float = 0.001) -> list[Ended]:
    """Run whole episodes on `engine` until every one has ended (evaluation, tests)."""
    for req, group in requests:
        episodes.begin(req, group)
    ended: list[Ended] = []
    while len(ended) < len(requests):
        stepped, done = step_episodes(engine, episodes)
        ended += done
        if not stepped:
            time.sleep(poll_s)
    return ended
