"""The agent session server: an OpenAI chat-completions endpoint per rollout sample, served by each gateway (and by
`fleetrl eval`), recording every model call for training (fleetrl.agent_session).

    sessions = SessionServer(sampler, tokenizer, model="policy", sample_kwargs=..., max_seq_len=...)
    session = await sessions.open()      # starts the server on first use; session.base_url = .../sessions/<id>/v1
    ... an agent calls POST {session.base_url}/chat/completions with the openai client ...
    run = session.to_rollout_run(reward=r)
    await sessions.close()

Each call renders the chat template over the request's messages and tools (fleetrl.openai_chat; in an
`exact_history` session a call that extends the previous one is appended as tokens instead), samples through the
gateway's `Sampler` with the session id as its affinity key (so the session keeps to one replica, for its prefix
cache, while that replica is routable, and moves only when it is fenced or fails the call: the sampler's `user=`),
records the prompt ids, the generated ids verbatim, their logprobs and versions, and answers in the OpenAI format
(tool calls parsed from the hermes format, `stream=True` as server-sent events). The agent and the session server
live in the gateway's process, so by default the endpoint is on the gateway's loopback: nothing else needs to reach
it, and under `fleetrl up`, compose or the chart the gateway reaches the replicas over gRPC as for every other
rollout. An agent that runs elsewhere (a sandbox container or pod the rollout starts) needs the endpoint on an
address it can reach: `FLEETRL_SESSION_HOST` (the gateway's environment) is the address the server binds
(`0.0.0.0` for every interface), `FLEETRL_SESSION_ADVERTISE_HOST` the host the session URLs name (default: the bound
address, or for a wildcard bind this host's own address, `socket.gethostbyname(socket.gethostname())`; the chart
sets the pod's IP), and `FLEETRL_SESSION_PORT` the port (default 0: a free one; a fixed port is for one gateway
per host or pod, as the chart runs them). Calls still need the session's api_key.

Sampling: the run's settings (`sample_kwargs`: temperature, top_p, top_k) always apply, because the trainer's
importance ratios assume the run's sampling distribution; a request's own temperature/top_p/top_k are overridden
(logged once). `max_tokens` / `max_completion_tokens` are honoured up to the run's `max_tokens`, and capped so
prompt + completion fit `max_seq_len`. `stop` strings, `tools`, `tool_choice` ("none" keeps tool calls as text),
`logprobs`, `stream` and `stream_options.include_usage` are honoured; `n` must be 1.

The routes (bearer token = the session's api_key): POST /sessions/{id}/v1/chat/completions,
GET /sessions/{id}/v1/models, and POST /v1/chat/completions, GET /v1/models (`RolloutSetup.inference_base_url`:
served the same way, recorded nowhere; each reply carries the exact prompt and completion token ids, logprobs and
versions). `listen()` binds the port before any session opens, so that URL is known from the start (the gateway's
`RolloutSetup.for_run` calls it); the server starts serving at the first connection.

Under load and abuse (`SessionLimits`, fleetrl.gateway.session_limits; the run's `session_*` fields): a session no
call reached for `session_idle_timeout_s` expires (404 naming the limit); a body over `session_max_body_bytes` is a
413 before it is parsed; past `session_max_connections` open connections a new one is closed as it is accepted; a
connection that sends no complete request or a reader that takes none of its reply for 30 s (to 60 s) is aborted,
and a body that stops arriving for 30 s is a 408. Chat templates are rendered on a worker thread, so a long prompt
never stalls the gateway's event loop (its heartbeats, leases and other rollouts). The key is checked before
anything else, so a caller without it learns nothing (not even whether a session exists). `stats` counts what was
refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import logging
import os
import secrets
import socket
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fleetrl.agent_session import AgentSession, ExactHistory, SessionTurn, appended_prompt, comparable_message
from fleetrl.gateway.session_limits import SessionLimits, SessionRegistry
from fleetrl.message_trajectory import TITOTokenizer
from fleetrl.openai_chat import (
    ChatRequestError,
    ToolsIgnoredCheck,
    assistant_message,
    chat_completion_body,
    chat_stop_ids,
    render_chat_prompt,
    stop_text_cut,
    template_messages,
    token_logprobs,
)
from fleetrl.shell.heap import CyclicGarbage

log = logging.getLogger(__name__)
_START_TIMEOUT_S = 30.0
SESSION_HOST_ENV = "FLEETRL_SESSION_HOST"
SESSION_ADVERTISE_HOST_ENV = "FLEETRL_SESSION_ADVERTISE_HOST"
SESSION_PORT_ENV = "FLEETRL_SESSION_PORT"
_WILDCARDS = ("0.0.0.0", "::", "")
_RUN_SETTINGS = ("temperature", "top_p", "top_k")
_MAX_TITOS = 8
GARBAGE_INTERVAL_S = 10.0


_UNSUPPORTED = {
    "response_format": "structured outputs are not supported in a session; leave it out or {'type': 'text'}",
    "logit_bias": "the sampled distribution must be the run's (the trainer's importance ratios assume it)",
    "presence_penalty": "the sampled distribution must be the run's (the trainer's importance ratios assume it)",
    "frequency_penalty": "the sampled distribution must be the run's (the trainer's importance ratios assume it)",
    "top_logprobs": "only the sampled token's logprob is returned (logprobs=True)",
    "functions": "the legacy functions API is not supported; pass tools",
}


def refuse_unsupported(body: dict[str, Any]) -> None:
    """A request field a session cannot honour, set to something other than its neutral value, is refused naming
    it (never ignored: the agent would get another behaviour than it asked for)."""
    for name, why in _UNSUPPORTED.items():
        value = body.get(name)
        neutral = value in (None, 0, {}, []) or (name == "response_format" and value == {"type": "text"})
        if not neutral:
            raise ChatRequestError(f"{name}: {why}")


def session_hosts(host: str | None = None, advertise_host: str | None = None) -> tuple[str, str]:
    """(the address to bind, the host session URLs name): the arguments, else `FLEETRL_SESSION_HOST` /
    `FLEETRL_SESSION_ADVERTISE_HOST`, else the loopback. A wildcard bind with nothing to advertise names this
    host's own address (a URL naming 0.0.0.0 reaches nothing from another machine)."""
    bind = host if host is not None else os.environ.get(SESSION_HOST_ENV, "").strip() or "127.0.0.1"
    shown = advertise_host if advertise_host is not None else os.environ.get(SESSION_ADVERTISE_HOST_ENV, "").strip()
    if not shown:
        shown = socket.gethostbyname(socket.gethostname()) if bind in _WILDCARDS else bind
    if shown in _WILDCARDS:
        raise ValueError(f"{SESSION_ADVERTISE_HOST_ENV}: {shown!r} is a wildcard; name an address agents can reach")
    return bind, shown


