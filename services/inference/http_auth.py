"""The ASGI middleware in front of both OpenAI-compatible apps (vLLM's own, vllm_openai.py; the hf engine's,
http_api.py): the run's bearer token and the policy-version headers.

    app = AuthVersionMiddleware(app, token="secret", version_fn=lambda: engine.loaded_version)

- Auth: with a token, every request but `GET /health` (and CORS preflights) needs `Authorization: Bearer <token>`
  (the OpenAI client's `api_key`), else 401 with an OpenAI-shaped error body. Without a token (none configured
  and no $FLEETRL_AUTH_TOKEN) everything is open. vLLM's own `--api-key` is not used: it guards only /v1, /v2,
  /inference and /cohere, leaving /tokenize, /invocations, /metrics and /version open.
- Versions: every response carries `x-fleetrl-policy-version`, the engine's loaded version when the request
  arrived, and `x-fleetrl-policy-version-max`, the loaded version when the response started. Versions only grow
  and the engine swaps weights in place while requests run, so every token of a non-streaming response came from
  a version in [policy-version, policy-version-max]. A streaming response starts before its first token: there
  the two usually agree, and a later swap is not reflected.
- `observe(path, status)`, when given, is called once per authorized HTTP response as it starts (metrics).
- `track()`, when given, is an async context manager entered around each authorized request until its response
  has been sent (a LoRA vLLM engine's `holding_adapters`: no adapter the request may use is removed meanwhile).

The middleware wraps the finished app (vLLM's build_app has already built its middleware stack, so
`app.add_middleware` would fail there) and reads the version at `http.response.start`, so it works for streaming.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import AbstractAsyncContextManager
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

VERSION_HEADER = "x-fleetrl-policy-version"
VERSION_MAX_HEADER = "x-fleetrl-policy-version-max"
OPEN_PATHS = ("/health",)


def is_authorized(headers: list[tuple[bytes, bytes]], token: str | None) -> bool:
    """Whether raw ASGI `headers` carry `Authorization: Bearer <token>` (always true without a token)."""
    if token is None:
        return True
    sent = b""
    for name, value in headers:
        if name.lower() == b"authorization":
            sent = value
            break
    return hmac.compare_digest(sent, f"Bearer {token}".encode())


def unauthorized_body() -> bytes:
    """The OpenAI-shaped 401 body."""
    message = "missing or wrong 'Authorization: Bearer <token>'"
    return json.dumps({"error": {"message": message, "type": "auth_error", "code": 401}}).encode()


class AuthVersionMiddleware:
    """Bearer-token auth on every path but OPEN_PATHS, and the policy-version headers on every response."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: str | None,
        version_fn: Callable[[], int],
        observe: Callable[[str, int], None] | None = None,
        track: Callable[[], AbstractAsyncContextManager[None]] | None = None,
        open_paths: tuple[str, ...] = OPEN_PATHS,
    ) -> None:
        self.app = app
        self.token = token
        self.version_fn = version_fn
        self.observe = observe
        self.track = track
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        exempt = path in self.open_paths or scope.get("method") == "OPTIONS"
        if not exempt and not is_authorized(scope.get("headers", []), self.token):
            await self._refuse(scope, receive, send)
            return
        arrived = str(self.version_fn())

        async def send_with_versions(message: Message) -> None:
            if message["type"] == "http.response.start":
                versions = [(VERSION_HEADER.encode(), arrived.encode())]
                versions.append((VERSION_MAX_HEADER.encode(), str(self.version_fn()).encode()))
                message = {**message, "headers": [*message.get("headers", []), *versions]}
                if self.observe is not None:
                    self.observe(path, int(message["status"]))
            await send(message)

        if self.track is None:
            await self.app(scope, receive, send_with_versions)
            return
        async with self.track():
            await self.app(scope, receive, send_with_versions)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # close the handshake: 1008 = policy violation
            await send({"type": "websocket.close", "code": 1008})
            return
        body = unauthorized_body()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
