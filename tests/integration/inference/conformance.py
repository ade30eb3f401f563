"""The inference engine conformance suite, written once and run for every engine.

Each `check_*` is an async function taking a started engine and the model directory it serves; the engine's
test module (test_hf_conformance.py, test_vllm_conformance.py) wraps them in tests. Checks leave the engine
serving the model directory's weights (a weight-load check republishes them as a newer version at the end), so
they can share one engine in any order.

The reference for logprobs is an independent transformers forward in float32 of prompt + completion, with
temperature / top-k / top-p written out here the textbook way (sort descending, keep the top k, keep the
smallest prefix whose probability reaches p), not with the engines' code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fleetrl.clients.inference_types import SamplingRequest, WeightLoadError
from fleetrl.services.inference.engine import InferenceEngine
from fleetrl.weights import WeightPublisher

LOGPROB_TOL = 1e-3
PROMPTS = [[11, 12, 13, 14, 15], [40, 41], [100, 7, 250, 3, 8, 9, 10, 300, 301], [5]]


async def wait_generating(engine: InferenceEngine, task: asyncio.Task, timeout_s: float = 120) -> None:
    """Return once the engine has produced tokens for the request `task` runs (a progress condition, not a
    sleep): the request is in the engine (`queue_depth`), then a short request run beside it finishes. Both
    engines batch continuously, so every step that decodes the short request also decodes the long one."""
    async with asyncio.timeout(timeout_s):
        while engine.queue_depth() == 0:
            assert not task.done(), "the request finished (or failed) before it was seen in the engine"
            await asyncio.sleep(0.01)
        await engine.generate(SamplingRequest([5], max_tokens=4, ignore_eos=True, seed=0))


def load_reference(model_dir: str, state_dict: dict[str, torch.Tensor] | None = None):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


def reference_logprobs(
    model, prompt: list[int], completion: list[int], temperature: float, top_k: int, top_p: float
) -> list[float]:
    """Logprob of each completion token under the processed distribution, recomputed from scratch."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    out = []
    for logits_v, token in zip(logits, completion, strict=True):
        scaled = logits_v / temperature
        order = scaled.argsort(descending=True)
        kept = order if top_k <= 0 else order[:top_k]
        if top_p < 1.0:
            probs = scaled[kept].softmax(-1)
            before = probs.cumsum(-1) - probs  # mass strictly more likely than each token
            kept = kept[before < top_p]
        masked = torch.full_like(scaled, float("-inf"))
        masked[kept] = scaled[kept]
        out.append(float(masked.log_softmax(-1)[token]))
    return out


def assert_logprobs_match(model, request: SamplingRequest, completions) -> float:
    worst = 0.0
    for c in completions:
        ref = reference_logprobs(
            model,
            request.prompt_token_ids,
            c.token_ids,
            request.temperature,
            request.top_k,
            request.top_p,
        )
        for i, (got, want) in enumerate(zip(c.logprobs, ref, strict=True)):
            diff = abs(got - want)
            assert math.isfinite(want) and diff < LOGPROB_TOL, (
                f"token {i} ({c.token_ids[i]}): engine logprob {got} vs reference {want} "
                f"(temperature {request.temperature}, top_k {request.top_k}, top_p {request.top_p})"
            )
            worst = max(worst, diff)
    return worst


def assert_well_formed(request: SamplingRequest, completions) -> None:
    assert len(completions) == request.n
    for c in completions:
        assert c.prompt_len == len(request.prompt_token_ids)
        assert 1 <= len(c.token_ids) <= request.max_tokens
        assert len(c.logprobs) == len(c.token_ids) == len(c.versions)
        assert c.finish_reason in ("stop", "length")
        assert all(isinstance(x, float) and x <= 1e-6 for x in c.logprobs)


