"""The cyclic garbage agent sessions leave behind is collected while sessions go on (issue 45, item 8/9): an agent's
`openai.AsyncOpenAI` client per session, once used, is a reference cycle holding an SSL context (native memory), so
it lived until Python's next full collection, minutes apart in a gateway (the soak's sawtooth). Real uvicorn, the
real `openai` client, a scripted sampler; the process's own full collections are turned off here, as they are
effectively off between those minutes-apart collections in a gateway."""

from __future__ import annotations

import gc
import weakref

import openai
import pytest
from transformers import AutoTokenizer

from fleetrl.gateway.session_limits import SessionLimits
from fleetrl.gateway.session_server import GARBAGE_INTERVAL_S, SessionServer
from fleetrl.shell.heap import CyclicGarbage
from tests.unit.gateway.test_session_abuse import ASK, Clock
from tests.unit.gateway.test_session_server import ScriptedSampler

SESSIONS = 12


@pytest.fixture
def no_automatic_gc():
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


async def test_the_agents_clients_of_finished_sessions_are_freed_while_sessions_go_on(tiny_model_dir, no_automatic_gc):
    """Before: every client stayed alive (SESSIONS of SESSIONS) until a full collection came."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    clock = Clock()
    sampler = ScriptedSampler(tokenizer, ["ok"] * (SESSIONS + 1))
    server = SessionServer(sampler, tokenizer, limits=SessionLimits(idle_timeout_s=0), clock=clock)
    clients: list[weakref.ref[openai.AsyncOpenAI]] = []
    try:
        for _ in range(SESSIONS):
            session = await server.open()
            async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as c:
                await c.chat.completions.create(**ASK)
            clients.append(weakref.ref(c))
            del c
            clock.now += GARBAGE_INTERVAL_S / 4
        # A cycle indeed: nothing but a collection frees them (the server's own is due only now).
        assert sum(ref() is not None for ref in clients[-3:]) == 3
        clock.now += GARBAGE_INTERVAL_S
        await server.open()  # the next session: its open collects what the finished ones left
        alive = sum(ref() is not None for ref in clients)
        assert alive == 0, f"{alive} of {SESSIONS} agents' clients still alive"
        assert server.garbage.collections >= 3  # every GARBAGE_INTERVAL_S while sessions opened, not once
    finally:
        await server.close()


def test_a_collection_runs_only_when_work_was_noted_and_the_interval_passed():
    clock, runs = Clock(), []
    garbage = CyclicGarbage(10.0, clock, collect=lambda: runs.append(clock.now) or 5)
    clock.now += 60
    assert not garbage.collect_if_due()  # nothing noted: nothing to collect
    garbage.note()
    assert garbage.collect_if_due() and runs == [clock.now]
    garbage.note()
    clock.now += 9.9
    assert not garbage.collect_if_due()  # too soon
    clock.now += 0.1
    assert garbage.collect_if_due()
    assert (garbage.collections, garbage.freed) == (2, 10)
    with pytest.raises(ValueError, match="interval_s"):
        CyclicGarbage(0)
