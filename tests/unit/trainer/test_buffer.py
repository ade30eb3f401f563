"""The trainer's group buffer: groups keyed (row, attempt), late groups awaited with a timeout, trained rows and
superseded attempts refused."""

from __future__ import annotations

import threading

import pytest

from fleetrl.rollout_group import RolloutGroup
from fleetrl.trainer.buffer import GroupBuffer, MissingGroupsError


def _group(row_id: int, attempt: int = 1) -> RolloutGroup:
    return RolloutGroup(row_id, 0, [], attempt=attempt)


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
    got = buffer.wait_for([(1, 1), (2, 1), (9, 1)], timeout_s=5.0)
    timer.join()
    assert [g.row_id for g in got] == [1, 2]
    buffer.discard([1, 2])
    assert len(buffer) == 0


def test_missing_groups_time_out_naming_the_rows():
    buffer = GroupBuffer()
    buffer.add(_group(1))
    with pytest.raises(MissingGroupsError, match=r"rows \[3#1, 4#1\]") as info:
        buffer.wait_for([(1, 1), (3, 1), (4, 1)], timeout_s=0.05)
    assert info.value.missing == [3, 4] and len(buffer) == 1  # nothing lost


def test_wait_for_count_returns_what_arrived_in_order():
    buffer = GroupBuffer()
    for r in (3, 1, 2):
        buffer.add(_group(r))
    assert [g.row_id for g in buffer.wait_for_count(2, timeout_s=0.01)] == [3, 1]
    assert len(buffer.wait_for_count(5, timeout_s=0.01)) == 3


def test_a_step_gets_the_attempt_it_names_not_the_stale_one_that_came_first():
    # Attempt 1 of row 7 arrived first (the gateway sends before it reports; the controller found it stale and
    # leased the row again). The step names attempt 2: it waits for it instead of taking attempt 1.
    buffer = GroupBuffer()
    assert buffer.add(_group(7, attempt=1))
    with pytest.raises(MissingGroupsError):
        buffer.wait_for([(7, 2)], timeout_s=0.01)
    assert buffer.add(_group(7, attempt=2))  # not refused as a duplicate of row 7
    (got,) = buffer.wait_for([(7, 2)], timeout_s=1.0)
    assert got.attempt == 2
    buffer.discard([7])
    assert len(buffer) == 0  # training row 7 evicted attempt 1 too


def test_superseded_attempts_are_evicted_and_refused_when_they_arrive_late():
    buffer = GroupBuffer()
    buffer.add(_group(3, attempt=1))
    assert buffer.evict([(3, 1), (4, 1)]) == 1  # 3#1 was buffered; 4#1 is still on its way
    assert len(buffer) == 0
    assert not buffer.add(_group(4, attempt=1))  # arrives after the controller superseded it
    assert buffer.add(_group(4, attempt=2))
    assert buffer.superseded == 2 and buffer.duplicates == 0


def test_attempt_zero_means_whichever_arrived_last():
    buffer = GroupBuffer()
    buffer.add(_group(5, attempt=1))
    buffer.add(_group(5, attempt=2))
    (got,) = buffer.wait_for([(5, 0)], timeout_s=0.01)
    assert got.attempt == 2


def test_a_full_buffer_makes_room_and_counts_instead_of_growing():
    buffer = GroupBuffer(capacity=2)
    assert buffer.add(_group(1)) and buffer.add(_group(2))
    assert buffer.add(_group(3)) and buffer.refused_full == 1 and len(buffer) == 2  # the oldest, row 1, made room
    assert [g.row_id for g in buffer.wait_for([(2, 1), (3, 1)], timeout_s=1.0)] == [2, 3]


def test_a_forged_twin_with_the_right_row_and_attempt_is_never_trained():
    # Only the lease holder learned the lease's tag. A group claiming the same (row, attempt) without it (forged,
    # stray) arrives first: it neither takes the real group's place nor gets trained.
    buffer = GroupBuffer()
    forged = RolloutGroup(4, 0, [], attempt=1, lease_tag=999)
    real = RolloutGroup(4, 0, [], attempt=1, lease_tag=123456789)
    assert buffer.add(forged) and buffer.add(real)
    (got,) = buffer.wait_for([(4, 1, 123456789)], timeout_s=1.0)
    assert got is real
    with pytest.raises(MissingGroupsError):
        buffer.wait_for([(5, 1, 42)], timeout_s=0.01)
    buffer.discard([4])
    assert len(buffer) == 0


def test_a_flood_of_groups_no_step_names_is_evicted_after_max_age_steps():
    """Issue 28 item 6: 300 well-formed groups for rows never leased filled the buffer for good and every real group
    after them was refused (the run died at step 4). Unnamed groups now leave after max_age_steps steps."""
    buffer = GroupBuffer(capacity=300)
    for row in range(1000, 1300):  # the flood: right token, rows never leased
        assert buffer.add(_group(row))
    assert buffer.add(_group(1)) and buffer.refused_full == 1  # a real group gets in: the oldest flood group makes room
    buffer.discard([1])  # trained
    for _ in range(3):
        assert buffer.end_step(max_age_steps=3) == 0  # young groups stay: a real one may be named in a few steps
    assert buffer.end_step(max_age_steps=3) == 299 and buffer.evicted_unclaimed == 299 and len(buffer) == 0
    assert buffer.add(_group(1))  # real groups get in again
    buffer.end_step(max_age_steps=3)
    assert buffer.wait_for([(1, 1)], timeout_s=1.0)[0].row_id == 1  # still there one step later
    buffer.discard([1])
    assert buffer.end_step(max_age_steps=0) == 0  # trained and discarded: nothing left to evict


def test_the_trainer_takes_its_group_size_cap_as_a_flag():
    """The gateway refuses a group over its max_group_mb before sending; the trainer's cap must match it, and the
    trainer had no flag to set it (only a config file)."""
    from fleetrl.services.trainer.launcher import build_parser, config_from_args

    config = config_from_args(build_parser().parse_args(["--model", "m", "--max-group-mb", "64", "--set", "kl_beta=0"]))
    assert config.max_group_mb == 64
    assert config_from_args(build_parser().parse_args(["--model", "m", "--set", "kl_beta=0"])).max_group_mb == 32
