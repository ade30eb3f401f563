"""LoRA adapter versions, checked the same way on every engine (test_hf_lora.py, test_vllm_lora.py).

Adapters are made with real PEFT on the session's tiny model, the way a LoRA trainer publishes them:
`get_peft_model`, lora_B randomised (PEFT initialises it to zero, a no-op adapter), then
`get_peft_model_state_dict` published with the adapter config (the JSON PEFT writes as adapter_config.json).
The trainer-side reference is that PEFT model's forward through `fleetrl.trainer.model.sequence_logprobs`.

Each check leaves the engine serving the model directory's own weights (a full-weight version published at the
end, which also drops the adapter), so checks can share one engine in any order.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fleetrl.clients.inference_types import SamplingRequest, WeightLoadError
from fleetrl.services.inference.engine import InferenceEngine
from fleetrl.trainer.model import sequence_logprobs
from fleetrl.weights import WeightPublisher
from tests.integration.inference.conformance import LOGPROB_TOL, load_reference

PROMPT = [11, 12, 13, 14, 15]


@dataclass
class Adapter:
    """A PEFT LoRA model on the tiny base, its published tensors and its adapter config."""

    model: Any  # peft.PeftModel, eval mode, float32
    state: dict[str, torch.Tensor]
    config: dict[str, Any]


def make_adapter(model_dir: str, *, seed: int, r: int = 8, target_modules: Any = "all-linear") -> Adapter:
    """A LoRA adapter on the base in `model_dir` whose lora_B is random (so it changes the outputs)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    base = load_reference(model_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # lora_A's init
        model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=target_modules))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    model.eval()
    state = {name: t.detach().clone() for name, t in get_peft_model_state_dict(model).items()}
    with tempfile.TemporaryDirectory() as tmp:  # the config exactly as PEFT writes it
        model.save_pretrained(tmp)
        config = json.loads((Path(tmp) / "adapter_config.json").read_text())
    return Adapter(model, state, config)


def trainer_logprobs(adapter: Adapter, prompt: list[int], completion: list[int]) -> list[float]:
    """Per-token logprobs of `completion` under the PEFT model, as the trainer computes them."""
    (logprobs,) = sequence_logprobs(adapter.model, [prompt + completion])
    return logprobs[len(prompt) - 1 :]


def max_logprob_diff(adapter: Adapter, request: SamplingRequest, completions: list) -> float:
    worst = 0.0
    for c in completions:
        ref = trainer_logprobs(adapter, request.prompt_token_ids, c.token_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(c.logprobs, ref, strict=True)))
    return worst


async def publish_and_load(engine: InferenceEngine, publisher: WeightPublisher, version: int, adapter: Adapter):
    """Publish `adapter` as `version` (as a LoRA trainer does) and load it; returns (LoadResult, Manifest)."""
    manifest = publisher.publish(version, adapter.state, adapter=adapter.config)
    return await engine.load_weights(version, publisher.address, timeout_s=60), manifest


async def restore_base(engine: InferenceEngine, model_dir: str) -> None:
    """Serve the model directory's own weights again (a full-weight version, newer than any loaded)."""
    with WeightPublisher() as publisher:
        version = engine.loaded_version + 1
        publisher.publish(version, load_reference(model_dir).state_dict())
        await engine.load_weights(version, publisher.address, timeout_s=60)


