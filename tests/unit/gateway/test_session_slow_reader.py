"""What one slow reader can make the agent session server hold (issue 45, item 8): a long reply (120,000 tokens with
logprobs, ~8 MB of JSON) to a client that reads none of it. Real uvicorn over a real socket, a scripted sampler.

The reply goes through the ASGI send in pieces, so uvicorn's flow control pauses the writer at the transport's
high-water mark: the connection's transport never buffers more than a few pieces of it, however much of the reply
is still unsent; and its logprobs (most of it) are encoded as the pieces go, so the reply's own rendering holds a
fraction of it. Before: the whole body was rendered (the JSON of an object per token) and sent as one ASGI message,
which the transport copied whole into its buffer and held until the reader was cut off."""

from __future__ import annotations

import asyncio
import json
import socket
import tracemalloc

import pytest
from transformers import AutoTokenizer

from fleetrl.gateway.session_app import REPLY_CHUNK_BYTES
from fleetrl.gateway.session_limits import SessionLimits
from fleetrl.gateway.session_server import SessionServer, TokenLogprobs
from fleetrl.openai_chat import token_logprobs
from tests.unit.gateway.test_session_abuse import still_serves
from tests.unit.gateway.test_session_server import ScriptedSampler
from tests.waiting import async_wait_until

LONG_REPLY = "ab " * 60_000  # 120,000 tokens of the tiny model's tokenizer
# The transport may hold what it had before it paused (up to its 64 KiB high-water mark) plus one piece.
UNSENT_BOUND = 64 * 1024 + 2 * REPLY_CHUNK_BYTES


@pytest.fixture
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def writer_settled(server: SessionServer) -> bool:
    """The server's one connection writes no more for now: its reply is whole in the transport, or its writer is
    paused by flow control (uvicorn's protocol state: what the test waits on, not what it asserts)."""
    (protocol,) = server._server.server_state.connections
    cycle = protocol.cycle
    return cycle is not None and (cycle.response_complete or protocol.flow.write_paused)


