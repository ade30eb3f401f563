"""Genuine work is never starved (issue 45, item 4). The probe: with the run's token, 1,200 forged groups on the
trainer's group port stalled the run, each step waiting 300 s for genuine groups the trainer had refused minutes
before as "buffer full". Now the buffer is shared fairly between senders (a flood from one cannot crowd out the
others), and a step that names a group the buffer refused or evicted fails at once, so the controller leases the row
again at once instead of after the group wait."""

from __future__ import annotations

import grpc
import pytest

from fleetrl.group_stream import GroupReceiver, GroupSender
from fleetrl.rollout import RolloutSample
from fleetrl.rollout_group import RolloutGroup
from fleetrl.trainer import buffer as buffer_module
from fleetrl.trainer.buffer import GroupBuffer, MissingGroupsError, RefusedGroupsError
from tests.waiting import wait_until

WAIT_S = 60.0  # the group wait a step would sit out (300 s in service); a refused group must not cost it


def group(row_id: int, source: str, tag: int = 7, attempt: int = 1) -> RolloutGroup:
    sample = RolloutSample(tokens=[1, 2, 3], logprobs=[0.0, -0.5, -0.5], loss_mask=[0, 1, 1], reward=1.0)
    return RolloutGroup(row_id, 0, [sample, sample], source=source, attempt=attempt, lease_tag=tag)


def test_a_flood_from_one_sender_cannot_crowd_out_another():
    buffer = GroupBuffer(capacity=10)
    for i in range(1200):
        buffer.add(group(1000 + i, "forger", tag=i))  # past 10, each replaces the forger's own oldest
    genuine = [group(r, "gateway-0") for r in range(4)]
    assert all(buffer.add(g) for g in genuine)  # before: refused as "buffer full"
    buffer.add(group(5000, "forger"))  # the forger keeps no more than its share
    got = buffer.wait_for([(g.row_id, 1, 7) for g in genuine], timeout_s=WAIT_S)
    assert [g.row_id for g in got] == [0, 1, 2, 3] and buffer.evicted_for_share == 4 and len(buffer) == 10


def test_a_group_pushed_out_of_a_full_buffer_fails_the_step_naming_it_at_once():
    buffer = GroupBuffer(capacity=4)
    for r in range(2):
        assert buffer.add(group(r, "gateway-0")) and buffer.add(group(100 + r, "gateway-1"))
    assert buffer.add(group(2, "gateway-0"))  # full, and gateway-0 holds its half: its oldest, row 0, makes room
    with pytest.raises(
        RefusedGroupsError, match=r"rows \[0#1\] did not arrive: the trainer refused them \(buffer full"
    ):
        buffer.wait_for([(0, 1, 7), (2, 1, 7)], timeout_s=WAIT_S)  # before: a wait of WAIT_S, then "did not arrive"
    assert [g.row_id for g in buffer.wait_for([(1, 1, 7), (2, 1, 7)], timeout_s=WAIT_S)] == [1, 2]


def test_a_group_evicted_for_anothers_share_or_unclaimed_fails_its_step_at_once():
    buffer = GroupBuffer(capacity=2)
    buffer.add(group(1, "gateway-0"))
    buffer.add(group(2, "gateway-0"))
    buffer.add(group(3, "gateway-1"))  # evicts row 1, gateway-0's oldest
    with pytest.raises(RefusedGroupsError, match="evicted for another sender's share") as info:
        buffer.wait_for([(1, 1, 7)], timeout_s=WAIT_S)
    assert info.value.missing == [1] and isinstance(info.value, MissingGroupsError)
    buffer.end_step(max_age_steps=0)
    buffer.end_step(max_age_steps=0)  # rows 2 and 3 unclaimed: evicted
    with pytest.raises(RefusedGroupsError, match="no step named it for 0 steps"):
        buffer.wait_for([(2, 1, 7)], timeout_s=WAIT_S)


def test_groups_of_senders_no_step_named_make_room_first():
    """Many forged sender names (one group each) cannot shrink a trained gateway's share to one group."""
    buffer = GroupBuffer(capacity=8)
    buffer.add(group(0, "gateway-0"))
    buffer.wait_for([(0, 1, 7)], timeout_s=WAIT_S)  # a step named it: gateway-0's groups are trained
    buffer.discard([0])
    for i in range(100):
        buffer.add(group(1000 + i, f"forged-{i}", tag=i))
    for r in range(1, 8):
        assert buffer.add(group(r, "gateway-0"))
    got = buffer.wait_for([(r, 1, 7) for r in range(1, 8)], timeout_s=WAIT_S)
    assert [g.row_id for g in got] == list(range(1, 8)) and len(buffer) == 8


def test_a_forged_twins_refusal_does_not_fail_the_genuine_groups_step():
    buffer = GroupBuffer(capacity=1)
    buffer.add(group(9, "forger", tag=1))
    buffer.add(group(4, "forger", tag=666))  # a forged twin of row 4
    buffer.add(group(4, "gateway-0", tag=7))  # the genuine one: the twin makes room
    assert buffer.wait_for([(4, 1, 7)], timeout_s=WAIT_S)[0].source == "gateway-0"


def test_refusals_are_remembered_up_to_a_bound(monkeypatch):
    monkeypatch.setattr(buffer_module, "MAX_REFUSED_REMEMBERED", 3)
    buffer = GroupBuffer(capacity=1)
    for r in range(6):
        assert buffer.add(group(r, "a"))  # each pushes the one before out
    assert len(buffer._refused) == 3 and sorted(buffer._refused_by_row) == [2, 3, 4]
    with pytest.raises(MissingGroupsError) as info:
        buffer.wait_for([(1, 1, 7)], timeout_s=0.01)  # forgotten: waited for as a late group
    assert not isinstance(info.value, RefusedGroupsError)


def test_the_controller_reads_a_refusal_as_lost_groups_to_lease_again():
    from fleetrl.services.controller.orchestrator import lost_groups

    class Step:
        row_ids = (2, 3)

    class Error(grpc.aio.AioRpcError):
        def __init__(self, details: str) -> None:
            self._details = details

        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.FAILED_PRECONDITION

        def details(self) -> str:
            return self._details

    refused = RefusedGroupsError([(2, 1)], ["buffer full"])
    assert lost_groups(Error(f"TrainStep 4: {refused}"), Step()) == {2}  # type: ignore[arg-type]


def test_a_flood_on_the_real_group_port_leaves_the_genuine_groups_trainable():
    """1,200 forged groups and 8 genuine ones through real ZeroMQ sockets into a buffer of 64."""
    buffer = GroupBuffer(capacity=64)
    receiver = GroupReceiver(buffer.add, auth_token="token").start()
    try:
        with GroupSender(receiver.address, auth_token="token") as forger:
            for i in range(1200):
                forger.send(group(10_000 + i, "gateway-1", tag=i))  # the flood claims the gateway's own name
        wait_until(lambda: receiver.counts["groups"] == 1200, 60, "the flood received")
        with GroupSender(receiver.address, auth_token="token") as gateway:
            for r in range(8):
                gateway.send(group(r, "gateway-1"))
        wait_until(lambda: receiver.counts["groups"] == 1208, 60, "the genuine groups received")
        got = buffer.wait_for([(r, 1, 7) for r in range(8)], timeout_s=WAIT_S)
        assert [g.row_id for g in got] == list(range(8)) and len(buffer) == 64
    finally:
        receiver.stop()