async def check_adapter_changes_generation_and_matches_trainer(engine: InferenceEngine, model_dir: str) -> float:
    """An adapter version changes generation; the sampled tokens' logprobs equal the PEFT model's (float32).

    Returns the largest |sampler - trainer| logprob difference."""
    adapter = make_adapter(model_dir, seed=1)
    greedy = SamplingRequest(PROMPT, n=1, max_tokens=16, temperature=0.0)
    sampled = SamplingRequest(PROMPT, n=3, max_tokens=24, seed=5)
    (before,) = await engine.generate(greedy)
    with WeightPublisher() as publisher:
        version = engine.loaded_version + 1
        result, manifest = await publish_and_load(engine, publisher, version, adapter)
        assert manifest.is_adapter
        assert result.version == version == engine.loaded_version
        assert result.checksum == manifest.checksum == engine.loaded_checksum
        (after,) = await engine.generate(greedy)
        completions = await engine.generate(sampled)
    assert after.token_ids != before.token_ids, "the adapter did not change greedy generation"
    assert after.versions == [version] * len(after.token_ids)
    assert all(c.versions == [version] * len(c.token_ids) for c in completions)
    worst = max_logprob_diff(adapter, sampled, completions)
    assert worst < LOGPROB_TOL, f"sampler vs trainer (PEFT) logprobs differ by {worst}"
    await restore_base(engine, model_dir)
    (again,) = await engine.generate(greedy)
    assert again.token_ids == before.token_ids, "restoring the base weights did not undo the adapter"
    return worst


async def check_second_adapter_applies_to_the_base(engine: InferenceEngine, model_dir: str) -> None:
    """v2's adapter replaces v1's (on the base weights), it is not stacked on top: logprobs equal a PEFT model
    of the base + v2 only, including layers v1 adapted and v2 does not."""
    first = make_adapter(model_dir, seed=2)
    second = make_adapter(model_dir, seed=3, target_modules=["q_proj", "v_proj", "up_proj"])
    request = SamplingRequest(PROMPT, n=2, max_tokens=24, seed=9)
    with WeightPublisher() as publisher:
        v1 = engine.loaded_version + 1
        await publish_and_load(engine, publisher, v1, first)
        await publish_and_load(engine, publisher, v1 + 1, second)
        completions = await engine.generate(request)
    assert all(c.versions == [v1 + 1] * len(c.token_ids) for c in completions)
    worst = max_logprob_diff(second, request, completions)
    assert worst < LOGPROB_TOL, f"v2 is not base + v2's adapter (max |diff| {worst})"
    await restore_base(engine, model_dir)


def _renamed(adapter: Adapter, old: str, new: str) -> dict[str, torch.Tensor]:
    return {name.replace(old, new): t for name, t in adapter.state.items()}


async def check_bad_adapters_refused(engine: InferenceEngine, model_dir: str, max_rank: int) -> None:
    """An unknown target module, a rank above the engine's max and a wrong shape are refused with a clear
    error; the version loaded before keeps serving, unchanged."""
    good = make_adapter(model_dir, seed=4)
    request = SamplingRequest(PROMPT, n=2, max_tokens=12, seed=3)
    with WeightPublisher() as publisher:
        version = engine.loaded_version + 1
        await publish_and_load(engine, publisher, version, good)
        before = await engine.generate(request)
        too_big = make_adapter(model_dir, seed=5, r=2 * max_rank)
        first_a = next(name for name in good.state if "lora_A" in name)
        cases = [
            ("foo_proj", _renamed(good, "q_proj", "foo_proj"), {**good.config, "target_modules": ["foo_proj"]}),
            (f"exceeds this replica's --max-lora-rank {max_rank}", too_big.state, too_big.config),
            ("shape", {**good.state, first_a: torch.zeros(3, 5)}, good.config),
        ]
        for i, (expected, state, config) in enumerate(cases, start=1):
            publisher.publish(version + i, state, adapter=config)
            try:
                await engine.load_weights(version + i, publisher.address, timeout_s=60)
            except WeightLoadError as exc:
                assert expected in str(exc), f"unclear error for a bad adapter ({expected}): {exc}"
            else:
                raise AssertionError(f"a bad adapter ({expected}) was loaded")
            assert engine.loaded_version == version
        after = await engine.generate(request)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]
    assert all(c.versions == [version] * len(c.token_ids) for c in after)
    assert max_logprob_diff(good, request, after) < LOGPROB_TOL
    await restore_base(engine, model_dir)


async def wait_for(predicate, timeout_s: float, what: str) -> None:
    """Poll `predicate` (async) until true; AssertionError naming `what` after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)