async def send_request(server: SessionServer, session, stream: bool) -> socket.socket:
    """A client with a 4 KiB receive buffer that sends one call asking for logprobs and then reads nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", server.port))
    ask = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "stream": stream}
    body = json.dumps(ask).encode()
    path = session.base_url.split(str(server.port), 1)[1]
    request = (
        f"POST {path}/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {session.api_key}\r\n"
        f"Connection: close\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    await loop.sock_sendall(sock, request)
    return sock


def dechunked(payload: bytes) -> bytes:
    """The body of a reply sent with Transfer-Encoding: chunked (a stream's)."""
    body = bytearray()
    while True:
        size_line, _, payload = payload.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return bytes(body)
        body += payload[:size]
        payload = payload[size + 2 :]


async def read_reply(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (it does once the reply is sent: Connection: close)."""
    loop, got = asyncio.get_running_loop(), bytearray()
    while True:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 60)
        if not chunk:
            return bytes(got)
        got += chunk


@pytest.mark.parametrize("stream", [False, True])
async def test_a_reader_that_takes_none_of_a_long_reply_leaves_little_of_it_in_the_transport(tokenizer, stream):
    """Before: ~8 MB sat in the connection's transport buffer (the whole unsent reply); now at most a few pieces.
    Read afterwards, the reply is whole and exact."""
    sampler = ScriptedSampler(tokenizer, [LONG_REPLY])
    limits = SessionLimits(stall_timeout_s=300)  # the stall limit stays out of this test
    server = SessionServer(sampler, tokenizer, sample_kwargs={"max_tokens": 10**6}, limits=limits)
    session = await server.open()
    sock = None
    try:
        sock = await send_request(server, session, stream)
        await async_wait_until(lambda: len(session.turns) == 1, 60, "the call answered")
        await async_wait_until(lambda: server.connections() == 1 and writer_settled(server), 60, "the writer settled")
        unsent = server.unsent_bytes()
        assert 0 < unsent <= UNSENT_BOUND, f"{unsent} bytes of the reply in the transport (bound {UNSENT_BOUND})"

        # The reader comes back: the reply arrives whole (the pieces in order, nothing lost or repeated).
        raw = await read_reply(sock)
        head, _, payload = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        generated = session.turns[0].completion_token_ids
        text = dechunked(payload).decode()
        if stream:
            events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
            (last,) = [e for e in events if e["choices"] and e["choices"][0].get("finish_reason")]
            assert last["choices"][0]["token_ids"] == generated
            logprobs = next(e["choices"][0]["logprobs"] for e in events if e["choices"][0].get("logprobs"))
        else:
            (choice,) = json.loads(text)["choices"]
            assert choice["token_ids"] == generated
            logprobs = choice["logprobs"]
        assert logprobs == token_logprobs(tokenizer, generated, session.turns[0].logprobs)
        assert len(logprobs["content"]) == len(generated) > 100_000
        await async_wait_until(lambda: server.connections() == 0, 30, "the connection closed")
        assert server.unsent_bytes() == 0
        await still_serves(server)
    finally:
        if sock is not None:
            sock.close()
        await server.close()


def test_deferred_logprobs_encode_as_the_eager_object_does(tokenizer):
    """The pieces of `TokenLogprobs` make the JSON of `token_logprobs` (multi-byte characters split across tokens,
    a piece boundary inside the reply, no tokens at all)."""
    ids = tokenizer.encode("héllo wörld, 你好 " * 50, add_special_tokens=False)
    logprobs = [-0.01 * (i + 1) for i in range(len(ids))]
    for n in (len(ids), 7, 0):
        lazy = TokenLogprobs(tokenizer, ids[:n], logprobs[:n])
        assert json.loads("".join(lazy.json_pieces(tokens_per_piece=16))) == token_logprobs(
            tokenizer, ids[:n], logprobs[:n]
        )


# Where a reply's rendering and sending allocate (tracemalloc's innermost frame): the JSON encoder, the chat format
# (the per-token logprob objects, the stream's events), Starlette's responses, the session routes, uvicorn, and the
# transport's buffer.
SENDING_FILES = (
    "json/",
    "starlette/",
    "fleetrl/gateway/session_app.py",
    "fleetrl/openai_chat.py",
    "uvicorn/",
    "asyncio/",
)


@pytest.mark.parametrize("stream", [False, True])
async def test_what_a_reader_that_takes_none_of_a_long_reply_makes_the_server_hold(tokenizer, stream):
    """Memory the reply's rendering and sending hold (traced by tracemalloc) while a reader takes none of an ~8 MB
    reply: under a quarter of it. Before: the whole JSON (in the response or in the transport's buffer)."""
    sampler = ScriptedSampler(tokenizer, [LONG_REPLY])
    limits = SessionLimits(stall_timeout_s=300)
    server = SessionServer(sampler, tokenizer, sample_kwargs={"max_tokens": 10**6}, limits=limits)
    session = await server.open()
    sock = None
    tracemalloc.start(1)
    try:
        sock = await send_request(server, session, stream)
        await async_wait_until(lambda: len(session.turns) == 1, 60, "the call answered")
        await async_wait_until(lambda: server.connections() == 1 and writer_settled(server), 60, "the writer settled")
        snapshot = tracemalloc.take_snapshot()
        tracemalloc.stop()
        held = sum(t.size for t in snapshot.traces if any(f in t.traceback[0].filename for f in SENDING_FILES))
        reply_bytes = len(session.turns[0].completion_token_ids) * 65  # ~65 bytes of JSON per token's logprob
        assert reply_bytes > 7_000_000
        assert held < reply_bytes / 4, f"{held} bytes held for a reply of ~{reply_bytes}"
    finally:
        tracemalloc.stop()
        if sock is not None:
            sock.close()
        await server.close()
