"""The current cookbook's optional `RolloutSample` fields (fw-ai/cookbook #570): `raw_logprobs` and a text
`prompt_model_input` are accepted and checked, `routing_matrices` (MoE router replay) is refused naming the field."""

from __future__ import annotations

import pytest

from fleetrl import InvalidSampleError, RolloutRun, RolloutSample
from fleetrl.rollout import rollout_result_samples
from fleetrl.tinker import ModelInput

TOKENS, LOGPROBS, MASK = [5, 6, 7, 8], [0.0, 0.0, -0.5, -0.25], [0, 0, 1, 1]


def test_raw_logprobs_and_a_text_prompt_model_input_are_accepted_and_do_not_change_the_trained_logprobs():
    sample = RolloutSample(
        tokens=TOKENS,
        logprobs=LOGPROBS,
        loss_mask=MASK,
        reward=1.0,
        prompt_model_input=ModelInput.from_ints([5, 6]),
        routing_matrices=None,
        raw_logprobs=[0.0, 0.0, -0.6, -0.2],
    ).validate()
    assert sample.logprobs == LOGPROBS  # raw_logprobs is for observability only, as in the cookbook
    assert RolloutSample(TOKENS, LOGPROBS, MASK, 1.0, routing_matrices=[]).validate().routing_matrices == []
    # As segments of the cookbook's RolloutRun (reward on each segment).
    run = RolloutRun(segments=[RolloutSample(TOKENS, LOGPROBS, MASK, 0.5, raw_logprobs=[0.0] * 4)])
    (trained,) = rollout_result_samples(run)
    assert (trained.tokens, trained.logprobs, trained.reward) == (TOKENS, LOGPROBS, 0.5)


def test_routing_matrices_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"RolloutSample\.routing_matrices: MoE router replay is not supported"):
        RolloutSample(TOKENS, LOGPROBS, MASK, 1.0, routing_matrices=["b64-routes"] * 3)


class ImageModelInput:
    """A tinker ModelInput with an image chunk: to_ints() raises, as tinker's does."""

    length = 3

    def to_ints(self) -> list[int]:
        raise ValueError("ModelInput holds an ImageChunk")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"raw_logprobs": [0.0, -0.1]}, "raw_logprobs: length 2; must be a list of len"),
        ({"raw_logprobs": [0.0, 0.0, "x", 0.0]}, "raw_logprobs: position 2 is 'x'"),
        ({"prompt_model_input": ModelInput.from_ints([5, 9])}, "prompt_model_input: its 2 tokens are not the"),
        ({"prompt_model_input": ImageModelInput()}, "prompt_model_input: holds more than token ids"),
        ({"prompt_model_input": "5 6"}, "prompt_model_input: must be a tinker ModelInput or None"),
    ],
)
def test_bad_cookbook_fields_make_the_sample_invalid_naming_the_field(fields, message):
    with pytest.raises(InvalidSampleError, match=message):
        RolloutSample(TOKENS, LOGPROBS, MASK, 1.0, **fields).validate()
