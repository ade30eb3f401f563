"""The KV cache across a full-weight swap on vLLM (VLLMEngine.kv_on_swap, docs/inference.md "The KV cache across a
swap").

- "keep": a sequence spanning a swap keeps its KV. Its per-token versions are exact (the weights that sampled each
  token) and its logprobs are those it was sampled from: the old weights' forward before the swap, after it the new
  weights' forward over the context whose KV the old weights computed (an HF forward with that cache reproduces
  them). They are NOT a forward of the new weights over the same prefix: the test measures by how much.
- No request started after a swap reuses prefix-cache blocks the old weights computed (the version is the
  request's cache_salt); without that, "keep" would serve a new request old-weight KV for its prompt.

Uses the session's shared vLLM engine (conftest.py) and leaves it serving the model's own weights, kv_on_swap
as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import pytest

pytest.importorskip("vllm")

import torch

from fleetrl.clients.inference_types import SamplingRequest
from fleetrl.weights import WeightPublisher
from tests.integration.inference import conformance
from tests.integration.inference.conftest import VLLM_TEST_MARKS

pytestmark = VLLM_TEST_MARKS


@contextlib.contextmanager
def _kv_on_swap(engine, mode: str):
    before = engine.kv_on_swap
    engine.kv_on_swap = mode
    try:
        yield
    finally:
        engine.kv_on_swap = before


async def _load(engine, state) -> int:
    with WeightPublisher() as publisher:
        version = engine.loaded_version + 1
        publisher.publish(version, state)
        await engine.load_weights(version, publisher.address, timeout_s=60)
    return version


def kept_kv_logprobs(old_model, new_model, ids: list[int], prompt_len: int, kv_old: int) -> list[float]:
    """Logprobs (temperature 1) of ids[prompt_len:] when the KV of ids[:kv_old] comes from `old_model` and every
    later position is computed by `new_model` attending to it: what a decode that keeps its cache across a swap
    computes."""
    x = torch.tensor([ids])
    with torch.no_grad():
        first = old_model(x[:, :kv_old], use_cache=True)
        rest = new_model(x[:, kv_old:], past_key_values=first.past_key_values)
    logits = torch.cat([first.logits, rest.logits], dim=1)[0, prompt_len - 1 : -1].float()
    return [float(row.log_softmax(-1)[t]) for row, t in zip(logits, ids[prompt_len:], strict=True)]


async def test_kept_kv_spanning_a_swap_has_exact_versions_and_the_logprobs_it_sampled(vllm_engine, tiny_model_dir):
    original = conformance.load_reference(tiny_model_dir).state_dict()
    new_state = conformance._perturbed(original, seed=11)
    old = vllm_engine.loaded_version
    request = SamplingRequest([11, 12, 13], n=2, max_tokens=600, ignore_eos=True, seed=21)
    with _kv_on_swap(vllm_engine, "keep"), WeightPublisher() as publisher:
        publisher.publish(old + 1, new_state)
        task = asyncio.create_task(vllm_engine.generate(request))
        try:
            await conformance.wait_generating(vllm_engine, task)
            assert not task.done(), "the completions finished before the swap; make them longer"
            await vllm_engine.load_weights(old + 1, publisher.address, timeout_s=60)
            completions = await asyncio.wait_for(task, 120)
        finally:
            task.cancel()
    old_model = conformance.load_reference(tiny_model_dir)
    new_model = conformance.load_reference(tiny_model_dir, new_state)
    prompt = request.prompt_token_ids
    fresh_worst = 0.0
    for c in completions:
        runs = [(v, len(list(g))) for v, g in itertools.groupby(c.versions)]
        assert [v for v, _ in runs] == [old, old + 1], f"versions per token: {runs}"
        first_new = runs[0][1]  # index of the first token the new weights sampled
        ids = list(prompt) + c.token_ids
        # The old weights computed the KV of every position the engine ran before the swap: the prompt and the
        # tokens before the last one they sampled (that one is fed to the first step after the swap).
        kept = kept_kv_logprobs(old_model, new_model, ids, len(prompt), len(prompt) + first_new - 1)
        diffs = [abs(g - r) for g, r in zip(c.logprobs, kept, strict=True)]
        assert max(diffs) < conformance.LOGPROB_TOL, (
            f"logprobs differ from the kept-KV forward: max |diff| {max(diffs)} at token "
            f"{diffs.index(max(diffs))} (first new-version token {first_new})"
        )
        # The tokens after the swap are not those of a fresh forward of the new weights over the same prefix.
        fresh = conformance.reference_logprobs(new_model, prompt, c.token_ids, 1.0, 0, 1.0)
        fresh_worst = max(
            fresh_worst, *(abs(g - r) for g, r in zip(c.logprobs[first_new:], fresh[first_new:], strict=True))
        )
    print(f"kept KV: worst |logprob - fresh new-weights forward| after the swap: {fresh_worst:.4f}")
    assert fresh_worst > conformance.LOGPROB_TOL  # the KV was kept: nothing recomputed the context
    await _load(vllm_engine, original)


@pytest.mark.parametrize("mode", ["keep", "recompute"])
async def test_no_request_after_a_swap_reuses_old_version_prefix_blocks(vllm_engine, tiny_model_dir, mode):
    """A prompt served (and so prefix-cached) on the old weights, asked again after a swap with nothing in
    flight: its logprobs are those of the new weights (its prompt KV recomputed, not served from the cache)."""
    original = conformance.load_reference(tiny_model_dir).state_dict()
    new_state = conformance._perturbed(original, seed=13)
    prompt = [(7 * i) % 500 + 3 for i in range(300)]  # several full KV blocks
    request = SamplingRequest(prompt, n=1, max_tokens=8, ignore_eos=True, seed=3)
    with _kv_on_swap(vllm_engine, mode):
        await vllm_engine.generate(request)  # the prompt's blocks are now cached, computed by the old weights
        version = await _load(vllm_engine, new_state)
        completions = await vllm_engine.generate(request)
    assert all(c.versions == [version] * len(c.token_ids) for c in completions)
    worst = conformance.assert_logprobs_match(
        conformance.load_reference(tiny_model_dir, new_state), request, completions
    )
    assert worst < conformance.LOGPROB_TOL
    await _load(vllm_engine, original)


async def test_kv_on_swap_is_checked(tiny_model_dir):
    from fleetrl.services.inference.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match="kv_on_swap"):
        VLLMEngine(tiny_model_dir, kv_on_swap="clear")
