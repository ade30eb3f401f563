"""The agent session server under load and abuse (issue 45, item 8), over real sockets and uvicorn with the real
`openai` client and a scripted sampler: wrong or missing keys, bodies over the limit or that stop arriving, idle
and garbage connections, a connection flood past the limit, a reader that takes none of its reply, idle sessions
expiring (an injected clock), many streaming clients at once, and a long chat template that must not stall the
event loop. After each, the server still answers."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from fleetrl.gateway.session_limits import SessionLimits, SessionRegistry
from fleetrl.gateway.session_server import SessionServer
from tests.unit.gateway.test_session_server import ScriptedSampler
from tests.waiting import async_wait_until

ASK = {"model": "policy", "messages": [{"role": "user", "content": "x"}]}


@pytest.fixture
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def still_serves(server: SessionServer) -> None:
    """A fresh session's call is answered (the server survived whatever came before)."""
    server.sampler.replies.append("fine")
    session = await server.open()
    async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as client:
        reply = await client.chat.completions.create(**ASK)
    assert reply.choices[0].message.content == "fine"


async def closed_by_server(reader: asyncio.StreamReader, timeout_s: float = 30.0) -> bytes:
    """Everything the server sent before it closed the connection (EOF or reset); fails past `timeout_s`."""
    got = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), timeout_s):
            got += chunk
    except ConnectionResetError:
        pass
    return got


async def test_a_wrong_or_missing_key_is_refused_before_the_session_is_looked_up(tokenizer):
    """Before: an unknown session answered 404 'no open session <id>' to a caller with no key, so anyone could
    probe which sessions exist."""
    server = SessionServer(ScriptedSampler(tokenizer, []), tokenizer)
    session = await server.open()
    unknown = session.base_url.replace(session.session_id, "0" * 32)
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            for url in (session.base_url, unknown):
                for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": b"Basic \xff"}):
                    r = await http.post(f"{url}/chat/completions", json=ASK, headers=headers)
                    assert r.status_code == 401, (url, headers, r.text)
                    assert r.json()["error"]["type"] == "authentication_error"
            r = await http.post(
                f"{unknown}/chat/completions", json=ASK, headers={"authorization": f"Bearer {session.api_key}"}
            )
            assert r.status_code == 404 and "no open session" in r.json()["error"]["message"]
        assert server.stats["bad_keys"] == 6
        await still_serves(server)
    finally:
        await server.close()


async def test_a_body_over_the_limit_is_refused_unread_and_one_that_stops_arriving_gets_408(tokenizer):
    """Before: a body of any size was read whole and its messages rendered on the gateway's event loop (a 64 MiB
    one held it for minutes); a body that stopped arriving held its connection forever."""
    sampler = ScriptedSampler(tokenizer, [])
    limits = SessionLimits(max_body_bytes=64 * 1024, stall_timeout_s=0.5)
    server = SessionServer(sampler, tokenizer, limits=limits)
    session = await server.open()
    headers = {"authorization": f"Bearer {session.api_key}", "content-type": "application/json"}
    url = f"{session.base_url}/chat/completions"
    big = b'{"model": "policy", "messages": [{"role": "user", "content": "' + b"a" * (10 * 2**20) + b'"}]}'

    async def chunked():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 2**16):
            yield big[i : i + 2**16]

    try:
        async with httpx.AsyncClient(timeout=30) as http:
            for content in (big, chunked()):
                r = await http.post(url, content=content, headers=headers)
                assert r.status_code == 413, r.text
                assert "at most 65536 bytes (session_max_body_bytes)" in r.json()["error"]["message"]
            for garbage in (b"[" * 50_000, b"\xff\xfe", b"[1, 2]"):
                r = await http.post(url, content=garbage, headers=headers)
                assert r.status_code == 400, r.text
        assert sampler.calls == [] and server.stats["bodies_too_large"] == 2
        path = session.base_url.split(str(server.port), 1)[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        head = f"POST {path}/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {session.api_key}\r\n"
        writer.write(f'{head}Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{"model"'.encode())
        answer = await closed_by_server(reader)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408") and b"the body stopped arriving" in answer
        await still_serves(server)
    finally:
        await server.close()


async def test_idle_garbage_and_half_sent_connections_are_closed_and_their_descriptors_freed(tokenizer):
    """Before: a connection that sent nothing, or half a request line, stayed open for good (uvicorn has no
    timeout before the first request), so a flood of them used up the gateway's file descriptors."""
    server = SessionServer(ScriptedSampler(tokenizer, []), tokenizer, limits=SessionLimits(stall_timeout_s=0.5))
    await server.start()
    try:
        peers = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(20)]
        for k, (_, writer) in enumerate(peers):
            if k % 3 == 1:
                writer.write(b"POST /v1/chat/comple")  # half a request line, never finished
            elif k % 3 == 2:
                writer.write(b"\x00\xff\xfegarbage\r\n\r\n")  # not HTTP: uvicorn answers 400 and closes
        await async_wait_until(lambda: server.connections() == 20, 30, "20 connections accepted")
        for reader, writer in peers:
            await closed_by_server(reader)
            writer.close()
        await async_wait_until(lambda: server.connections() == 0, 30, "every connection closed by the server")
        assert server.stats["connections_stalled"] >= 13  # the silent and half-sent ones (garbage gets a 400)
        await still_serves(server)
    finally:
        await server.close()


