"""The one `RolloutSetup` every gateway and `fleetrl eval` hand the rollout factory, and the sampler interface it
types (`fleetrl.gateway.sampler.SamplerLike`)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from fleetrl import Config
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.sampler import RETRYABLE_CODES, Sampler, SamplerLike
from fleetrl.gateway.sampling_seed import RolloutKey
from fleetrl.gateway.worker import Gateway
from fleetrl.rollout import RolloutSetup


def test_the_setup_carries_the_runs_settings_and_the_sampler() -> None:
    run = Config(
        base_model="unused",
        dataset="unused",
        completions_per_prompt=3,
        max_seq_len=777,
        rollout_extras={"judge": "strict"},
    )
    sampler = Sampler(None, default_kwargs=run.sample_kwargs)
    setup = RolloutSetup.for_run(run, "tokenizer", sampler)
    assert setup.sampler is sampler and setup.tokenizer == "tokenizer"
    assert setup.completions_per_prompt == 3 and setup.max_seq_len == 777
    assert setup.extras == {"judge": "strict"} and setup.sample_kwargs == dict(run.sample_kwargs)
    setup.extras["judge"] = "lenient"  # the setup's copies are its own
    assert run.rollout_extras == {"judge": "strict"}


def test_fleetrls_sampler_is_a_sampler_like_and_a_bare_object_is_not() -> None:
    assert isinstance(Sampler(None), SamplerLike)
    assert not isinstance(object(), SamplerLike)


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "scripted")


@pytest.mark.parametrize(
    ("code", "retried"), [*((c, True) for c in RETRYABLE_CODES), (grpc.StatusCode.PERMISSION_DENIED, False)]
)
def test_a_rollout_failing_with_a_retryable_code_runs_again(code: grpc.StatusCode, retried: bool) -> None:
    calls = []

    async def rollout(row: dict) -> Any:
        calls.append(row)
        if len(calls) == 1:
            raise rpc_error(code)
        return "done"

    run = Config(base_model="unused", dataset="unused", completions_per_prompt=2)
    gateway = Gateway(GatewayConfig(run=run, rollout="unused:unused"), rollout_factory=lambda setup: rollout)
    asyncio.run(gateway.prepare_rollouts())
    result = asyncio.run(gateway.one_rollout({"q": 1}, RolloutKey(0, 1, 0, 0)))
    if retried:
        assert result == "done" and len(calls) == 2 and gateway.counters["rollouts_retried"] == 1
    else:
        assert isinstance(result, grpc.aio.AioRpcError) and len(calls) == 1
        assert gateway.counters["rollouts_failed"] == 1
