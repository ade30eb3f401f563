import pytest

from fleetrl.rollout import RolloutSample
from fleetrl.step_metrics import assistant_turns, sample_metrics


def test_assistant_turns_counts_runs_of_ones():
    assert assistant_turns([0, 0, 1, 1, 0, 0, 1, 1]) == 2
    assert assistant_turns([1, 1, 1]) == 1
    assert assistant_turns([0, 0]) == 0


def test_sample_metrics_hand_example():
    a = RolloutSample([1, 2, 3, 4, 5, 6], [0.0] * 6, [0, 1, 1, 0, 1, 0], 1.0, metrics={"correct": 1.0})
    b = RolloutSample([1, 2, 3], [0.0] * 3, [0, 1, 1], 0.0, finish_reason="length", metrics={"correct": 0.0})
    m = sample_metrics([a, b], version_offsets=[0, 2])
    assert m["reward/mean"] == 0.5 and m["reward/std"] == 0.5
    assert m["env/all/correct"] == 0.5
    assert m["ac_tokens_per_turn"] == pytest.approx(5 / 3)  # 3 + 2 assistant tokens over 2 + 1 turns
    assert m["finish/length_frac"] == 0.5
    assert m["async/version_offset_mean"] == 1.0 and m["async/version_offset_max"] == 2.0
    assert sample_metrics([]) == {}
