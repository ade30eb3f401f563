import pytest

from fleetrl.rollout import RolloutSample
from fleetrl.step_metrics import assistant_turns, done_fraction, reward_filter_metrics, sample_metrics


def test_assistant_turns_counts_runs_of_ones():
    assert assistant_turns([0, 0, 1, 1, 0, 0, 1, 1]) == 2
    assert assistant_turns([1, 1, 1]) == 1
    assert assistant_turns([0, 0]) == 0


def test_sample_metrics_hand_example():
    a = RolloutSample([1, 2, 3, 4, 5, 6], [0.0] * 6, [0, 1, 1, 0, 1, 0], 1.0, metrics={"correct": 1.0})
    b = RolloutSample([1, 2, 3], [0.0] * 3, [0, 1, 1], 0.0, finish_reason="length", metrics={"correct": 0.0})
    m = sample_metrics([a, b], version_offsets=[0, 2])
    assert m["rollout/filtered_reward"] == 0.5 and m["rollout/reward_std"] == 0.5
    assert m["env/all/correct"] == 0.5
    assert m["rollout/ac_tokens_per_turn"] == pytest.approx(5 / 3)  # 3 + 2 assistant tokens over 2 + 1 turns
    assert m["rollout/response_length/mean"] == 2.5 and m["rollout/response_length/max"] == 3.0
    assert m["rollout/response_length/clip_ratio"] == 0.5  # b was cut at the token limit
    assert m["rollout/tokens_generated"] == 5.0
    assert m["async/version_offset_mean"] == 1.0 and m["async/version_offset_max"] == 2.0
    assert sample_metrics([]) == {}


def test_raw_reward_counts_the_groups_the_filter_refused():
    # 8 samples trained at mean 0.5; two groups of 4 refused by the dynamic filter, all 1.0 and all 0.0.
    trained = {"rollout/filtered_reward": 0.5, "data/samples": 8.0, "data/groups": 2.0}
    m = reward_filter_metrics(trained, [1.0] * 4 + [0.0] * 4, filtered_groups=2)
    assert m["rollout/raw_reward"] == pytest.approx((0.5 * 8 + 4) / 16)
    assert m["rollout/filter_ratio"] == 0.5 and m["rollout/groups_filtered"] == 2.0
    unfiltered = reward_filter_metrics(trained, [], filtered_groups=0)
    assert unfiltered["rollout/raw_reward"] == 0.5 and unfiltered["rollout/filter_ratio"] == 0.0
    # A refused group with no valid sample counts as filtered but adds no reward.
    assert reward_filter_metrics(trained, [], filtered_groups=1)["rollout/filter_ratio"] == pytest.approx(1 / 3)


def test_done_fraction_ends_at_max_steps_or_the_data():
    assert done_fraction(5, max_steps=10, total_rows=1000, groups_per_step=4) == 0.5
    assert done_fraction(5, max_steps=None, total_rows=40, groups_per_step=4) == 0.5  # 10 steps of data
    assert done_fraction(3, max_steps=100, total_rows=10, groups_per_step=4) == 1.0  # ceil(10 / 4) = 3 steps
