"""The HTTP side of the OpenAI-compatible endpoint: one server per rollout process, sessions.

    serve_rollout(cfg, "rollout0")         # a rollout: this process's endpoint (rollout.openai_*)
    server = await running_server()        # an episode (on the environment thread): the server
    session = server.open()                # its session; the agent's base URL: server.base_url(id)
    call = await session.inbox.get()       # a Call (a request waiting for its reply), or what
    call.reply(200, {...})                 # the episode put there itself (the agent's return)
    server.close(session)                  # later requests for it: 404

Routes (every one needs `Authorization: Bearer <secret>`, else 401):
- `POST /s/<session>/v1/chat/completions` and `POST /s/<session>/v1/completions`: the request
  goes to the session's inbox and its answer comes from the episode (laminar/envs/openai_agent.py);
  an unknown (or ended) session is 404, a second request while one is pending 409;
- `GET /v1/models` (also under a session): the one model served, `laminar`.
Errors are OpenAI-shaped JSON, `{"error": {"message", "type", "param", "code"}}`, so the
`openai` client raises its usual exceptions (AuthenticationError, NotFoundError, BadRequestError).

HTTP/1.1 is h11 (python-hyper's protocol state machine: parsing, keep-alive, chunked bodies) on
asyncio streams; no streaming responses. The server runs on the environment thread's asyncio
loop (laminar/envs/episode.py), where the agents and their episodes run too: a request and the
episode that answers it never cross threads. A loop replaced after an environment blocked it
gets a server of its own (on a free port).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

import h11

from laminar.config import ConfigError
from laminar.envs.episode import _RUNNER
from laminar.relay.address import AddressError, local_interfaces, resolve_host

log = logging.getLogger("laminar.envs")

MODEL = "laminar"  # the id /v1/models lists; requests may name any model (the policy answers)
MAX_BODY_BYTES = 16 << 20


def error(status: int, message: str, code: str | None = None, param: str | None = None
          ) -> tuple[int, dict[str, Any]]:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Call:
    """One request of an agent, waiting for its reply."""

    route: str  # "chat" (/v1/chat/completions) or "completion" (/v1/completions)
    body: dict[str, Any]
    answer: asyncio.Future = field(repr=False)  # (status, JSON body)

    def reply(self, status: int, payload: dict[str, Any]) -> None:
        if not self.answer.done():
            self.answer.set_result((status, payload))


class Session:
    def __init__(self, session_id: str) -> None:
        self.id = session_id
        self.inbox: asyncio.Queue = asyncio.Queue()  # Calls, and what the episode puts there
        self.pending: Call | None = None  # the request waiting for its reply

    async def submit(self, route: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if self.pending is not None:
            return error(409, f"session {self.id} already has a request waiting for the model; an "
                         "episode is one conversation, one request at a time", "concurrent_request")
        call = Call(route, body, asyncio.get_running_loop().create_future())
        self.pending = call
        self.inbox.put_nowait(call)
        try:
            return await call.answer
        finally:
            self.pending = None


class Server:
    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.sessions: dict[str, Session] = {}
        self.host, self.port = "127.0.0.1", 0
        self.listener: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> None:
        self.listener = await asyncio.start_server(self._connection, host, port, backlog=1024)
        self.host, self.port = host, self.listener.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        """The endpoint's root, as a client on this machine reaches it."""
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def base_url(self, session_id: str) -> str:
        """What an agent's OpenAI client takes as `base_url`: the session is in the path."""
        return f"{self.url}/s/{session_id}/v1"

    def open(self) -> Session:
        session = Session(secrets.token_hex(8))
        self.sessions[session.id] = session
        return session

    def close(self, session: Session) -> None:
        self.sessions.pop(session.id, None)
        if session.pending is not None:
            session.pending.reply(*error(404, f"session {session.id} ended (the episode is over)",
                                         "session_ended"))

    # ------------------------------------------------------------------------- HTTP

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request, body = await self._read(conn, reader)
                if request is None:
                    break
                if len(body) > MAX_BODY_BYTES:
                    status, payload = error(413, f"request body over {MAX_BODY_BYTES} bytes")
                else:
                    status, payload = await self._route(request, body)
                await self._send(conn, writer, status, payload)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    break
                conn.start_next_cycle()
        except h11.RemoteProtocolError as e:
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                status, payload = error(e.error_status_hint, f"malformed HTTP request: {e}")
                try:
                    await self._send(conn, writer, status, payload)
                except (ConnectionError, h11.LocalProtocolError):
                    pass
        except ConnectionError:
            pass
        finally:
            writer.close()

    @staticmethod
    async def _read(conn: h11.Connection, reader: asyncio.StreamReader
                    ) -> tuple[h11.Request | None, bytes]:
        request, body = None, bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                if len(body) <= MAX_BODY_BYTES:
                    body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return request, bytes(body)
            else:  # ConnectionClosed (or PAUSED, which a finished cycle never leaves us in)
                return None, b""

    @staticmethod
    async def _send(conn: h11.Connection, writer: asyncio.StreamWriter, status: int,
                    payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        headers = [("content-type", "application/json"), ("content-length", str(len(data)))]
        writer.write(conn.send(h11.Response(status_code=status, headers=headers)))
        writer.write(conn.send(h11.Data(data=data)))
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()

    async def _route(self, request: h11.Request, body: bytes) -> tuple[int, dict[str, Any]]:
        headers = dict(request.headers)  # h11 gives lower-case names
        if not hmac.compare_digest(headers.get(b"authorization", b""),
                                   b"Bearer " + self.secret.encode()):
            return error(401, "missing or wrong API key: send the job's secret as the bearer token "
                         "(the client an agent is given carries it)", "invalid_api_key")
        method = request.method.decode()
        parts = request.target.decode().split("?")[0].strip("/").split("/")
        session_id = None
        if len(parts) >= 2 and parts[0] == "s":
            session_id, parts = parts[1], parts[2:]
        if parts == ["v1", "models"] and method == "GET":
            return 200, {"object": "list", "data": [
                {"id": MODEL, "object": "model", "created": 0, "owned_by": "laminar"}]}
        route = {("v1", "chat", "completions"): "chat", ("v1", "completions"): "completion"}.get(tuple(parts))
        if route is None:
            return error(404, f"no route {method} {request.target.decode()}; this endpoint serves "
                         "POST .../v1/chat/completions, POST .../v1/completions, GET .../v1/models",
                         "unknown_route")
        if method != "POST":
            return error(405, f"{method} {request.target.decode()}: use POST")
        if session_id is None:
            return error(404, "no session in the URL: requests go to the base URL an agent is "
                         "given (http://host:port/s/<session>/v1), one session per episode",
                         "session_not_found")
        session = self.sessions.get(session_id)
        if session is None:
            return error(404, f"no session '{session_id}' (never opened, or its episode ended)",
                         "session_not_found")
        try:
            payload = json.loads(body)
        except ValueError as e:
            return error(400, f"the request body is not JSON: {e}")
        if not isinstance(payload, dict):
            return error(400, f"the request body is a JSON {type(payload).__name__}, not an object")
        return await session.submit(route, payload)


@dataclass
class _Settings:
    host: str = "127.0.0.1"
    port: int = 0
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(24))


