"""A LoRA run's replica on vLLM's own OpenAI serving layer (services/inference/vllm_openai.py): the served model
name maps to the newest adapter version, so requests run on the current policy with everything vLLM's layer
offers (streaming here), and a request keeps the adapter it started with across a swap.

Adapters are real PEFT adapters on the session's tiny model (lora_checks.py); the reference logprobs are the
PEFT model's forward, as the trainer computes them. Completions are asked for with token-id prompts and
`return_tokens_as_token_ids`, so the tokens compare exactly.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import pytest_asyncio

pytest.importorskip("vllm")


from fleetrl.services.inference.http_auth import VERSION_HEADER
from fleetrl.trainer.model import sequence_logprobs
from fleetrl.weights import WeightPublisher
from tests.integration.inference import lora_checks
from tests.integration.inference.conformance import LOGPROB_TOL, load_reference
from tests.integration.inference.conftest import VLLM_MAX_LORA_RANK, VLLM_TEST_MARKS
from tests.integration.inference.served import serve_with_client

pytestmark = VLLM_TEST_MARKS
TOKEN = "tok-openai-lora"
MODEL = "tiny-lora"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served(vllm_engine, tiny_model_dir):
    """The inference service of a LoRA run on the shared engine, and an openai client for it."""
    async with serve_with_client(
        vllm_engine, tiny_model_dir, model=MODEL, token=TOKEN, timeout_s=300, max_lora_rank=VLLM_MAX_LORA_RANK
    ) as served:
        yield served


def _params(max_tokens: int, seed: int) -> dict:
    return dict(
        model=MODEL,
        prompt=lora_checks.PROMPT,
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )


def _token_ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


async def _load_next(engine, publisher: WeightPublisher, adapter) -> tuple[int, object]:
    """Load `adapter` as the next version; returns the version and the engine's adapter record of it."""
    version = engine.loaded_version + 1
    await lora_checks.publish_and_load(engine, publisher, version, adapter)
    return version, engine.adapter


async def _removed(path: Path, what: str) -> None:
    async def gone() -> bool:
        return not Path(path).exists()

    await lora_checks.wait_for(gone, 60, what)


def _max_diff(reference: list[float], served: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(reference, served, strict=True))


async def test_requests_naming_the_model_run_on_the_newest_adapter_then_on_full_weights(served, tiny_model_dir):
    service, client = served
    engine = service.engine
    adapter = lora_checks.make_adapter(tiny_model_dir, seed=31)
    with WeightPublisher() as publisher:
        version = engine.loaded_version + 1
        await lora_checks.publish_and_load(engine, publisher, version, adapter)
        raw = await client.completions.with_raw_response.create(**_params(12, seed=3))
        # Seeded, and min_tokens = max_tokens: the stream carries six tokens, whatever the random tiny model would
        # sample first (unseeded, it sometimes ended at once, and the stream was only the role and finish chunks).
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            seed=5,
            stream=True,
            extra_body={"min_tokens": 6},
        )
        chunks = [chunk async for chunk in stream]
    reply = raw.parse()
    assert raw.headers[VERSION_HEADER] == str(version)
    assert reply.model == f"fleetrl-v{version}"  # vLLM names a response after the adapter that served it
    choice = reply.choices[0]
    tokens = _token_ids(choice.logprobs.tokens)
    reference = lora_checks.trainer_logprobs(adapter, lora_checks.PROMPT, tokens)
    assert _max_diff(reference, choice.logprobs.token_logprobs) < LOGPROB_TOL
    assert len(chunks) > 2 and {c.model for c in chunks} == {f"fleetrl-v{version}"}

    await lora_checks.restore_base(engine, tiny_model_dir)  # a full-weight version: no adapter any more
    base = (await client.completions.create(**_params(12, seed=3))).choices[0]
    assert (await client.completions.create(**_params(1, seed=3))).model == MODEL
    base_tokens = _token_ids(base.logprobs.tokens)
    (full,) = sequence_logprobs(load_reference(tiny_model_dir), [lora_checks.PROMPT + base_tokens])
    assert _max_diff(full[len(lora_checks.PROMPT) - 1 :], base.logprobs.token_logprobs) < LOGPROB_TOL


async def test_a_streaming_request_keeps_its_adapter_across_a_swap(served, tiny_model_dir):
    service, client = served
    engine = service.engine
    first, second = (lora_checks.make_adapter(tiny_model_dir, seed=seed) for seed in (32, 33))
    with WeightPublisher() as publisher:
        v1, old = await _load_next(engine, publisher, first)
        stream = await client.completions.create(stream=True, **_params(400, seed=4))
        tokens, logprobs = [], []
        async for chunk in stream:  # the request is generating on v1's adapter
            tokens += _token_ids(chunk.choices[0].logprobs.tokens)
            logprobs += chunk.choices[0].logprobs.token_logprobs
            if len(tokens) >= 4:
                break
        await lora_checks.publish_and_load(engine, publisher, v1 + 1, second)
        assert Path(old.path).is_dir(), "the old adapter was removed while an HTTP request still used it"
        async for chunk in stream:
            tokens += _token_ids(chunk.choices[0].logprobs.tokens)
            logprobs += chunk.choices[0].logprobs.token_logprobs
        after = await client.completions.create(**_params(8, seed=5))
    assert len(tokens) == 400
    reference = lora_checks.trainer_logprobs(first, lora_checks.PROMPT, tokens)
    assert _max_diff(reference, logprobs) < LOGPROB_TOL  # every token came from v1's adapter
    assert after.model == f"fleetrl-v{v1 + 1}"

    await _removed(old.path, "v1's adapter to be removed once its request ended")
    assert set(await engine.async_llm.list_loras()) == {engine.adapter.request.lora_int_id}
    await lora_checks.restore_base(engine, tiny_model_dir)


async def test_a_client_that_hangs_up_mid_stream_releases_its_hold(served, tiny_model_dir):
    service, _ = served
    engine = service.engine
    first, second = (lora_checks.make_adapter(tiny_model_dir, seed=seed) for seed in (34, 35))
    with WeightPublisher() as publisher:
        v1, old = await _load_next(engine, publisher, first)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        body = {**_params(1000, seed=6), "stream": True, "n": 16}
        body.update(body.pop("extra_body"))
        url = f"http://127.0.0.1:{service.http_port}/v1/completions"
        async with (
            httpx.AsyncClient(headers=auth, timeout=60) as http,
            http.stream("POST", url, json=body) as response,
        ):
            assert response.status_code == 200, await response.aread()
            lines = response.aiter_lines()
            while not (await anext(lines)).startswith("data:"):
                pass  # the request is generating on v1's adapter
            await lora_checks.publish_and_load(engine, publisher, v1 + 1, second)
            assert Path(old.path).is_dir()
        # The connection closes with ~16,000 tokens to go: vLLM aborts the request, and the hold must go with it
        # (a leaked hold would keep v1's adapter forever).

    await _removed(old.path, "v1's adapter to be removed once its client hung up")
    await lora_checks.restore_base(engine, tiny_model_dir)
