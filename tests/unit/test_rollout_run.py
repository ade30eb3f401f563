"""RolloutRun segments -> samples, the context keyword arguments a rollout declares, build_deployment_sampler."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fleetrl import RolloutRun, RolloutSample, RolloutSegment, RolloutSetup, build_deployment_sampler
from fleetrl.rollout import (
    ROLLOUT_CONTEXT_ARGS,
    InvalidSampleError,
    RolloutReturnTypeError,
    declared_context_args,
    rollout_result_samples,
)


def test_a_segment_extending_the_previous_one_is_merged_into_one_sample():
    turn1 = RolloutSegment([1, 2, 3], [0.0, -0.1, -0.2], [0, 1, 1], versions=[0, 0, 0])
    # The next turn's observation is turn 1 plus a tool reply (4) and the model's answer (5).
    turn2 = RolloutSegment([1, 2, 3, 4, 5], [0.0, 0.0, 0.0, 0.0, -0.5], [0, 0, 0, 0, 1], versions=[1, 1, 1, 1, 1])
    (sample,) = RolloutRun([turn1, turn2], reward=1.0, finish_reason="length", text="t").to_samples()
    assert sample.tokens == [1, 2, 3, 4, 5]
    assert sample.loss_mask == [0, 1, 1, 0, 1]  # the shared prefix keeps turn 1's mask and logprobs
    assert sample.logprobs == [0.0, -0.1, -0.2, 0.0, -0.5]
    assert sample.versions == [0, 0, 0, 1, 1]
    assert (sample.reward, sample.finish_reason, sample.text) == (1.0, "length", "t")


def test_a_segment_that_does_not_extend_starts_a_new_sample_with_the_run_reward():
    first = RolloutSegment([1, 2, 3], [0.0, -0.1, -0.2], [0, 1, 1])
    rewritten = RolloutSample([9, 2, 7], [0.0, 0.0, -0.3], [0, 0, 1], reward=99.0)  # its own reward is ignored
    samples = RolloutRun([first, rewritten], reward=0.5, metrics={"turns": 2}, text="end").to_samples()
    assert [s.tokens for s in samples] == [[1, 2, 3], [9, 2, 7]]
    assert [s.reward for s in samples] == [0.5, 0.5] and [s.text for s in samples] == ["", "end"]
    assert all(s.metrics == {"turns": 2} for s in samples)
    for s in samples:
        s.validate()


def test_the_metrics_of_rollout_sample_segments_reach_the_samples():
    # The cookbook's form: RolloutRun(segments=[RolloutSample(..., metrics=...)]) with no run-level metrics.
    segment = RolloutSample([1, 2, 3], [0.0, -0.1, -0.2], [0, 1, 1], reward=1.0, metrics={"turns": 2.0})
    (sample,) = RolloutRun(segments=[segment]).to_samples()
    assert sample.metrics == {"turns": 2.0}
    (sample,) = RolloutRun(segments=[segment], metrics={"turns": 3.0, "correct": 1.0}).to_samples()
    assert sample.metrics == {"turns": 3.0, "correct": 1.0}  # the run's own metrics win


def test_return_types_known_and_unknown():
    s = RolloutSample([1, 2], [0.0, -0.1], [0, 1], 1.0)
    assert rollout_result_samples(None) is None and rollout_result_samples(s) == [s]
    with pytest.raises(RolloutReturnTypeError, match=r"returned builtins\.tuple"):
        rollout_result_samples((s, 1.0))
    with pytest.raises(InvalidSampleError, match="segments"):
        RolloutRun([], 1.0).to_samples()


def test_context_arguments_are_those_declared():
    async def plain(row):
        return None

    async def cookbook(row, *, rollout_idx, epoch, evaluation=False):
        return None

    async def anything(row, **kwargs):
        return None

    assert declared_context_args(plain) == ()
    assert declared_context_args(cookbook) == ("epoch", "rollout_idx", "evaluation")
    assert declared_context_args(anything) == ROLLOUT_CONTEXT_ARGS


def test_build_deployment_sampler_is_the_setups_sampler():
    sampler = SimpleNamespace(name="replicas")
    assert build_deployment_sampler(RolloutSetup(sampler=sampler)) is sampler
    with pytest.raises(RuntimeError, match="inside your rollout factory"):
        build_deployment_sampler(RolloutSetup())


# A rollout written the way the Fireworks cookbook's current single-turn examples are (fleetrl's own code, not a
# copy): a RolloutRun of RolloutSample segments that carry the reward, and no reward= on the run itself; the
# completion read through the cookbook's attribute names (prompt_len, full_tokens, inference_logprobs).
def _cookbook_style_make_rollout_fn(setup):
    sampler = build_deployment_sampler(setup)

    async def rollout_fn(row: dict) -> RolloutRun | None:
        prompt = list(row.get("prompt_token_ids") or [])
        if not prompt:
            return None
        (completion,) = await sampler.sample_with_prompt_tokens(prompt, n=1, **dict(setup.sample_kwargs))
        n_prompt = int(completion.prompt_len)
        generated = list(completion.full_tokens)[n_prompt:]
        logprobs = list(completion.inference_logprobs or [])
        if getattr(completion, "logprobs_echoed", False):
            logprobs = logprobs[n_prompt:]
        segment = RolloutSample(
            tokens=list(completion.full_tokens),
            logprobs=[0.0] * n_prompt + logprobs,
            loss_mask=[0] * n_prompt + [1] * len(generated),
            reward=float(row.get("reward", 0.0)),
            finish_reason=getattr(completion, "finish_reason", "stop"),
            text=getattr(completion, "text", ""),
        )
        return RolloutRun(segments=[segment])

    return rollout_fn


async def test_a_cookbook_style_rollout_run_without_a_run_reward_trains():
    from fleetrl.gateway.sampler import SampledCompletion

    class Sampler:  # the engine's answer, shaped as fleetrl's sampler returns it
        async def sample_with_prompt_tokens(self, prompt, n=1, **kwargs):
            return [SampledCompletion([*prompt, 7, 8], len(prompt), [-0.5, -0.25], "length", "78", [3, 3])]

    setup = RolloutSetup(sampler=Sampler(), tokenizer=None, sample_kwargs={"max_tokens": 2})
    run = await _cookbook_style_make_rollout_fn(setup)({"prompt_token_ids": [1, 2, 3], "reward": 0.75})
    (sample,) = rollout_result_samples(run)
    assert sample.tokens == [1, 2, 3, 7, 8] and sample.loss_mask == [0, 0, 0, 1, 1]
    assert sample.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25]
    assert (sample.reward, sample.finish_reason, sample.text) == (0.75, "length", "78")


def test_a_run_without_reward_needs_one_shared_reward_on_its_segments():
    seg = RolloutSegment(tokens=[1, 2], logprobs=[0.0, -1.0], loss_mask=[0, 1])
    with pytest.raises(InvalidSampleError, match=r"segments\[0\]\.reward.*has none"):
        RolloutRun(segments=[seg]).to_samples()
    a = RolloutSample(tokens=[1, 2], logprobs=[0.0, -1.0], loss_mask=[0, 1], reward=1.0)
    b = RolloutSample(tokens=[5, 6], logprobs=[0.0, -1.0], loss_mask=[0, 1], reward=0.0)
    with pytest.raises(InvalidSampleError, match=r"segments\[1\]\.reward.*differs from segment 0"):
        RolloutRun(segments=[a, b]).to_samples()
    b.reward = 1.0
    assert [s.reward for s in RolloutRun(segments=[a, b], run_id="r1").to_samples()] == [1.0, 1.0]
