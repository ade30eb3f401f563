"""The trainer's group buffer: one group per row, late groups awaited with a timeout, trained rows refused."""

from __future__ import annotations

import threading

import pytest

from fleetrl.groups import RolloutGroup
from fleetrl.trainer.buffer import GroupBuffer, MissingGroupsError


def _group(row_id: int) -> RolloutGroup:
    return RolloutGroup(row_id, 0, [])


def test_duplicates_and_trained_rows_are_refused_and_counted():
    trained = {5}
    buffer = GroupBuffer(is_trained=trained.__contains__)
    assert buffer.add(_group(1)) and not buffer.add(_group(1)) and not buffer.add(_group(5))
    assert len(buffer) == 1 and buffer.duplicates == 2


def test_wait_for_gets_a_late_group_and_skips_trained_rows():
    buffer = GroupBuffer(is_trained=lambda r: r == 9)
    buffer.add(_group(1))
    timer = threading.Timer(0.05, lambda: buffer.add(_group(2)))
    timer.start()
    got = buffer.wait_for([1, 2, 9], timeout_s=5.0)
    timer.join()
    assert [g.row_id for g in got] == [1, 2]
    buffer.discard([1, 2])
    assert len(buffer) == 0


def test_missing_groups_time_out_naming_the_rows():
    buffer = GroupBuffer()
    buffer.add(_group(1))
    with pytest.raises(MissingGroupsError, match=r"rows \[3, 4\]") as info:
        buffer.wait_for([1, 3, 4], timeout_s=0.05)
    assert info.value.missing == [3, 4] and len(buffer) == 1  # nothing lost


def test_wait_for_count_returns_what_arrived_in_order():
    buffer = GroupBuffer()
    for r in (3, 1, 2):
        buffer.add(_group(r))
    assert [g.row_id for g in buffer.wait_for_count(2, timeout_s=0.01)] == [3, 1]
    assert len(buffer.wait_for_count(5, timeout_s=0.01)) == 3
