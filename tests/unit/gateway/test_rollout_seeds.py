"""The seed each sampling call carries: the caller's, else the rollout's derived seed, else none (no sockets)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from fleetrl import Config, RolloutSample
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.sampler import NoReplicaError, Sampler
from fleetrl.gateway.sampling_seed import RolloutKey, derive_seed, rollout_seed_scope
from fleetrl.gateway.worker import Gateway
from fleetrl.services.inference.engine import Completion, SamplingRequest


class RecordingSampler(Sampler):
    """A sampler whose replica is a script: it records each request and answers one token per completion."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.requests: list[SamplingRequest] = []

    async def generate(self, request: SamplingRequest) -> list[Completion]:
        self.requests.append(request)
        return [Completion([5], [-0.5], "length", len(request.prompt_token_ids), [0]) for _ in range(request.n)]

    @property
    def seeds(self) -> list[int | None]:
        return [r.seed for r in self.requests]


KEY = RolloutKey(run_seed=1, row_id=9, version=3, sample_index=2)


async def test_inside_a_rollout_each_call_gets_the_next_derived_seed():
    sampler = RecordingSampler()
    with rollout_seed_scope(KEY):
        await sampler.sample_with_prompt_tokens([1, 2], n=4)
        await sampler.sample_with_prompt_tokens([1, 2, 5, 7], n=1)  # the next turn of a multi-turn rollout
    assert sampler.seeds == [derive_seed(1, 9, 3, 2, 0), derive_seed(1, 9, 3, 2, 1)]


async def test_an_explicit_seed_wins_and_outside_a_rollout_calls_stay_unseeded():
    sampler = RecordingSampler()
    await sampler.sample_with_prompt_tokens([1, 2])  # e.g. an evaluation hook
    with rollout_seed_scope(KEY):
        await sampler.sample_with_prompt_tokens([1, 2], seed=42)
        await sampler.sample_with_prompt_tokens([1, 2])
    configured = RecordingSampler(default_kwargs={"seed": 7})  # a seed in the run's sample_kwargs
    with rollout_seed_scope(KEY):
        await configured.sample_with_prompt_tokens([1, 2])
    # The explicit seed does not use up a derived one: the next call still gets call index 0.
    assert sampler.seeds == [None, 42, derive_seed(1, 9, 3, 2, 0)]
    assert configured.seeds == [7]


async def _gateway(rollout_fn: Any, sampler: Sampler) -> Gateway:
    run = Config(base_model="unused", dataset="unused", completions_per_prompt=4, seed=11)
    settings = GatewayConfig(run=run, rollout="unused:unused")
    gateway = Gateway(settings, rollout_factory=lambda setup: rollout_fn, sampler=sampler)
    await gateway.prepare_rollouts()
    return gateway


def _two_turn_rollout(sampler: Sampler, fail_first: int = 0):
    calls = {"n": 0}

    async def rollout_fn(row: dict) -> RolloutSample:
        calls["n"] += 1
        (first,) = await sampler.sample_with_prompt_tokens(row["prompt"])
        if calls["n"] <= fail_first:
            raise NoReplicaError("the replica went away")  # recoverable: the gateway retries the rollout
        (second,) = await sampler.sample_with_prompt_tokens([*first.full_tokens, 3])
        return RolloutSample(
            tokens=second.full_tokens, logprobs=[0.0] * 5, loss_mask=[0, 0, 1, 0, 1], reward=1.0, versions=[0] * 5
        )

    return rollout_fn


async def test_the_gateway_seeds_each_rollout_from_run_seed_row_version_and_sample_index():
    sampler = RecordingSampler()
    gateway = await _gateway(_two_turn_rollout(sampler), sampler)
    leased = SimpleNamespace(row_id=21, submit_version=4, attempt=2)
    await gateway.one_rollout({"prompt": [1, 2]}, gateway._rollout_key(leased, 3))
    assert sampler.seeds == [derive_seed(11, 21, 4, 3, 0), derive_seed(11, 21, 4, 3, 1)]


async def test_a_retried_rollout_starts_again_from_the_same_seeds():
    sampler = RecordingSampler()
    gateway = await _gateway(_two_turn_rollout(sampler, fail_first=1), sampler)
    result = await gateway.one_rollout({"prompt": [1, 2]}, RolloutKey(11, 21, 4, 0))
    assert isinstance(result, RolloutSample) and gateway.counters["rollouts_retried"] == 1
    first, second = derive_seed(11, 21, 4, 0, 0), derive_seed(11, 21, 4, 0, 1)
    assert sampler.seeds == [first, first, second]
