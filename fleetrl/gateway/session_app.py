"""The HTTP edge of the agent session server (fleetrl.gateway.session_server): its routes, and the uvicorn protocol
that bounds its connections. Kept apart so the gateway imports FastAPI and uvicorn only when a rollout opens its
first session.

Every request is checked in this order, each refusal OpenAI-shaped: the bearer key (401, before anything else, so a
caller without it learns nothing, not even whether a session exists), the session (404: unknown, closed or expired
after `session_idle_timeout_s`), the body's size (413 over `session_max_body_bytes`, from its Content-Length before
a byte is read, else as it arrives), a body that stops arriving (408), JSON (400). The connection itself is watched
by `guarded_protocol`: past `max_connections` a new one is closed as it is accepted, and one that stalls (no
complete request, or a reply its reader takes none of) for `stall_timeout_s` is aborted, its file descriptor freed.

A reply goes out through the ASGI send in pieces of `REPLY_CHUNK_BYTES` (chunked transfer encoding), before each of
which uvicorn waits for the connection's transport to drain below its high-water mark (flow control), so a reader
that takes none of a long reply leaves at most a piece or two in its transport (a reply sent as one message was
copied whole into the transport's buffer). The reply's JSON is rendered as the model's answer comes in, except what
grows with its length: the per-token logprobs (`TokenLogprobs`: ~8 MB of JSON and ~50 MB of Python objects for
120,000 tokens) and the token ids, logprobs and versions (`JSONList`), encoded a slice of tokens at a time as the
pieces go out. What a slow reader makes the server hold is the rest (the message's text and a few fields) and a
piece.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from fleetrl.agent_session import AgentSession, SessionError
from fleetrl.gateway.session_server import JSONList, TokenLogprobs
from fleetrl.openai_chat import ChatRequestError, stream_events

if TYPE_CHECKING:
    from fleetrl.gateway.session_server import SessionServer

log = logging.getLogger(__name__)
REPLY_CHUNK_BYTES = 64 * 1024
Deferred = TokenLogprobs | JSONList


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """An OpenAI-shaped error body."""
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


class _Refused(Exception):
    """A request refused while its body was read (the response to send)."""

    def __init__(self, response: JSONResponse) -> None:
        super().__init__(response.status_code)
        self.response = response


async def read_body(request: Request, max_bytes: int, stall_timeout_s: float) -> bytes:
    """The request's body, refused (`_Refused`) with 413 once it is known to exceed `max_bytes` (from its
    Content-Length before a byte is read, else as it arrives) and with 408 when no byte of it arrives for
    `stall_timeout_s`."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise _Refused(error(400, f"content-length: {declared!r} is not a number"))
        if int(declared) > max_bytes:
            raise _Refused(_too_large(f"{int(declared)} bytes", max_bytes))
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    while True:
        try:
            async with asyncio.timeout(stall_timeout_s):
                chunk = await stream.__anext__()
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise _Refused(
                error(408, f"the body stopped arriving: no byte of it for {stall_timeout_s:g} s", "timeout_error")
            ) from None
        size += len(chunk)
        if size > max_bytes:
            raise _Refused(_too_large(f"over {max_bytes} bytes", max_bytes))
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str, max_bytes: int) -> JSONResponse:
    return error(413, f"the body is {size}; a session request holds at most {max_bytes} bytes (session_max_body_bytes)")


def deferred_parts(result: dict[str, Any]) -> dict[str, Deferred]:
    """Put a marker string in place of each choice's `TokenLogprobs` and `JSONList` values in `result`; returns
    them by their marker as JSON writes it (a NUL and a random id: no text a model or a caller sends can be taken
    for one)."""
    deferred: dict[str, Deferred] = {}
    for choice in result.get("choices", ()):
        for key, value in choice.items():
            if isinstance(value, (TokenLogprobs, JSONList)):
                marker = f"\x00fleetrl-deferred-{uuid.uuid4().hex}"
                deferred[json.dumps(marker)] = value
                choice[key] = marker
    return deferred


def expanded(text: str, deferred: dict[str, Deferred]) -> Iterator[str]:
    """`text` (JSON, or server-sent events of JSON) in pieces, each marker replaced by its value's JSON."""
    while True:
        found = [(text.find(marker), marker) for marker in deferred if marker in text]
        if not found:
            break
        at, marker = min(found)
        head, text = text[:at], text[at + len(marker) :]  # the whole text is let go of here
        yield head
        del head
        yield from deferred[marker].json_pieces()
    yield text


async def _pieces(texts: list[str], deferred: dict[str, Deferred]) -> AsyncIterator[bytes]:
    """The reply's texts (its JSON, or its events) in UTF-8 pieces of about `REPLY_CHUNK_BYTES` (at most 4 x that),
    each text let go of once sent. An async iterator: Starlette sends it on the event loop, not through a thread
    per piece."""
    texts.reverse()
    while texts:
        for part in expanded(texts.pop(), deferred):
            for start in range(0, len(part), REPLY_CHUNK_BYTES):
                yield part[start : start + REPLY_CHUNK_BYTES].encode()


