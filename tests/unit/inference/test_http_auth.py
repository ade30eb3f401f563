"""services/inference/http_auth.py: the bearer token on every path but /health and the policy-version headers,
on a bare ASGI app (no sockets, no engine)."""

from __future__ import annotations

import asyncio
import json

import pytest

from fleetrl.services.inference.http_auth import (
    VERSION_HEADER,
    VERSION_MAX_HEADER,
    AuthVersionMiddleware,
    is_authorized,
)


class _App:
    """An ASGI app that answers 200 (or `status`) after running `during` (e.g. a weight swap mid-request)."""

    def __init__(self, status: int = 200, during=None) -> None:
        self.status, self.during, self.calls = status, during, 0

    async def __call__(self, scope, receive, send) -> None:
        self.calls += 1
        if self.during is not None:
            self.during()
        await send({"type": "http.response.start", "status": self.status, "headers": [(b"x-app", b"1")]})
        await send({"type": "http.response.body", "body": b"ok"})


def _call(app, path: str = "/v1/chat/completions", headers=(), method: str = "POST"):
    scope = {"type": "http", "path": path, "method": method, "headers": list(headers)}
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = sent[0]
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


BEARER = [(b"authorization", b"Bearer secret")]


@pytest.mark.parametrize(
    ("headers", "ok"),
    [
        ([], False),
        ([(b"authorization", b"Bearer wrong")], False),
        ([(b"authorization", b"secret")], False),
        ([(b"Authorization", b"Bearer secret")], True),
    ],
)
def test_the_token_is_checked_on_every_path_but_health(headers, ok: bool) -> None:
    inner = _App()
    app = AuthVersionMiddleware(inner, token="secret", version_fn=lambda: 0)
    for path in ("/v1/chat/completions", "/tokenize", "/metrics", "/invocations"):
        status, response_headers, body = _call(app, path, headers)
        if ok:
            assert status == 200 and response_headers[b"x-app"] == b"1"
        else:
            assert status == 401 and json.loads(body)["error"]["type"] == "auth_error"
    assert _call(app, "/health")[0] == 200
    assert inner.calls == (5 if ok else 1)


def test_without_a_token_everything_is_open() -> None:
    assert is_authorized([], None)
    assert _call(AuthVersionMiddleware(_App(), token=None, version_fn=lambda: 3))[0] == 200


def test_the_headers_name_the_version_at_arrival_and_at_response_start() -> None:
    state = {"version": 4}

    def swap() -> None:
        state["version"] = 6

    app = AuthVersionMiddleware(_App(during=swap), token="secret", version_fn=lambda: state["version"])
    status, headers, _ = _call(app, headers=BEARER)
    assert status == 200
    assert (headers[VERSION_HEADER.encode()], headers[VERSION_MAX_HEADER.encode()]) == (b"4", b"6")


def test_observe_sees_each_authorized_response_as_it_starts() -> None:
    seen: list[tuple[str, int]] = []
    app = AuthVersionMiddleware(
        _App(status=400), token="secret", version_fn=lambda: 0, observe=lambda *a: seen.append(a)
    )
    _call(app, "/v1/completions", BEARER)
    _call(app, "/v1/completions")  # refused: not the app's response
    assert seen == [("/v1/completions", 400)]


def test_lifespan_passes_through() -> None:
    inner = []

    async def app(scope, receive, send):
        inner.append(scope["type"])

    asyncio.run(AuthVersionMiddleware(app, token="secret", version_fn=lambda: 0)({"type": "lifespan"}, None, None))
    assert inner == ["lifespan"]
