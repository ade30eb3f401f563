"""The rollout-group stream over real ZeroMQ sockets on loopback: groups arrive intact, invalid samples are
dropped and counted by field, malformed or unauthenticated messages are dropped whole, nothing is fatal."""

from __future__ import annotations

import threading

import pytest
import zmq

from fleetrl.group_stream import GroupReceiver, GroupSender, GroupStreamError
from fleetrl.rollout import RolloutSample
from fleetrl.rollout_group import RolloutGroup

pytestmark = pytest.mark.integration


class _Inbox:
    def __init__(self) -> None:
        self.groups: list[RolloutGroup] = []
        self.cond = threading.Condition()

    def add(self, group: RolloutGroup) -> None:
        with self.cond:
            self.groups.append(group)
            self.cond.notify_all()

    def wait(self, n: int, timeout_s: float = 10.0) -> list[RolloutGroup]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.groups) >= n, timeout_s), f"got {len(self.groups)} of {n}"
            return list(self.groups)


def _sample(**kw) -> RolloutSample:
    values = {
        "tokens": [5, 6, 7, 8],
        "logprobs": [0.0, 0.0, -0.5, -1.25],
        "loss_mask": [0, 0, 1, 1],
        "reward": 1.0,
        "versions": [0, 0, 3, 4],
        "metrics": {"correct": 1.0},
        "text": "ok",
        "finish_reason": "length",
    }
    values.update(kw)
    return RolloutSample(**values)


@pytest.fixture
def stream():
    inbox = _Inbox()
    drops: list[tuple[str, str]] = []
    receiver = GroupReceiver(inbox.add, on_drop=lambda r, m: drops.append((r, m))).start()
    yield receiver, inbox, drops
    receiver.stop()


def test_groups_arrive_intact_and_invalid_samples_are_dropped_and_counted(stream):
    receiver, inbox, drops = stream
    good = RolloutGroup(11, 3, [_sample(), _sample(reward=0.0, versions=None, metrics={})], source="gw-a")
    mixed = RolloutGroup(12, 3, [_sample(), _sample(tokens=[5, -1, 7, 8]), _sample(loss_mask=[0, 0, 0, 0])])
    with GroupSender(receiver.address) as sender:
        sender.send(good)
        sender.send(mixed)
        got = inbox.wait(2)

    assert got[0] == good  # every field, float32 logprobs included (they are exact binary fractions here)
    assert got[1].row_id == 12 and len(got[1].samples) == 1
    assert [d.field_name for d in got[1].dropped] == ["tokens", "loss_mask"]
    counts = receiver.snapshot_counts()
    assert counts["groups"] == 2 and counts["samples"] == 3 and counts["samples_dropped"] == 2
    assert counts["samples_dropped/tokens"] == 1 and counts["samples_dropped/loss_mask"] == 1
    assert [r for r, _ in drops] == ["invalid_sample", "invalid_sample"]


def test_malformed_and_unauthenticated_messages_are_dropped_whole(monkeypatch):
    inbox = _Inbox()
    receiver = GroupReceiver(inbox.add, auth_token="s3cret").start()
    try:
        context = zmq.Context.instance()
        raw = context.socket(zmq.PUSH)
        raw.connect(receiver.address)
        raw.send(b"\xff\xff not a protobuf")
        raw.close(linger=1000)
        with GroupSender(receiver.address, auth_token="wrong") as bad:
            bad.send(RolloutGroup(1, 0, [_sample()]))
        monkeypatch.setenv("FLEETRL_AUTH_TOKEN", "s3cret")
        with GroupSender(receiver.address) as good:  # the token from the environment
            good.send(RolloutGroup(2, 0, [_sample()]))
        got = inbox.wait(1)
    finally:
        receiver.stop()
    assert [g.row_id for g in got] == [2]
    counts = receiver.snapshot_counts()
    assert counts["messages_dropped/malformed"] == 1 and counts["messages_dropped/auth"] == 1


def test_a_failing_consumer_is_counted_and_the_stream_goes_on():
    seen: list[int] = []

    def consume(group: RolloutGroup) -> None:
        if group.row_id == 1:
            raise RuntimeError("boom")
        seen.append(group.row_id)

    receiver = GroupReceiver(consume).start()
    try:
        with GroupSender(receiver.address) as sender:
            sender.send(RolloutGroup(1, 0, [_sample()]))
            sender.send(RolloutGroup(2, 0, [_sample()]))
        inbox_deadline = threading.Event()
        for _ in range(100):
            if seen:
                break
            inbox_deadline.wait(0.05)
    finally:
        receiver.stop()
    receiver.check()
    assert seen == [2] and receiver.snapshot_counts()["messages_dropped/handler"] == 1


def test_send_without_a_receiver_times_out_with_a_clear_error(free_port):
    with (
        GroupSender(f"tcp://127.0.0.1:{free_port}", send_timeout_s=0.2) as sender,
        pytest.raises(GroupStreamError, match=r"timed out after 0\.2s"),
    ):
        sender.send(RolloutGroup(1, 0, [_sample()]))
