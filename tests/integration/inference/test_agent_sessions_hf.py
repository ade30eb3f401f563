"""Agent sessions (fleetrl.gateway.session_server) against real hf replicas over gRPC, driven by the official
`openai` client: every call's prompt and completion ids, logprobs and versions are what the replica generated (the
logprobs exact against a transformers recompute), the trained tokens are those, and a session keeps to one replica
until that replica is fenced."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from fleetrl.gateway.sampler import Sampler
from fleetrl.gateway.session_server import SessionServer
from fleetrl.openai_chat import render_chat_prompt
from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.server import create_server, make_engine
from tests.integration.inference import conformance
from tests.integration.inference.agent_loop import TOOLS, chat_agent

pytestmark = pytest.mark.integration
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 8}


async def start_replica(model_dir: str):
    config = InferenceConfig(model=model_dir, engine="hf", grpc_port=0, http_port=None, metrics_port=None)
    engine = make_engine(config)
    service = create_server(config, engine)
    await service.start()
    return service, engine


@pytest.mark.parametrize("stream", [False, True])
async def test_an_openai_agents_calls_are_recorded_as_the_replica_generated_them(tiny_model_dir, stream):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    service, _ = await start_replica(tiny_model_dir)
    sampler = Sampler(tokenizer)
    sampler.set_replicas([f"127.0.0.1:{service.grpc_port}"])
    server = SessionServer(sampler, tokenizer, sample_kwargs=SAMPLING, max_seq_len=1024)
    session = await server.open()
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    try:
        messages = await chat_agent(client, session.model, "What is 1 + 2?", turns=3, stream=stream)
    finally:
        await client.close()
        await server.close()
        await sampler.close()
        await service.stop()
    assert len(session.turns) == 3
    reference = conformance.load_reference(tiny_model_dir)
    for i, turn in enumerate(session.turns):
        assert turn.versions == [0] * len(turn.completion_token_ids)
        ref = conformance.reference_logprobs(reference, turn.prompt_token_ids, turn.completion_token_ids, 1.0, 0, 1.0)
        assert max(abs(a - b) for a, b in zip(turn.logprobs, ref, strict=True)) < conformance.LOGPROB_TOL, i
    # The first call's prompt is the template's rendering of the question with the tools.
    assert session.turns[0].prompt_token_ids == render_chat_prompt(tokenizer, messages[:1], tools=TOOLS)
    samples = session.to_rollout_run(reward=1.0).to_samples()
    trained = [(t, lp) for s in samples for t, lp, m in zip(s.tokens, s.logprobs, s.loss_mask, strict=True) if m]
    turns = session.turns
    generated = [(t, lp) for turn in turns for t, lp in zip(turn.completion_token_ids, turn.logprobs, strict=True)]
    assert trained == generated
    assert samples[0].metrics["session_splits"] == float(len(samples) - 1)
    for s in samples:
        s.validate()


async def test_a_session_keeps_to_one_replica_and_moves_only_when_it_is_fenced(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    (a, engine_a), (b, engine_b) = [await start_replica(tiny_model_dir) for _ in range(2)]
    addresses = {f"127.0.0.1:{a.grpc_port}": engine_a, f"127.0.0.1:{b.grpc_port}": engine_b}
    sampler = Sampler(tokenizer)
    sampler.set_replicas(list(addresses))
    server = SessionServer(sampler, tokenizer, sample_kwargs=SAMPLING)
    sessions = [await server.open() for _ in range(4)]
    clients = [openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0) for s in sessions]

    async def call(k: int) -> None:
        await clients[k].chat.completions.create(
            model="policy", messages=[{"role": "user", "content": f"hi {k}"}], max_tokens=2
        )

    try:
        for k in range(4):
            await call(k)
        pinned = {k: sampler._affinity[s.session_id] for k, s in enumerate(sessions)}
        before = {address: engine.stats().requests for address, engine in addresses.items()}
        for _ in range(3):
            for k in range(4):
                await call(k)
        after = {address: engine.stats().requests for address, engine in addresses.items()}
        expected = {address: 3 * sum(1 for p in pinned.values() if p == address) for address in addresses}
        assert {address: after[address] - before[address] for address in addresses} == expected
        fenced = pinned[0]
        (other,) = [address for address in addresses if address != fenced]
        sampler.set_replicas([other])  # the controller fenced session 0's replica
        before = addresses[other].stats().requests
        await call(0)
        assert addresses[other].stats().requests == before + 1
        assert sampler._affinity[sessions[0].session_id] == other
        assert len(sessions[0].turns) == 5
    finally:
        for c in clients:
            await c.close()
        await server.close()
        await sampler.close()
        await a.stop()
        await b.stop()
