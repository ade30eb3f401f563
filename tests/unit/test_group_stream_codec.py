"""The group stream's message codec without sockets: [token, RolloutGroup] frames, the token compared before the
payload is touched, and every malformed message dropped with a reason instead of raising anything else."""

from __future__ import annotations

import pytest

from fleetrl.group_stream import GroupDecodeError, GroupReceiver, decode_group, encode_group
from fleetrl.rollout import RolloutSample
from fleetrl.rollout_group import RolloutGroup
from fleetrl.v1 import controller_pb2, rollout_pb2


def _group(row_id: int = 7) -> RolloutGroup:
    sample = RolloutSample(tokens=[1, 2, 3], logprobs=[0.0, -0.5, -0.25], loss_mask=[0, 1, 1], reward=1.0)
    return RolloutGroup(row_id, 2, [sample, sample], source="gw", attempt=3)


class _Untouchable:
    """A payload frame that fails the test if anything reads it."""

    def __len__(self) -> int:
        raise AssertionError("the payload was read before the token was checked")

    def __buffer__(self, flags: int) -> memoryview:
        raise AssertionError("the payload was read before the token was checked")


def test_round_trip_puts_the_token_in_its_own_frame_only():
    frames = encode_group(_group(), "s3cret")
    assert len(frames) == 2 and frames[0] == b"s3cret"
    msg = rollout_pb2.RolloutGroup.FromString(frames[1])
    assert msg.auth_token == ""  # not repeated inside the payload
    got = decode_group(frames, "s3cret")
    assert (got.row_id, got.attempt, len(got.samples)) == (7, 3, 2)
    assert decode_group(encode_group(_group()), None).row_id == 7  # auth off: empty token frame


@pytest.mark.parametrize("token", [b"", b"wrong", b"s3cret\x00", b"\xff\xfe", b"x" * 100_000])
def test_a_wrong_token_is_refused_before_the_payload_is_read(token):
    with pytest.raises(GroupDecodeError) as info:
        decode_group([token, _Untouchable()], "s3cret")
    assert info.value.reason == "auth"


BAD_MESSAGES = {
    "one frame (the old format)": [encode_group(_group())[1]],
    "three frames": [b"s3cret", encode_group(_group())[1], b"extra"],
    "garbage": [b"s3cret", b"\xff\xff\xff not a protobuf"],
    "truncated": [b"s3cret", encode_group(_group())[1][:-3]],
    "deeply nested groups": [b"s3cret", b"{" * 100_000],  # 0x7b = start-group tag of field 15
    "invalid utf-8 string": [b"s3cret", rollout_pb2.RolloutGroup(source="x").SerializeToString()[:-1] + b"\xff"],
}


@pytest.mark.parametrize("name", list(BAD_MESSAGES))
def test_malformed_messages_are_dropped_with_a_reason(name):
    with pytest.raises(GroupDecodeError) as info:
        decode_group(BAD_MESSAGES[name], "s3cret")
    assert info.value.reason == "malformed"


def test_another_message_type_parses_to_an_empty_group_and_bad_values_are_invalid_samples():
    other = controller_pb2.LeaseRowsRequest(gateway_id="gw", max_rows=5).SerializeToString()
    assert decode_group([b"s3cret", other], "s3cret").samples == []  # wire-type mismatches become unknown fields
    msg = rollout_pb2.RolloutGroup(row_id=2**63 - 1, attempt=-4)
    msg.samples.add(tokens=[1, -5], logprobs=[0.0, 0.0], loss_mask=[0, 1], reward=float("nan"))
    msg.samples.add(tokens=[1, 2], logprobs=[0.0], loss_mask=[0, 1], reward=1.0)
    msg.samples.add(tokens=[1, 2], logprobs=[0.0, float("inf")], loss_mask=[0, 7], reward=1.0)
    group = decode_group([b"s3cret", msg.SerializeToString()], "s3cret")
    assert group.samples == [] and len(group.dropped) == 3


def test_receiver_counts_drops_and_validates_its_size_cap():
    received: list[RolloutGroup] = []
    receiver = GroupReceiver(received.append, auth_token="s3cret", max_message_bytes=1 << 20)
    try:
        for frames in [*BAD_MESSAGES.values(), [b"wrong", b""]]:
            assert receiver.handle_message(frames) is None
        assert receiver.handle_message(encode_group(_group(), "s3cret")) is not None
    finally:
        receiver.stop()
    counts = receiver.snapshot_counts()
    assert counts["messages_dropped/malformed"] == len(BAD_MESSAGES) and counts["messages_dropped/auth"] == 1
    assert [g.row_id for g in received] == [7]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_message_bytes"):
            GroupReceiver(received.append, max_message_bytes=bad)


def test_the_member_of_a_split_trajectory_crosses_the_wire_and_unset_stays_unset():
    samples = [RolloutSample([1, 2], [0.0, -0.1], [0, 1], 0.5, member=m) for m in (0, 0, None)]
    group = decode_group(encode_group(RolloutGroup(3, 1, samples)))
    assert [x.member for x in group.samples] == [0, 0, None]
