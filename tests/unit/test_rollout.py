import math

import pytest

from fleetrl import InvalidSampleError, RolloutSample


def sample(**kw):
    base = dict(tokens=[5, 6, 7, 8], logprobs=[0.0, 0.0, -0.5, -1.0], loss_mask=[0, 0, 1, 1], reward=1.0)
    base.update(kw)
    return RolloutSample(**base)


def test_valid_sample_passes_and_returns_self():
    s = sample(metrics={"correct": True, "format": 0.5}, versions=[0, 0, 3, 3])
    assert s.validate() is s
    assert s.num_generated == 2


@pytest.mark.parametrize(
    ("kw", "field", "fragment"),
    [
        (dict(logprobs=[0.0, -1.0]), "logprobs", "length 2 != len(tokens) 4"),
        (dict(loss_mask=[0, 1]), "loss_mask", "length 2"),
        (dict(loss_mask=[0, 0, 2, 1]), "loss_mask", "must be 0 or 1"),
        (dict(loss_mask=[1, 0, 0, 0]), "loss_mask", "no masked"),
        (dict(reward=math.nan), "reward", "finite"),
        (dict(reward=math.inf), "reward", "finite"),
        (dict(reward="1"), "reward", "number"),
        (dict(logprobs=[0.0, 0.0, math.nan, -1.0]), "logprobs", "masked position 2"),
        (dict(logprobs=[0.0, 0.0, -math.inf, -1.0]), "logprobs", "masked position 2"),
        (dict(logprobs=[0.0, 0.0, 0.7, -1.0]), "logprobs", "masked position 2"),
        (dict(tokens=[5, -6, 7, 8]), "tokens", "negative token id -6"),
        (dict(tokens=[5, 6.0, 7, 8]), "tokens", "not an int"),
        (dict(tokens=[5], logprobs=[0.0], loss_mask=[1]), "tokens", "at least 2"),
        (dict(versions=[0, 1]), "versions", "length 2"),
        (dict(metrics={"acc": math.nan}), "metrics", "'acc'"),
    ],
)
def test_invalid_samples_name_the_field(kw, field, fragment):
    with pytest.raises(InvalidSampleError) as info:
        sample(**kw).validate()
    assert info.value.field_name == field
    assert fragment in str(info.value)
    assert f"RolloutSample.{field}" in str(info.value)


def test_nonfinite_logprob_outside_mask_is_allowed():
    # Non-generated positions carry 0.0 by convention but are never used, so they are not checked.
    sample(logprobs=[math.nan, 0.0, -0.5, -1.0]).validate()


def test_invalid_sample_error_is_a_value_error():
    assert issubclass(InvalidSampleError, ValueError)


@pytest.mark.parametrize("member", [-1, "0", True, 1.0])
def test_a_member_that_is_not_a_group_index_is_invalid(member):
    with pytest.raises(InvalidSampleError, match="member"):
        RolloutSample([1, 2], [0.0, -0.1], [0, 1], 1.0, member=member).validate()
    assert RolloutSample([1, 2], [0.0, -0.1], [0, 1], 1.0, member=2).validate().member == 2