_settings = _Settings()
_servers: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}  # one per environment loop


def configure(host: str, port: int, secret: str | None) -> None:
    """This process's endpoint settings (before its first episode); `secret` None: a random one."""
    global _settings
    _settings = _Settings(host, port, secret) if secret else _Settings(host, port)


async def running_server() -> Server:
    """The endpoint on the running loop, started on first use (by one caller; the others wait)."""
    loop = asyncio.get_running_loop()
    if loop not in _servers:  # a fixed port may still be held by the server of a loop this
        moved = bool(_servers)  # one replaced (an environment blocked it): take any free one
        _servers[loop] = loop.create_task(_start(0 if moved else _settings.port, moved))
    return await asyncio.shield(_servers[loop])


async def _restart() -> Server:
    """The endpoint on the running loop with the current settings: one started earlier with
    others (an in-process warm-start evaluation's) stops listening."""
    loop = asyncio.get_running_loop()
    old = _servers.pop(loop, None)
    if old is not None and old.done() and not old.exception():
        old.result().listener.close()
    _servers[loop] = loop.create_task(_start(_settings.port, moved=False))
    return await asyncio.shield(_servers[loop])


async def _start(port: int, moved: bool) -> Server:
    server = Server(_settings.secret)
    await server.start(_settings.host, port)
    if moved:
        log.warning("OpenAI-compatible endpoint moved to %s (the environment thread was "
                    "replaced)", server.url)
    return server


def serve(host: str, port: int, secret: str | None, runner: Any, timeout_s: float = 30.0) -> Server:
    """Configure this process's endpoint and start it on `runner` (an EnvRunner) now, so a port
    that cannot be bound fails the rollout at its start. Returns the server (its `url`)."""
    configure(host, port, secret)
    try:
        return runner.submit(_restart()).result(timeout=timeout_s)
    except OSError as e:
        raise ConfigError(f"rollout.openai_host={host!r} rollout.openai_port={port}: cannot listen "
                          f"({e}); use an address of this machine and a free port, or port 0 (any "
                          "free port)") from None


def serve_rollout(cfg: Any, rollout_id: str) -> Server:
    """A rollout's endpoint as `rollout.openai_*` say, started on the process's environment
    thread; prints where it listens. `openai_host` takes relay.host's forms (laminar/relay/
    address.py: an address, an interface name, a CIDR, 0.0.0.0), resolved on this node."""
    try:
        host, _ = resolve_host(cfg.rollout.openai_host, None, local_interfaces())
    except AddressError as e:
        raise ConfigError(str(e).replace("relay.host", "rollout.openai_host")) from None
    secret = os.environ.get(cfg.relay.secret_env) or None
    server = serve(host, cfg.rollout.openai_port, secret, _RUNNER)
    key = (f"the job secret (${cfg.relay.secret_env})" if secret else "a random key that only this "
           f"process's agents hold (set ${cfg.relay.secret_env} to choose the job's)")
    print(f"rollout {rollout_id}: OpenAI-compatible endpoint {server.url}/s/<session>/v1, one "
          f"session per episode; API key: {key}", flush=True)
    return server