async def check_logprobs_exact(
    engine: InferenceEngine, model_dir: str, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> float:
    """Server logprobs == a float32 transformers recompute (< 1e-3 per sampled token)."""
    model = load_reference(model_dir)
    requests = [
        SamplingRequest(p, n=2, max_tokens=24, temperature=temperature, top_k=top_k, top_p=top_p, seed=17 + i)
        for i, p in enumerate(PROMPTS)
    ]
    results = await asyncio.gather(*(engine.generate(r) for r in requests))  # batched together
    worst = 0.0
    for request, completions in zip(requests, results, strict=True):
        assert_well_formed(request, completions)
        worst = max(worst, assert_logprobs_match(model, request, completions))
    return worst


async def check_n_completions(engine: InferenceEngine, model_dir: str) -> None:
    request = SamplingRequest(PROMPTS[0], n=5, max_tokens=12, seed=3)
    completions = await engine.generate(request)
    assert_well_formed(request, completions)
    assert len({tuple(c.token_ids) for c in completions}) > 1, "n samples are all identical"


async def check_max_tokens_and_length(engine: InferenceEngine, model_dir: str) -> None:
    request = SamplingRequest(PROMPTS[1], n=3, max_tokens=7, ignore_eos=True, seed=1)
    for c in await engine.generate(request):
        assert len(c.token_ids) == 7 and c.finish_reason == "length"


async def check_stop_token_ids(engine: InferenceEngine, model_dir: str) -> None:
    """Generation stops at (and includes) the first stop token, with finish_reason "stop"."""
    base = SamplingRequest(PROMPTS[2], max_tokens=20, ignore_eos=True, seed=5)
    (first,) = await engine.generate(base)
    stop = first.token_ids[6]
    at = first.token_ids.index(stop)
    request = SamplingRequest(PROMPTS[2], max_tokens=20, ignore_eos=True, seed=5, stop_token_ids=(stop,))
    (stopped,) = await engine.generate(request)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == first.token_ids[: at + 1]


async def check_stop_strings(engine: InferenceEngine, model_dir: str) -> None:
    """A stop string ends generation inside the engine: the completion ends with the token that completes it
    (finish_reason "stop"), its tokens and logprobs are those of a run without the stop string up to there (what
    the sampler's client-side cut keeps), and the engine generated no token past it."""
    from fleetrl.gateway.sampler import cut_at_stop

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = SamplingRequest(PROMPTS[2], max_tokens=40, ignore_eos=True, seed=5)
    (first,) = await engine.generate(base)
    at, stop = None, ""
    for k in range(4, 30):  # a stop string whose first appearance is completed by the k-th token
        stop = tokenizer.decode(first.token_ids[:k], skip_special_tokens=True)[-3:]
        if len(stop) == 3 and cut_at_stop(tokenizer, first.token_ids, [stop]) == k:
            at = k
            break
    assert at is not None, "no stop string to test with in the sample"
    before = engine.stats().generated_tokens
    request = dataclasses.replace(base, stop=("never in the text", stop))
    (stopped,) = await engine.generate(request)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == first.token_ids[:at]
    assert len(stopped.logprobs) == len(stopped.versions) == at
    assert max(abs(p - q) for p, q in zip(stopped.logprobs, first.logprobs[:at], strict=False)) < 1e-4
    assert engine.stats().generated_tokens - before == at, "the engine generated tokens past the stop string"
    completions = await engine.generate(dataclasses.replace(request, n=3, seed=None, seeds=(5, 6, 7)))
    for c in completions:  # each completion stops on its own; one without the string runs to max_tokens
        keep = cut_at_stop(tokenizer, c.token_ids, [stop])
        assert (c.finish_reason, len(c.token_ids)) == (("stop", keep) if keep else ("length", 40))


async def check_eos_stops(engine: InferenceEngine, model_dir: str, eos_id: int) -> None:
    """Without ignore_eos a completion ending in eos says "stop"; one without eos ran to max_tokens."""
    request = SamplingRequest(PROMPTS[3], n=16, max_tokens=40, seed=9)
    for c in await engine.generate(request):
        assert eos_id not in c.token_ids[:-1]
        if c.token_ids[-1] == eos_id:
            assert c.finish_reason == "stop"
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 40


async def check_seeded_determinism(engine: InferenceEngine, model_dir: str) -> None:
    request = SamplingRequest(PROMPTS[0], n=2, max_tokens=16, temperature=0.9, seed=1234)
    a, b = await engine.generate(request), await engine.generate(request)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b, strict=True):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-4
    other = await engine.generate(SamplingRequest(PROMPTS[0], n=2, max_tokens=16, seed=4321))
    assert [c.token_ids for c in other] != [c.token_ids for c in a]