def session_port(port: int | None = None) -> int:
    """The port to bind: the argument, else `FLEETRL_SESSION_PORT`, else 0 (a free port). A bad value is refused
    naming the variable."""
    if port is None:
        text = os.environ.get(SESSION_PORT_ENV, "").strip() or "0"
        try:
            port = int(text)
        except ValueError:
            raise ValueError(f"{SESSION_PORT_ENV}: {text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{SESSION_PORT_ENV}: {port} is not a port number (0 to 65535; 0 = a free port)")
    return port


@dataclass(frozen=True)
class TokenLogprobs:
    """A choice's `logprobs` object (`fleetrl.openai_chat.token_logprobs`) not built yet: its JSON is made a slice
    of tokens at a time as the reply is sent (`json_pieces`), so the server never holds an object per generated
    token for the whole reply (~50 MB of them for 120,000 tokens) nor its whole JSON (~8 MB) while a reader is slow.
    """

    tokenizer: Any
    token_ids: Sequence[int]
    logprobs: Sequence[float]

    def json_pieces(self, tokens_per_piece: int = 1024) -> Iterator[str]:
        """The object's compact JSON, `{"content":[...]}`, in pieces of `tokens_per_piece` entries."""
        yield '{"content":['
        for start in range(0, len(self.token_ids), tokens_per_piece):
            end = start + tokens_per_piece
            entries = token_logprobs(self.tokenizer, self.token_ids[start:end], self.logprobs[start:end])["content"]
            text = json.dumps(entries, ensure_ascii=False, allow_nan=False, separators=(",", ":"))[1:-1]
            yield text if start == 0 else "," + text
        yield "]}"


