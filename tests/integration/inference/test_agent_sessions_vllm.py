"""Agent sessions on the vLLM engine: an `openai`-client agent's calls through the session server reach the shared
vLLM engine over gRPC, and every recorded call's logprobs are the engine's processed logprobs of exactly the tokens
it generated (a transformers recompute), so the trained tokens are what vLLM generated."""

from __future__ import annotations

import openai
import pytest

pytest.importorskip("vllm")

from transformers import AutoTokenizer

from fleetrl.gateway.sampler import Sampler
from fleetrl.gateway.session_server import SessionServer
from tests.integration.inference import conformance
from tests.integration.inference.agent_loop import chat_agent
from tests.integration.inference.conftest import VLLM_TEST_MARKS
from tests.integration.inference.served import serve

pytestmark = VLLM_TEST_MARKS


async def test_an_openai_agent_on_vllm_is_recorded_as_generated(vllm_engine, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    async with serve(vllm_engine, tiny_model_dir, model="tiny", token="tok", relay_port=None) as service:
        sampler = Sampler(tokenizer, auth_token="tok")
        sampler.set_replicas([f"127.0.0.1:{service.grpc_port}"])
        sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 8}
        server = SessionServer(sampler, tokenizer, sample_kwargs=sampling, max_seq_len=1024)
        session = await server.open()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        try:
            await chat_agent(client, session.model, "What is 1 + 2?", turns=2, stream=True)
        finally:
            await client.close()
            await server.close()
            await sampler.close()
    version = vllm_engine.loaded_version
    reference = conformance.load_reference(tiny_model_dir)
    assert len(session.turns) == 2
    for turn in session.turns:
        assert turn.versions == [version] * len(turn.completion_token_ids)
        ref = conformance.reference_logprobs(reference, turn.prompt_token_ids, turn.completion_token_ids, 1.0, 0, 1.0)
        assert max(abs(a - b) for a, b in zip(turn.logprobs, ref, strict=True)) < conformance.LOGPROB_TOL
    samples = session.to_rollout_run(reward=0.0).to_samples()
    trained = [(t, lp) for s in samples for t, lp, m in zip(s.tokens, s.logprobs, s.loss_mask, strict=True) if m]
    turns = session.turns
    generated = [(t, lp) for turn in turns for t, lp in zip(turn.completion_token_ids, turn.logprobs, strict=True)]
    assert trained == generated