async def check_seeds_per_completion(engine: InferenceEngine, model_dir: str) -> None:
    """A request with `seeds` samples completion i exactly as a request of its own seeded with seeds[i] (what the
    sampler's merging of a row's n = 1 calls relies on); a seed repeated gives the same completion twice."""
    seeds = (11, 900_001, 11, 2**62)
    merged = await engine.generate(SamplingRequest(PROMPTS[0], n=4, max_tokens=12, temperature=0.9, seeds=seeds))
    alone = [
        (await engine.generate(SamplingRequest(PROMPTS[0], max_tokens=12, temperature=0.9, seed=s)))[0] for s in seeds
    ]
    assert [c.token_ids for c in merged] == [c.token_ids for c in alone]
    for x, y in zip(merged, alone, strict=True):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-4
    assert merged[0].token_ids == merged[2].token_ids and merged[0].token_ids != merged[1].token_ids
    for bad, field_name in [((1, 2), "seeds"), ((1, 2, 3, -1), "seed")]:
        try:
            await engine.generate(SamplingRequest(PROMPTS[0], n=4, max_tokens=4, seeds=bad))
        except ValueError as exc:
            assert field_name in str(exc), f"error does not name {field_name}: {exc}"
        else:
            raise AssertionError(f"bad seeds {bad} were accepted")


async def check_versions_per_token(engine: InferenceEngine, model_dir: str) -> None:
    version = engine.loaded_version
    for c in await engine.generate(SamplingRequest(PROMPTS[0], n=2, max_tokens=10)):
        assert c.versions == [version] * len(c.token_ids)


async def check_invalid_requests(engine: InferenceEngine, model_dir: str) -> None:
    vocab = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
    bad = {
        "prompt_token_ids": SamplingRequest([1, vocab + 5]),
        "temperature": SamplingRequest([1, 2], temperature=-1.0),
        "top_p": SamplingRequest([1, 2], top_p=0.0),
        "max_tokens": SamplingRequest([1, 2], max_tokens=0),
    }
    for field_name, request in bad.items():
        try:
            await engine.generate(request)
        except ValueError as exc:
            assert field_name in str(exc), f"error does not name {field_name}: {exc}"
        else:
            raise AssertionError(f"bad {field_name} was accepted")


def _perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in state.items()}


async def _restore(engine: InferenceEngine, publisher: WeightPublisher, original: dict) -> None:
    version = engine.loaded_version + 1
    publisher.publish(version, original)
    await engine.load_weights(version, publisher.address, timeout_s=60)


async def check_load_weights(engine: InferenceEngine, model_dir: str) -> None:
    """New weights change outputs; logprobs then match a forward of the new weights; versions move."""
    original = load_reference(model_dir).state_dict()
    new_state = _perturbed(original, seed=1)
    request = SamplingRequest(PROMPTS[0], n=2, max_tokens=16, seed=77)
    before = await engine.generate(request)
    with WeightPublisher() as publisher:
        version = engine.loaded_version + 1
        manifest = publisher.publish(version, new_state)
        result = await engine.load_weights(version, publisher.address, timeout_s=60)
        assert result.version == version == engine.loaded_version
        assert result.checksum == manifest.checksum
        assert result.pause_s >= 0 and result.transfer_s >= 0
        after = await engine.generate(request)
        assert [c.token_ids for c in after] != [c.token_ids for c in before]
        assert all(c.versions == [version] * len(c.token_ids) for c in after)
        assert_logprobs_match(load_reference(model_dir, new_state), request, after)
        await _restore(engine, publisher, original)
    again = await engine.generate(request)
    assert [c.token_ids for c in again] == [c.token_ids for c in before]