@dataclass(frozen=True)
class JSONList:
    """A reply's list of numbers (token ids, logprobs, versions) whose JSON is made a slice at a time as the reply
    is sent (`json_pieces`), like `TokenLogprobs`."""

    items: Sequence[Any]

    def json_pieces(self, per_piece: int = 8192) -> Iterator[str]:
        """The list's compact JSON in pieces of `per_piece` items."""
        yield "["
        for start in range(0, len(self.items), per_piece):
            text = json.dumps(list(self.items[start : start + per_piece]), allow_nan=False, separators=(",", ":"))
            yield text[1:-1] if start == 0 else "," + text[1:-1]
        yield "]"


def _first_connection(server_ref: weakref.ref[SessionServer]) -> None:
    server = server_ref()
    if server is not None:
        server._first_connection()


def _log_start_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the agent session server did not start: %s", task.exception())


class SessionServer:
    """Per-sample OpenAI endpoints over a `Sampler` (see the module docstring)."""

    def __init__(
        self,
        sampler: Any,
        tokenizer: Any,
        *,
        model: str = "policy",
        tokenizer_id: str = "",
        sample_kwargs: dict[str, Any] | None = None,
        max_seq_len: int | None = None,
        host: str | None = None,
        advertise_host: str | None = None,
        port: int | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        limits: SessionLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.model = model
        self.tokenizer_id = tokenizer_id
        self.sample_kwargs = dict(sample_kwargs or {})
        self.max_seq_len = max_seq_len
        self.host, self.advertise_host = session_hosts(host, advertise_host)
        self.bind_port = session_port(port)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.api_key = f"fleetrl-session-{secrets.token_hex(16)}"
        self.limits = limits or SessionLimits()
        # Held weakly: a session lives as long as its rollout holds it (one that failed half-way is not kept); one
        # held but not called for limits.idle_timeout_s expires.
        self.sessions = SessionRegistry(self.limits.idle_timeout_s, clock)
        self.clock = clock
        self._next_sweep = clock()
        # An agent's HTTP client per session is left as cyclic garbage holding native memory (its SSL context):
        # collected every few seconds while sessions open, not minutes later (fleetrl.shell.heap.CyclicGarbage).
        self.garbage = CyclicGarbage(GARBAGE_INTERVAL_S, clock)
        self.stats: Counter[str] = Counter()  # what was refused: connections_refused, connections_stalled, ...
        self._warned_at: dict[str, float] = {}
        self._render_pool: ThreadPoolExecutor | None = None  # chat templates rendered off the event loop
        self._sweeper: asyncio.Task[None] | None = None
        self.port: int | None = None
        self._sock: socket.socket | None = None  # bound and listening before the server serves (listen())
        self._watched: asyncio.AbstractEventLoop | None = None
        self._lazy_start: asyncio.Task[None] | None = None
        self._server: Any = None
        self._task: asyncio.Task[Any] | None = None
        self._starting = asyncio.Lock()
        self._stop_ids: tuple[int, ...] | None = None  # the tokenizer's end-of-turn ids, read at the first call
        self._warned_override = False
        self._titos: dict[str, TITOTokenizer] = {}
        self._tools_check = ToolsIgnoredCheck(tokenizer_id or str(getattr(tokenizer, "name_or_path", "") or model))

    @property
    def base_url(self) -> str:
        """The server's own OpenAI base URL (calls there are served, not recorded); needs the server started."""
        if self.port is None:
            raise RuntimeError("the session server is not started: await open() or start() first")
        return f"http://{self._url_host()}:{self.port}/v1"

    def _url_host(self) -> str:
        return f"[{self.advertise_host}]" if ":" in self.advertise_host else self.advertise_host

    async def open(self, *, exact_history: bool = False) -> AgentSession:
        """A new session (the server started on first use). It runs its calls in the caller's context, so calls
        made from a gateway rollout are seeded from that rollout (fleetrl.gateway.sampling_seed). `exact_history`:
        a call that extends the previous one is appended as tokens (fleetrl.agent_session)."""
        await self.start()
        self.sweep_if_due()
        session_id = uuid.uuid4().hex
        session = AgentSession(
            session_id=session_id,
            base_url=f"http://{self._url_host()}:{self.port}/sessions/{session_id}/v1",
            api_key=self.api_key,
            model=self.model,
            tokenizer_id=self.tokenizer_id,
            exact_history=exact_history,
            context=contextvars.copy_context(),
        )
        self.sessions.add(session)
        self.garbage.note()
        return session

    def connections(self) -> int:
        """Connections open to the server now (0 before it serves)."""
        return 0 if self._server is None else len(self._server.server_state.connections)

    def unsent_bytes(self) -> int:
        """Reply bytes the server's open connections hold in their transports, not yet taken by their readers."""
        if self._server is None:
            return 0
        transports = (getattr(p, "transport", None) for p in self._server.server_state.connections)
        return sum(t.get_write_buffer_size() for t in transports if t is not None)

    def forget(self, session: AgentSession) -> None:
        """Drop a finished session's record (its endpoint then answers 404)."""
        self.sessions.pop(session.session_id, None)

    def sweep_if_due(self) -> None:
        """Expire idle sessions (and forget closed or dropped ones), at most every few seconds of `clock`; collect
        the cyclic garbage the sessions' agents left, at most every `GARBAGE_INTERVAL_S`."""
        self.garbage.collect_if_due()
        now = self.clock()
        if now < self._next_sweep:
            return
        idle = self.limits.idle_timeout_s
        self._next_sweep = now + (min(max(idle / 10, 0.1), 10.0) if idle else 10.0)
        expired = self.sessions.sweep()
        if expired:
            self.stats["sessions_expired"] += expired
            log.info("agent sessions: %d expired after %g s without a call (session_idle_timeout_s)", expired, idle)

    def refused(self, what: str, message: str) -> None:
        """Count a refusal under `what`; warn about it at most once a minute per kind."""
        self.stats[what] += 1
        now = time.monotonic()
        if now - self._warned_at.get(what, -1e9) >= 60.0:
            self._warned_at[what] = now
            log.warning("agent session server: %s (%d so far)", message, self.stats[what])

    async def render(self, fn: Callable[..., list[int] | None], *args: Any, **kwargs: Any) -> list[int] | None:
        """`fn(*args, **kwargs)` (a chat template's rendering) on the server's worker thread."""
        if self._render_pool is None:
            self._render_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="session-render")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._render_pool, functools.partial(fn, *args, **kwargs))

    def listen(self) -> str:
        """Bind the port now, so `base_url` is known (and given to rollouts as `RolloutSetup.inference_base_url`)
        before any session opens; the server itself starts at the first connection (or `open()` / `start()`).
        Called on the running event loop (the one that will serve); a connection made before the server runs waits
        in the socket's backlog. Returns `base_url`."""
        if self._sock is None and self._task is None:
            loop = asyncio.get_running_loop()
            self._sock = self._bind()
            # Held weakly: a setup dropped without close() (a test's) closes its socket as it goes (__del__).
            loop.add_reader(self._sock.fileno(), _first_connection, weakref.ref(self))
            self._watched = loop
        return self.base_url

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted gateway rebinds a fixed port
        sock.bind((self.host, self.bind_port))
        sock.listen(128)
        self.port = int(sock.getsockname()[1])
        return sock

    def _unwatch(self) -> None:
        if self._watched is not None and self._sock is not None:
            self._watched.remove_reader(self._sock.fileno())
        self._watched = None

    def __del__(self) -> None:
        sock = getattr(self, "_sock", None)  # None too when __init__ refused its arguments
        if sock is not None:
            sock.close()

    def _first_connection(self) -> None:
        """A client connected to the listening port: start serving (once)."""
        self._unwatch()
        if self._lazy_start is None:
            self._lazy_start = asyncio.get_running_loop().create_task(self.start(), name="agent-session-start")
            self._lazy_start.add_done_callback(_log_start_failure)

    async def start(self) -> None:
        """Bind (unless `listen()` did) and serve (idempotent)."""
        async with self._starting:
            if self._task is not None:
                return
            try:
                import fastapi  # noqa: F401  (the routes' framework: fleetrl.gateway.session_app)
                import uvicorn
            except ImportError as exc:
                raise RuntimeError(
                    f"agent sessions need FastAPI and uvicorn ({exc}): pip install 'fleetrl[http]'"
                ) from exc

            class _Server(uvicorn.Server):
                def capture_signals(self):  # the service owns SIGINT/SIGTERM, not uvicorn
                    return contextlib.nullcontext()

            self._unwatch()
            sock = self._sock if self._sock is not None else self._bind()
            self._sock = None  # the server's now
            from fleetrl.gateway.session_app import guarded_protocol

            config = uvicorn.Config(
                self.app(),
                log_level="warning",
                access_log=False,
                lifespan="off",
                http=guarded_protocol(self),
                backlog=max(128, min(self.limits.max_connections, 4096)),
            )
            self._server = _Server(config)
            self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="agent-session-server")
            deadline = time.monotonic() + _START_TIMEOUT_S
            while not self._server.started:
                if self._task.done():
                    self._task.result()
                    raise RuntimeError("the agent session server stopped during startup")
                if time.monotonic() > deadline:
                    self._task.cancel()
                    raise TimeoutError(f"the agent session server did not start within {_START_TIMEOUT_S:.0f} s")
                await asyncio.sleep(0.01)
            self._sweeper = asyncio.create_task(self._sweep_idle(), name="agent-session-expiry")
            log.info("agent session server on %s:%d (URLs name %s)", self.host, self.port, self.advertise_host)

    async def _sweep_idle(self) -> None:
        """Expire idle sessions while no call comes to do it."""
        while True:
            await asyncio.sleep(min(max(self.limits.idle_timeout_s / 10, 1.0), 30.0))
            self.sweep_if_due()

    async def close(self, timeout_s: float = 5.0) -> None:
        self._unwatch()
        if self._lazy_start is not None and not self._lazy_start.done():
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._lazy_start), timeout_s)
        if self._sock is not None:  # listened, never served
            self._sock.close()
            self._sock = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._render_pool is not None:
            self._render_pool.shutdown(wait=False, cancel_futures=True)
            self._render_pool = None
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, timeout_s)
        except TimeoutError:
            self._task.cancel()
        self._task = None

    def app(self) -> Any:
        """The FastAPI app of the routes (fleetrl.gateway.session_app)."""
        from fleetrl.gateway.session_app import build_session_app

        return build_session_app(self)

    # --- one call ------------------------------------------------------------------------------------------------
    def sampling_args(self, body: dict[str, Any], prompt_len: int) -> dict[str, Any]:
        """The sampler arguments of a request: the run's settings, the request's length and stops."""
        n = body.get("n", 1)
        if n not in (None, 1):
            raise ChatRequestError(f"n: a session call samples one completion, got {n}")
        refuse_unsupported(body)
        if body.get("model") not in (None, self.model):
            raise ChatRequestError(f"model: unknown model {body.get('model')!r}; serving {self.model!r}")
        overridden = [k for k in _RUN_SETTINGS if body.get(k) is not None and body[k] != self.sample_kwargs.get(k)]
        if overridden and not self._warned_override:
            self._warned_override = True
            log.warning("agent session: the run's sampling settings replace the request's %s", overridden)
        args = {k: self.sample_kwargs[k] for k in _RUN_SETTINGS if k in self.sample_kwargs}
        run_max = int(self.sample_kwargs.get("max_tokens", 64))
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        args["max_tokens"] = min(int(asked), run_max) if asked else run_max
        if self.max_seq_len is not None:
            args["max_seq_len"] = self.max_seq_len
        stops = body.get("stop")
        if stops:
            args["stop"] = stops
        if self._stop_ids is None:
            self._stop_ids = chat_stop_ids(self.tokenizer)
        args["stop_token_ids"] = tuple(body.get("stop_token_ids") or ()) + self._stop_ids
        return args

    def _tito(self, chat_template_kwargs: dict[str, Any]) -> TITOTokenizer:
        """The token-in/token-out renderer of exact-history sessions (one per set of template arguments)."""
        key = repr(sorted(chat_template_kwargs.items()))
        if key not in self._titos:
            while len(self._titos) >= _MAX_TITOS:  # the kwargs come from requests: keep a few, not every one seen
                self._titos.pop(next(iter(self._titos)))
            self._titos[key] = TITOTokenizer(self.tokenizer, chat_template_kwargs=chat_template_kwargs)
        return self._titos[key]

    async def chat(self, body: dict[str, Any], session: AgentSession | None) -> dict[str, Any]:
        """A chat.completion body for `body`, the call recorded in `session`. What grows with the reply's length
        (a choice's `logprobs`, when asked for, and its token ids, logprobs and versions) is a `TokenLogprobs` or a
        `JSONList`, which the HTTP edge encodes as it sends the reply (fleetrl.gateway.session_app)."""
        tools = body.get("tools") or None
        kwargs = {**self.chat_template_kwargs, **(body.get("chat_template_kwargs") or {})}
        prompt = None
        if session is not None and session.exact_history:
            tito = self._tito(kwargs)
            prompt = await self.render(appended_prompt, tito, session.history, body.get("messages") or [], tools)
        if prompt is None:
            prompt = await self.render(
                render_chat_prompt, self.tokenizer, body.get("messages"), tools=tools, chat_template_kwargs=kwargs
            )
            if tools and not self._tools_check.checked:
                await self.render(self._tools_check.check, self.tokenizer, body["messages"], tools, prompt, kwargs)
        args = self.sampling_args(body, len(prompt))
        if session is not None:
            args["user"] = session.session_id
        (c,) = await self.sampler.sample_with_prompt_tokens(prompt, n=1, **args)
        generated = list(c.completion_tokens)
        if session is not None:
            turn = SessionTurn(prompt, generated, list(c.inference_logprobs), list(c.versions), c.finish_reason)
            session.record(turn)
        text = stop_text_cut(self.tokenizer.decode(generated, skip_special_tokens=True), body.get("stop"))
        message, finish = assistant_message(
            text, c.finish_reason, tools_offered=bool(tools), tool_choice=body.get("tool_choice")
        )
        if session is not None and session.exact_history:
            conversation = [*template_messages(body["messages"]), *template_messages([message])]
            history = [comparable_message(m) for m in conversation]
            session.history = ExactHistory(history, [*prompt, *generated], tools)
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if body.get("logprobs"):
            choice["logprobs"] = TokenLogprobs(self.tokenizer, generated, c.inference_logprobs)
        choice.update(
            token_ids=JSONList(generated), token_logprobs=JSONList(c.inference_logprobs), versions=JSONList(c.versions)
        )
        choice["prompt_token_ids"] = JSONList(prompt)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(generated)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return chat_completion_body(self.model, [choice], usage)