async def test_connections_past_the_limit_are_closed_as_they_are_accepted(tokenizer):
    """Before: every connection was accepted and kept, up to the process's file descriptor limit (where the
    gateway's own gRPC and ZeroMQ sockets start failing too)."""
    limits = SessionLimits(max_connections=8, stall_timeout_s=300)
    server = SessionServer(ScriptedSampler(tokenizer, []), tokenizer, limits=limits)
    await server.start()
    try:
        held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(8)]
        await async_wait_until(lambda: server.connections() == 8, 30, "8 connections accepted")
        extra = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(5)]
        for reader, writer in extra:
            assert await closed_by_server(reader) == b""
            writer.close()
        assert server.stats["connections_refused"] == 5 and server.connections() == 8
        for _, writer in held:
            writer.close()
        await async_wait_until(lambda: server.connections() == 0, 30, "the held connections gone")
        await still_serves(server)
    finally:
        await server.close()


@pytest.mark.parametrize("stall_timeout_s", [0.5, 6.0])
async def test_a_reader_that_takes_none_of_its_reply_is_cut_off(tokenizer, stall_timeout_s):
    """A reply larger than the socket buffers (a long completion with logprobs) to a client that never reads, cut
    off by the stall limit whether it comes before or after uvicorn's 5 s keep-alive closes the connection gently.
    Before: the connection stayed for good, with its unsent reply: a gentle close waits for the unread bytes to
    drain, which they never do."""
    sampler = ScriptedSampler(tokenizer, ["ab " * 60_000])
    limits = SessionLimits(stall_timeout_s=stall_timeout_s)
    server = SessionServer(sampler, tokenizer, sample_kwargs={"max_tokens": 10**6}, limits=limits)
    session = await server.open()
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
        body = b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "logprobs": true}'
        path = session.base_url.split(str(server.port), 1)[1]
        request = (
            f"POST {path}/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {session.api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        await asyncio.get_running_loop().sock_sendall(sock, request)
        await async_wait_until(lambda: len(session.turns) == 1, 60, "the call answered")
        await async_wait_until(lambda: server.stats["connections_stalled"] == 1, 60, "the reader cut off")
        await async_wait_until(lambda: server.connections() == 0, 30, "its connection gone")
        sock.close()
        await still_serves(server)
    finally:
        await server.close()


async def test_idle_sessions_expire_and_one_with_a_call_in_flight_does_not(tokenizer):
    """Before: a session its rollout still held never expired, however long no call reached it."""
    clock = Clock()
    gate = asyncio.Event()

    class HeldSampler(ScriptedSampler):
        async def sample_with_prompt_tokens(self, prompt, n=1, **kwargs):
            if self.replies[0] == "slow":
                self.calls.append(("in flight", kwargs))
                await asyncio.wait_for(gate.wait(), 60)
                self.calls.pop()
            return await super().sample_with_prompt_tokens(prompt, n, **kwargs)

    sampler = HeldSampler(tokenizer, ["one", "slow"])
    server = SessionServer(sampler, tokenizer, limits=SessionLimits(idle_timeout_s=60), clock=clock)
    idle, busy = await server.open(), await server.open()
    abandoned = [await server.open() for _ in range(2000)]  # opened, never called, still held
    dropped = [(await server.open()).session_id for _ in range(2000)]  # opened, then let go by their rollout
    gc.collect()
    client = openai.AsyncOpenAI(base_url=idle.base_url, api_key=idle.api_key, max_retries=0)
    other = client.with_options(base_url=busy.base_url)
    try:
        clock.now += 50
        await client.chat.completions.create(**ASK)  # idle's last call: t = 1050
        slow = asyncio.create_task(other.chat.completions.create(**ASK))
        await async_wait_until(lambda: len(sampler.calls) == 2, 30, "busy's call in flight")
        clock.now += 70  # t = 1120: the abandoned sessions are 120 s idle, idle 70 s, busy is in a call
        server.sweep_if_due()
        assert server.stats["sessions_expired"] == 2001 and server.sessions.tracked() == 1
        assert idle.session_id not in server.sessions and busy.session_id in server.sessions
        with pytest.raises(
            openai.NotFoundError, match=r"expired: no call reached it for 60 s \(session_idle_timeout_s\)"
        ):
            await client.chat.completions.create(**ASK)
        assert all(server.sessions.get(s.session_id) is None for s in abandoned) and dropped[0] not in server.sessions
        gate.set()
        assert (await slow).choices[0].message.content == "slow"
        clock.now += 59
        assert server.sessions.sweep() == 0 and busy.session_id in server.sessions  # idle from the end of its call
        clock.now += 1
        assert server.sessions.sweep() == 1
        assert busy.session_id not in server.sessions and server.sessions.tracked() == 0
        assert idle.to_rollout_run(reward=1.0).segments[0].loss_mask.count(1) == len(idle.turns[0].completion_token_ids)
    finally:
        await client.close()
        await server.close()


def test_the_registry_never_expires_with_a_zero_limit_and_remembers_a_bounded_number_of_expired_ids():
    from fleetrl.agent_session import AgentSession

    clock = Clock()
    forever = SessionRegistry(0, clock)
    kept = [AgentSession(f"s{i}", "u", "k", "m") for i in range(3)]
    for s in kept:
        forever.add(s)
    clock.now += 1e9
    assert forever.sweep() == 0 and len(forever) == 3
    registry = SessionRegistry(1, clock)
    many = [AgentSession(f"t{i}", "u", "k", "m") for i in range(5000)]
    for s in many:
        registry.add(s)
    clock.now += 1
    assert registry.sweep() == 5000 and registry.tracked() == 0 and len(registry._expired) == 4096
    assert "expired" in registry.why_missing("t4999") and registry.why_missing("t0") == "no open session t0"
    with pytest.raises(ValueError, match="idle_timeout_s: must be a finite number >= 0"):
        SessionLimits(idle_timeout_s=float("nan"))
    with pytest.raises(ValueError, match="max_connections: must be >= 1"):
        SessionLimits(max_connections=0)


async def test_many_streaming_clients_at_once_all_get_their_whole_reply(tokenizer):
    """60 agents streaming at once, each with its own client (200 in bench/agent_session_load.py): every stream
    is whole, and once the clients close the server holds no connection."""
    n = 60
    sampler = ScriptedSampler(tokenizer, [f"reply number {k}" for k in range(n)])
    server = SessionServer(sampler, tokenizer, limits=SessionLimits(max_connections=n + 4))
    sessions = [await server.open() for _ in range(n)]

    async def agent(session) -> str:
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as c:
            stream = await c.chat.completions.create(**ASK, stream=True, logprobs=True)
            return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    try:
        replies = await asyncio.gather(*(agent(s) for s in sessions))
        assert sorted(replies) == sorted(f"reply number {k}" for k in range(n))
        assert all(len(s.turns) == 1 for s in sessions)
        await async_wait_until(lambda: server.connections() == 0, 30, "every client's connection closed")
    finally:
        await server.close()


class BlockingTemplate:
    """A tokenizer whose chat template blocks (as a long prompt's rendering takes seconds) until released."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.started, self.release = tokenizer, threading.Event(), threading.Event()

    def apply_chat_template(self, *args, **kwargs):
        self.started.set()
        self.release.wait(30)
        return self.tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


async def test_a_long_chat_template_rendering_does_not_stall_the_event_loop(tokenizer):
    """Before: the template ran on the gateway's event loop, so while it rendered a long prompt (4.5 s per MiB on
    this machine) nothing else in the gateway ran: no other call, heartbeat or lease."""
    blocking = BlockingTemplate(tokenizer)
    server = SessionServer(ScriptedSampler(tokenizer, ["done"]), blocking)
    session = await server.open()
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    try:
        long_call = asyncio.create_task(client.chat.completions.create(**ASK))
        await asyncio.wait_for(asyncio.to_thread(blocking.started.wait, 30), 60)
        models = await asyncio.wait_for(client.models.list(), 60)  # answered while the template still renders
        assert [m.id for m in models.data] == ["policy"] and not long_call.done()
        blocking.release.set()
        assert (await long_call).choices[0].message.content == "done"
    finally:
        blocking.release.set()
        await client.close()
        await server.close()
