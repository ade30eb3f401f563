"""LoRA adapter versions on the vLLM engine: the shared checks (lora_checks.py) plus what only vLLM does,
each version a new LoRA adapter that requests keep from start to end, the old one removed once unused.

Uses the session's shared vLLM engine (conftest.py, LoRA enabled) and leaves it serving the model's own weights.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("peft")

from fleetrl.clients.inference_types import SamplingRequest
from fleetrl.weights import WeightPublisher
from tests.integration.inference import lora_checks
from tests.integration.inference.conformance import LOGPROB_TOL
from tests.integration.inference.conftest import VLLM_MAX_LORA_RANK, VLLM_TEST_MARKS

pytestmark = VLLM_TEST_MARKS


async def test_adapter_changes_generation_and_logprobs_match_the_trainer(vllm_engine, tiny_model_dir):
    worst = await lora_checks.check_adapter_changes_generation_and_matches_trainer(vllm_engine, tiny_model_dir)
    assert worst < LOGPROB_TOL


async def test_second_adapter_applies_to_the_base_not_on_top(vllm_engine, tiny_model_dir):
    await lora_checks.check_second_adapter_applies_to_the_base(vllm_engine, tiny_model_dir)


async def test_bad_adapters_are_refused_and_the_old_version_serves(vllm_engine, tiny_model_dir):
    await lora_checks.check_bad_adapters_refused(vllm_engine, tiny_model_dir, VLLM_MAX_LORA_RANK)


async def test_a_request_keeps_its_adapter_across_a_swap_and_the_old_one_goes_once_unused(vllm_engine, tiny_model_dir):
    first = lora_checks.make_adapter(tiny_model_dir, seed=21)
    second = lora_checks.make_adapter(tiny_model_dir, seed=22)
    long = SamplingRequest(lora_checks.PROMPT, n=2, max_tokens=600, ignore_eos=True, seed=4)
    short = SamplingRequest(lora_checks.PROMPT, n=2, max_tokens=16, seed=5)
    with WeightPublisher() as publisher:
        v1 = vllm_engine.loaded_version + 1
        await lora_checks.publish_and_load(vllm_engine, publisher, v1, first)
        old = vllm_engine.adapter
        in_flight = asyncio.create_task(vllm_engine.generate(long))
        try:
            result, _ = await lora_checks.publish_and_load(vllm_engine, publisher, v1 + 1, second)
            assert not in_flight.done(), "the long request finished before the swap; make it longer"
            assert result.pause_s == 0.0  # an adapter swap never pauses generation
            after = await vllm_engine.generate(short)  # runs beside the in-flight request
            assert old.path.is_dir(), "the old adapter was removed while a request still used it"
            spanning = await asyncio.wait_for(in_flight, 300)
        finally:
            in_flight.cancel()
    assert all(c.versions == [v1] * 600 for c in spanning)
    assert lora_checks.max_logprob_diff(first, long, spanning) < LOGPROB_TOL
    assert all(c.versions == [v1 + 1] * len(c.token_ids) for c in after)
    assert lora_checks.max_logprob_diff(second, short, after) < LOGPROB_TOL
    # Once the last request using it is done, v1's adapter is gone from vLLM and from disk.
    assert not Path(old.path).exists()
    assert set(await vllm_engine._llm.list_loras()) == {vllm_engine.adapter.request.lora_int_id}
    await lora_checks.restore_base(vllm_engine, tiny_model_dir)
    assert set(await vllm_engine._llm.list_loras()) == set()
