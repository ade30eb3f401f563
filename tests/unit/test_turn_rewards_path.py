"""Per-turn rewards along the real path (issue 44 item 1): a multi-turn RolloutRun's turn_rewards -> the gateway's
group assembly -> the ZeroMQ group stream (protobuf) and the JSONL record -> the trainer's step batch; and a group
sent or recorded before the fields existed still reads the same."""

from __future__ import annotations

import json
import threading

import pytest

from fleetrl.gateway.assembly import assemble_group
from fleetrl.group_stream import GroupReceiver, GroupSender, decode_group, group_to_proto
from fleetrl.rollout import InvalidSampleError, RolloutRun, RolloutSegment
from fleetrl.rollout_group import RolloutGroup, group_from_dict, group_to_dict, read_groups_jsonl
from fleetrl.trainer.step_batch import build_step_batch

# A group serialized by the code before turn_rewards existed (fleetrl 5e27c8d): row 3, attempt 2, lease tag 9, one
# sample (tokens 5..8, mask [0, 1, 0, 1], reward 1, member 0, metrics {"correct": 1}).
OLD_GROUP_BYTES = bytes.fromhex(
    "080310011a430a0405060708121000000000000000bf00000000000080be1a040001000121000000000000f03f2a0473746f70"
    "42120a07636f727265637411000000000000f03f48002a02677730023809"
)


def two_turn_run(first: float, second: float) -> RolloutRun:
    """Prompt 10, the policy's turn [11, 12], an observation 13, its second turn [14]: two segments, the second
    extending the first (one sample)."""
    return RolloutRun(
        segments=[
            RolloutSegment(tokens=[10, 11, 12], logprobs=[0.0, -0.5, -0.5], loss_mask=[0, 1, 1]),
            RolloutSegment(
                tokens=[10, 11, 12, 13, 14], logprobs=[0.0, -0.5, -0.5, 0.0, -0.25], loss_mask=[0, 1, 1, 0, 1]
            ),
        ],
        reward=first + second,
        turn_rewards=[first, second],
    )


def test_a_runs_turn_rewards_follow_its_segments_into_samples():
    (sample,) = two_turn_run(0.5, 1.0).to_samples()
    assert sample.turn_rewards == [0.5, 1.0] and sample.turn_ends == [3, 5]
    rewritten = RolloutRun(  # the second segment does not extend the first: two samples, one turn each
        segments=[
            RolloutSegment(tokens=[10, 11], logprobs=[0.0, -0.5], loss_mask=[0, 1]),
            RolloutSegment(tokens=[20, 21], logprobs=[0.0, -0.5], loss_mask=[0, 1]),
        ],
        reward=1.0,
        turn_rewards=[0.25, 0.75],
    )
    first, second = rewritten.to_samples()
    assert (first.turn_rewards, first.turn_ends, second.turn_rewards, second.turn_ends) == ([0.25], [2], [0.75], [2])
    with pytest.raises(InvalidSampleError, match="one per segment \\(2\\), got 3 rewards") as info:
        RolloutRun(segments=rewritten.segments, reward=1.0, turn_rewards=[1.0, 2.0, 3.0]).to_samples()
    assert info.value.field_name == "turn_rewards"


def test_a_segment_without_a_trainable_token_cannot_carry_a_turn_reward():
    run = two_turn_run(0.0, 1.0)
    run.segments.insert(
        1, RolloutSegment(tokens=[10, 11, 12, 13], logprobs=[0.0, -0.5, -0.5, 0.0], loss_mask=[0, 1, 1, 0])
    )
    run.turn_rewards = [0.0, 0.5, 1.0]
    assembled = assemble_group(0, 0, [run, two_turn_run(1.0, 1.0)], min_samples=1)
    assert assembled.dropped["invalid"] == 1 and len(assembled.group.samples) == 1


def test_turn_rewards_travel_from_the_rollout_through_the_stream_to_the_step():
    assembled = assemble_group(7, 0, [two_turn_run(0.0, 1.0), two_turn_run(1.0, 1.0)], source="gw")
    assert assembled.accepted
    received: list[RolloutGroup] = []
    arrived = threading.Event()
    receiver = GroupReceiver(on_group=lambda g: (received.append(g), arrived.set())).start()
    try:
        with GroupSender(receiver.address) as sender:
            sender.send(assembled.group)
        assert arrived.wait(30), "the group did not arrive within 30 s"
    finally:
        receiver.stop()
    (group,) = received
    assert [s.turn_rewards for s in group.samples] == [[0.0, 1.0], [1.0, 1.0]]
    assert [s.turn_ends for s in group.samples] == [[3, 5], [3, 5]]
    batch = build_step_batch([group], advantage_estimator="turn_discounted", advantage_mode="center")
    # returns (gamma 1) [1, 1] and [2, 1]: turn 0 centred [-0.5, 0.5], turn 1 [0, 0]
    assert batch.advantages == [-0.5, 0.0, 0.5, 0.0]
    # The same group by the one-reward estimator: totals 1 and 2, one advantage per sample, nothing split.
    assert build_step_batch([group], advantage_mode="center").advantages == [-0.5, 0.5]


def test_a_group_sent_before_the_fields_existed_decodes_as_before():
    group = decode_group([b"", OLD_GROUP_BYTES])
    (sample,) = group.samples
    assert (group.row_id, group.attempt, group.lease_tag, sample.member) == (3, 2, 9, 0)
    assert sample.turn_rewards is None and sample.turn_ends is None and sample.metrics == {"correct": 1.0}
    # and a group without turn rewards encodes to exactly those bytes still
    assert group_to_proto(group).SerializeToString() == OLD_GROUP_BYTES


def test_turn_rewards_survive_the_jsonl_record_and_old_records_read(tmp_path):
    group = assemble_group(1, 0, [two_turn_run(0.0, 1.0), two_turn_run(1.0, 1.0)]).group
    record = group_to_dict(group)
    assert record["samples"][0]["turn_rewards"] == [0.0, 1.0] and record["samples"][0]["turn_ends"] == [3, 5]
    assert group_from_dict(json.loads(json.dumps(record))).samples == group.samples
    old = {
        "row_id": 2,
        "submit_version": 0,
        "samples": [{"tokens": [1, 2], "logprobs": [0, -1], "loss_mask": [0, 1], "reward": 1}],
    }
    path = tmp_path / "groups.jsonl"
    path.write_text(json.dumps(old) + "\n")
    (read,) = read_groups_jsonl(path)
    assert read.samples[0].turn_rewards is None and "turn_rewards" not in group_to_dict(read)["samples"][0]
