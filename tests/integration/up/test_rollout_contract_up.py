"""The rollout contract through `fleetrl up`: a rollout returning an unknown type stops the run, naming the type,
instead of dropping every sample and training nothing; the cookbook's current contract trains."""

from __future__ import annotations

from typing import Any

import pytest

from fleetrl import RolloutRun, RolloutSegment, RolloutSetup, build_deployment_sampler
from tests.integration.up.conftest import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def make_dict_rollout_fn(setup: RolloutSetup):  # type: ignore[no-untyped-def]
    async def rollout_fn(row: dict) -> Any:
        (c,) = await setup.sampler.sample_with_prompt_tokens(setup.tokenizer.encode(row["prompt"]), n=1)
        return {"tokens": c.full_tokens, "reward": 1.0}  # the wrong type: a dict

    return rollout_fn


def make_cookbook_rollout_fn(setup: RolloutSetup):  # type: ignore[no-untyped-def]
    """The current cookbook contract: build_deployment_sampler, context arguments, stop strings, RolloutRun."""
    sampler = build_deployment_sampler(setup)

    async def rollout_fn(row: dict, *, rollout_idx: int, epoch: int) -> RolloutRun:
        prompt = setup.tokenizer.encode(row["prompt"])
        (c,) = await sampler.sample_with_prompt_tokens(prompt, n=1, stop=["\n"], logprobs=True, **setup.sample_kwargs)
        n = len(c.sampling_logprobs)
        segment = RolloutSegment(
            c.full_tokens, [0.0] * c.prompt_len + c.sampling_logprobs, [0] * c.prompt_len + [1] * n
        )
        even = sum(1 for t in c.completion_tokens if t % 2 == 0) / max(n, 1)
        return RolloutRun([segment], reward=even, metrics={"rollout_idx": float(rollout_idx), "epoch": float(epoch)})

    return rollout_fn


def test_an_unknown_return_type_stops_the_run_naming_the_type(up_run):
    result, run_dir = up_run(
        up={"rollout": "tests.integration.up.test_rollout_contract_up:make_dict_rollout_fn"}, n_rows=8, timeout_s=240
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert "returned a type that is not a RolloutSample" in result.stderr
    assert "the rollout function returned builtins.dict" in result.stderr  # the gateway log's tail
    assert not (run_dir / "gateway-r1.log").exists()  # not restarted: it would fail the same way
    assert read_metrics(run_dir) == []


def test_the_current_cookbook_contract_trains(up_run):
    result, run_dir = up_run(
        {"max_steps": 2, "epochs": 2},
        {"rollout": "tests.integration.up.test_rollout_contract_up:make_cookbook_rollout_fn"},
        n_rows=8,
        timeout_s=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["env/all/rollout_idx"] == 1.5  # G = 4: the mean of 0..3, each member got its own index
        assert m["env/all/epoch"] == 0.0 and m["data/samples"] == 8
