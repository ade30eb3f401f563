import math

import pytest

from fleetrl.trainer.advantages import group_advantages, member_advantages


def test_standardize_hand_vector():
    adv = group_advantages([1, 0, 0, 1])
    # mean 0.5, unbiased std sqrt(1/3) = 0.577 -> +-0.866
    assert [round(a, 3) for a in adv] == [0.866, -0.866, -0.866, 0.866]


def test_uniform_group_gives_zero_advantages():
    assert group_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]
    assert group_advantages([2.0, 2.0], mode="center") == [0.0, 0.0]


def test_center_mode_is_mean_centering_only():
    assert group_advantages([1.0, 0.0, 0.0, 3.0], mode="center") == [0.0, -1.0, -1.0, 2.0]


def test_group_of_one_is_dropped():
    assert group_advantages([1.0]) is None
    assert group_advantages([]) is None


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="advantage_mode"):
        group_advantages([1, 2], mode="zscore")
    with pytest.raises(ValueError, match="reward 1"):
        group_advantages([1.0, math.nan])


def test_standardized_advantages_sum_to_zero_and_unit_std():
    adv = group_advantages([0.1, 0.7, 0.4, 1.9, -0.3])
    assert abs(sum(adv)) < 1e-9
    std = math.sqrt(sum(a * a for a in adv) / (len(adv) - 1))
    assert abs(std - 1.0) < 1e-6


@pytest.mark.parametrize("mode", ["standardize", "center"])
def test_a_member_split_into_three_samples_gets_its_unsplit_advantage(mode):
    unsplit = group_advantages([1.0, 0.0, 0.25, 0.5], mode=mode)
    # member 1's trajectory arrived as 3 samples (a RolloutRun whose segments do not extend each other)
    split = member_advantages([1.0, 0.0, 0.0, 0.0, 0.25, 0.5], [None, 1, 1, 1, None, None], mode=mode)
    assert split == [unsplit[0], unsplit[1], unsplit[1], unsplit[1], unsplit[2], unsplit[3]]
    counted_thrice = group_advantages([1.0, 0.0, 0.0, 0.0, 0.25, 0.5], mode=mode)
    assert split[0] != counted_thrice[0]  # what treating the pieces as members would have given


def test_a_group_of_one_member_in_several_samples_has_no_relative_signal():
    assert member_advantages([1.0, 1.0, 1.0], [0, 0, 0]) is None
    assert member_advantages([1.0, 0.0], [None, None]) == group_advantages([1.0, 0.0])
    with pytest.raises(ValueError, match="2 members for 3 rewards"):
        member_advantages([1.0, 0.0, 0.5], [0, 1])
