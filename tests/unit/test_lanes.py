"""The lane check (tests/lanes.py): CI's fast and slow lanes must together run every collected test exactly once."""

from __future__ import annotations

from tests.lanes import lane_problems


def test_two_complementary_lanes_pass():
    fast = {"selected": ["a", "b"], "deselected": ["c"]}
    slow = {"selected": ["c"], "deselected": ["a", "b"]}
    assert lane_problems({"fast": fast, "slow": slow}) == []


def test_a_test_in_both_lanes_is_named():
    fast = {"selected": ["a", "b"], "deselected": ["c"]}
    slow = {"selected": ["b", "c"], "deselected": ["a"]}
    (problem,) = lane_problems({"fast": fast, "slow": slow})
    assert "1 tests run in more than one lane" in problem and "'b'" in problem


def test_a_test_in_no_lane_and_a_lane_that_collected_less_are_named():
    fast = {"selected": ["a"], "deselected": ["c"]}
    slow = {"selected": ["c"], "deselected": ["a", "b"]}  # b: collected by the slow lane only, selected by neither
    problems = lane_problems({"fast": fast, "slow": slow})
    assert problems == ["lane fast did not collect ['b']", "1 tests run in no lane, e.g. ['b']"]