def build_session_app(server: SessionServer) -> FastAPI:
    """The session routes over `server` (its sessions, key, model, limits and `chat`)."""
    app = FastAPI(title="fleetrl agent sessions", docs_url=None, redoc_url=None, openapi_url=None)
    limits = server.limits

    def authorised(request: Request) -> bool:
        return secrets.compare_digest(
            request.headers.get("authorization", "").encode(), f"Bearer {server.api_key}".encode()
        )

    def unauthorised() -> JSONResponse:
        server.refused("bad_keys", "a call with a missing or wrong key was refused (401)")
        return error(401, "invalid api key: use the session's api_key", "authentication_error")

    async def parsed_body(request: Request) -> dict[str, Any]:
        try:
            raw = await read_body(request, limits.max_body_bytes, limits.stall_timeout_s)
        except _Refused as refused:
            what = "bodies_too_large" if refused.response.status_code == 413 else "bodies_refused"
            server.refused(what, f"a request body was refused ({refused.response.status_code})")
            raise
        except ClientDisconnect:
            raise _Refused(error(400, "the client went away while sending the body")) from None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise _Refused(error(400, "the body is not JSON")) from None
        if not isinstance(body, dict):
            raise _Refused(error(400, "the body must be a JSON object"))
        return body

    async def reply(body: dict[str, Any], session: AgentSession | None) -> Response:
        """The call's response, sent in pieces with its logprobs encoded as they go (module docstring)."""
        result = await server.chat(body, session)
        deferred = deferred_parts(result)
        if body.get("stream"):
            options = body.get("stream_options") or {}
            if not isinstance(options, dict):
                return error(400, "stream_options: must be an object")
            events = stream_events(result, include_usage=bool(options.get("include_usage")))
            return StreamingResponse(_pieces(events, deferred), media_type="text/event-stream")
        text = json.dumps(result, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return StreamingResponse(_pieces([text], deferred), media_type="application/json")

    async def respond(request: Request, session: AgentSession | None) -> Any:
        try:
            body = await parsed_body(request)
        except _Refused as refused:
            return refused.response
        try:
            work = reply(body, session)
            if session is not None and session.context is not None:
                return await asyncio.create_task(work, context=session.context)
            return await work
        except (ChatRequestError, SessionError, TypeError, ValueError) as exc:  # the request's fault (named)
            return error(400, str(exc))
        except Exception as exc:  # no replica, a failed call: the agent may retry
            log.warning("agent session call failed: %s", exc)
            return error(503, f"sampling failed: {exc}", "engine_error")

    async def session_chat(session_id: str, request: Request) -> Any:
        if not authorised(request):
            return unauthorised()
        server.sweep_if_due()
        session = server.sessions.get(session_id)
        if session is None:
            return error(404, server.sessions.why_missing(session_id), "not_found_error")
        with server.sessions.calling(session_id):
            return await respond(request, session)

    async def chat(request: Request) -> Any:
        if not authorised(request):
            return unauthorised()
        return await respond(request, None)

    async def models(request: Request, session_id: str | None = None) -> Any:
        if not authorised(request):
            return unauthorised()
        card = {"id": server.model, "object": "model", "created": 0, "owned_by": "fleetrl"}
        return JSONResponse({"object": "list", "data": [card]})

    app.post("/sessions/{session_id}/v1/chat/completions")(session_chat)
    app.get("/sessions/{session_id}/v1/models")(models)
    app.post("/v1/chat/completions")(chat)
    app.get("/v1/models")(models)
    return app


def guarded_protocol(server: SessionServer) -> type:
    """uvicorn's HTTP protocol class for `server`, bounding its connections (`server.limits`): one past
    `max_connections` is aborted as it is accepted, and one that makes no progress for `stall_timeout_s` (no
    complete request while idle, or a reply whose reader takes none of it) is aborted, so its file descriptor is
    freed at once (a plain close waits for the unread reply to drain, which it never does). A request being
    answered (the model sampling) is progress, however long it takes."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    limits = server.limits

    class GuardedProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        _fleetrl_timer: asyncio.TimerHandle | None = None
        _fleetrl_mark: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                server.refused(
                    "connections_refused",
                    f"{len(self.connections) - 1} connections are open (session_max_connections): a new one was closed",
                )
                transport.abort()
                return
            self._fleetrl_timer = self.loop.call_later(limits.stall_timeout_s, self._fleetrl_check)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._fleetrl_timer is not None:
                self._fleetrl_timer.cancel()
                self._fleetrl_timer = None
            super().connection_lost(exc)

        def _fleetrl_progress(self) -> Any:
            if self.transport.is_closing():  # closed gently (keep-alive's end) but its reply may never drain
                return ("closing", self.transport.get_write_buffer_size())
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                if not self.flow.write_paused:
                    return object()  # being answered: always progress
                return ("paused", cycle, self.transport.get_write_buffer_size())
            return ("idle", cycle)

        def _fleetrl_check(self) -> None:
            self._fleetrl_timer = None
            mark = self._fleetrl_progress()
            if mark == self._fleetrl_mark:
                stalled = "no request came" if mark[0] == "idle" else "a reader took none of its reply"
                server.refused(
                    "connections_stalled", f"a connection was closed: {stalled} for {limits.stall_timeout_s:g} s"
                )
                self.transport.abort()
                return
            self._fleetrl_mark = mark
            self._fleetrl_timer = self.loop.call_later(limits.stall_timeout_s, self._fleetrl_check)

    return GuardedProtocol