class _CorruptingPublisher(WeightPublisher):
    """Flips one byte in every chunk it sends: the receiver's checksum must catch it."""

    def _chunk_payload(self, *args, **kwargs):  # the weight stream's test hook
        payload = bytearray(super()._chunk_payload(*args, **kwargs))
        if payload:
            payload[len(payload) // 2] ^= 0x10
        return payload


async def check_bad_loads_rejected(engine: InferenceEngine, model_dir: str) -> None:
    """Unknown name / wrong shape / wrong dtype / missing tensor / bad checksum / unknown version are
    refused with a clear error, and the previous version keeps serving unchanged."""
    original = load_reference(model_dir).state_dict()
    version = engine.loaded_version
    request = SamplingRequest(PROMPTS[1], n=2, max_tokens=10, seed=8)
    before = await engine.generate(request)
    first = next(iter(original))
    cases = {
        "unknown": {**original, "model.layers.99.mlp.up_proj.weight": torch.zeros(2, 2)},
        "shape": {**original, first: torch.zeros(3, 3)},
        "dtype": {**original, first: original[first].to(torch.float16)},
        "missing": {k: v for k, v in original.items() if k != first},
    }
    with WeightPublisher() as publisher:
        for i, (expected, state) in enumerate(cases.items()):
            publisher.publish(version + 1 + i, state)
            try:
                await engine.load_weights(version + 1 + i, publisher.address, timeout_s=60)
            except WeightLoadError as exc:
                assert expected in str(exc).lower(), f"{expected}: unclear error {exc}"
            else:
                raise AssertionError(f"a state dict with a bad {expected} tensor was loaded")
            assert engine.loaded_version == version
        try:
            await engine.load_weights(version + 50, publisher.address, timeout_s=30)
        except WeightLoadError as exc:
            assert str(version + 50) in str(exc)
        else:
            raise AssertionError("an unpublished version was loaded")
    with _CorruptingPublisher() as corrupt:
        corrupt.publish(version + 1, _perturbed(original, seed=2))
        try:
            await engine.load_weights(version + 1, corrupt.address, timeout_s=60)
        except WeightLoadError as exc:
            assert "checksum" in str(exc).lower(), f"unclear checksum error: {exc}"
        else:
            raise AssertionError("a corrupted transfer was loaded")
    assert engine.loaded_version == version
    after = await engine.generate(request)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]
    assert_logprobs_match(load_reference(model_dir), request, after)


async def check_swap_mid_generation(engine: InferenceEngine, model_dir: str) -> None:
    """A completion spanning a swap records the old version before it and the new one after, and each
    token's logprob is that of the labelled version's forward over the whole context."""
    original = load_reference(model_dir).state_dict()
    new_state = _perturbed(original, seed=3)
    old = engine.loaded_version
    with WeightPublisher() as publisher:
        publisher.publish(old + 1, new_state)
        long = SamplingRequest(PROMPTS[0], max_tokens=700, ignore_eos=True, seed=2)
        task = asyncio.create_task(engine.generate(long))
        await wait_generating(engine, task)
        assert not task.done(), "the completion finished before the swap; make it longer"
        result = await engine.load_weights(old + 1, publisher.address, timeout_s=60)
        (completion,) = await asyncio.wait_for(task, 120)
        versions = completion.versions
        assert versions == sorted(versions)
        assert versions[0] == old and versions[-1] == result.version
        await _restore(engine, publisher, original)
    # Each token's logprob is that of the version it is labelled with, over the whole context.
    for version, state in ((old, None), (result.version, new_state)):
        ref = reference_logprobs(
            load_reference(model_dir, state), long.prompt_token_ids, completion.token_ids, 1.0, 0, 1.0
        )
        diffs = [
            abs(got - want) for got, want, v in zip(completion.logprobs, ref, versions, strict=True) if v == version
        ]
        assert diffs and max(diffs) < LOGPROB_TOL, f"version {version}: worst {max(diffs)}"
