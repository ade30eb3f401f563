"""The engine-driving logic (fleetrl.weights.engine_sync), pure: the engine chosen from the layout, the group built
once and again only after a join, a leave or a failure, the weight stream as the fallback, and a version counted
only once every replica serves it. The transport is a scripted fake recording what it was asked; the same flow with
real gloo groups and a vLLM replica: tests/integration/inference/test_vllm_engine_group.py."""

from __future__ import annotations

import pytest

from fleetrl.weights.engine_sync import EngineLayout, EngineSync, ReplicaInfo, choose_engine


@pytest.mark.parametrize(
    ("layout", "engine"),
    [
        (EngineLayout("cuda", "cuda", colocated=True), "ipc"),
        (EngineLayout("cuda", "cuda", trainer_world_size=8, replica_tensor_parallel=4), "nccl_m2n"),
        (EngineLayout("cuda", "cuda", trainer_world_size=8, replica_tensor_parallel=1), "nccl"),
        (EngineLayout("cuda", "cuda", trainer_world_size=1, replica_tensor_parallel=4), "nccl"),
        (EngineLayout("cpu", "cpu", trainer_world_size=2, replica_tensor_parallel=2), "fleetrl_gloo"),
        (EngineLayout("cuda", "cpu"), "fleetrl_zmq"),
        (EngineLayout("cuda", "cuda", adapter=True), "fleetrl_zmq"),
    ],
)
def test_the_engine_follows_the_layout(layout, engine):
    assert choose_engine(layout) == engine


def test_a_layout_with_no_ranks_is_refused():
    with pytest.raises(ValueError, match="replica_tensor_parallel"):
        choose_engine(EngineLayout("cuda", "cuda", replica_tensor_parallel=0))


class ScriptedTransport:
    """Records every call; `fail_build`, `fail_send` and `fail_stream` (replica names) script the failures."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail_build = False
        self.fail_send = False
        self.fail_stream: set[str] = set()

    def build(self, replicas, rank_offsets, world_size):
        self.calls.append(("build", tuple(r.name for r in replicas), dict(rank_offsets), world_size))
        if self.fail_build:
            raise TimeoutError("rendezvous timed out")

    def send(self, version):
        self.calls.append(("send", version))
        if self.fail_send:
            raise RuntimeError("connection reset by peer")

    def teardown(self):
        self.calls.append(("teardown",))

    def stream_load(self, replica, version):
        self.calls.append(("stream", replica, version))
        if replica in self.fail_stream:
            raise RuntimeError("replica gone")

    def kinds(self):
        return [c[0] for c in self.calls]


def test_the_group_is_built_once_and_reused_then_rebuilt_after_a_join_and_a_leave():
    transport = ScriptedTransport()
    sync = EngineSync(transport)
    sync.join(ReplicaInfo("a", workers=2))
    sync.join(ReplicaInfo("b"))
    for version in (1, 2, 3):
        outcome = sync.push(version)
        assert outcome.engine == ["a", "b"] and outcome.stream == [] and outcome.served_by_all
    assert transport.calls[0] == ("build", ("a", "b"), {"a": 1, "b": 3}, 4)  # TP=2: a's two workers take 1 and 2
    assert transport.kinds() == ["build", "send", "send", "send"]
    assert sync.builds == 1 and sync.served_version == 3

    sync.join(ReplicaInfo("c"))
    sync.push(4)
    assert transport.calls[-3:] == [("teardown",), ("build", ("a", "b", "c"), {"a": 1, "b": 3, "c": 4}, 5), ("send", 4)]
    sync.leave("a")
    sync.push(5)
    assert transport.calls[-3:] == [("teardown",), ("build", ("b", "c"), {"b": 1, "c": 2}, 3), ("send", 5)]
    assert sync.builds == 3 and sync.served_version == 5


def test_a_failed_transfer_loads_the_version_over_the_stream_and_the_next_push_builds_a_new_group():
    transport = ScriptedTransport()
    sync = EngineSync(transport)
    sync.join(ReplicaInfo("a"))
    sync.join(ReplicaInfo("b"))
    sync.push(1)
    transport.fail_send = True
    outcome = sync.push(2)
    assert outcome.engine == [] and outcome.stream == ["a", "b"] and "connection reset" in outcome.error
    assert transport.calls[-4:] == [("send", 2), ("teardown",), ("stream", "a", 2), ("stream", "b", 2)]
    assert sync.fallbacks == 1 and sync.served_version == 2 and sync.group is None
    transport.fail_send = False
    assert sync.push(3).engine == ["a", "b"]
    assert transport.kinds()[-2:] == ["build", "send"] and sync.builds == 2


def test_replicas_a_failed_transfer_reached_whole_count_as_served_and_only_the_others_use_the_stream():
    class Partial(RuntimeError):
        served = ("a", "stranger")  # a name outside the group is ignored

    transport = ScriptedTransport()
    sync = EngineSync(transport)
    sync.join(ReplicaInfo("a"))
    sync.join(ReplicaInfo("b"))
    transport.send = lambda version: (_ for _ in ()).throw(Partial("b died"))
    outcome = sync.push(1)
    assert outcome.engine == ["a"] and outcome.stream == ["b"] and sync.served_version == 1
    assert ("stream", "a", 1) not in transport.calls


def test_a_failed_build_falls_back_to_the_stream_and_is_tried_again_at_the_next_push():
    transport = ScriptedTransport()
    transport.fail_build = True
    sync = EngineSync(transport)
    sync.join(ReplicaInfo("a"))
    outcome = sync.push(1)
    assert outcome.stream == ["a"] and "rendezvous" in outcome.error and "send" not in transport.kinds()
    transport.fail_build = False
    assert sync.push(2).engine == ["a"] and sync.builds == 1


def test_a_replica_that_died_mid_transfer_is_dropped_and_the_version_counts_once_the_others_serve_it():
    transport = ScriptedTransport()
    sync = EngineSync(transport)
    for name in ("a", "b"):
        sync.join(ReplicaInfo(name))
    sync.push(1)
    transport.fail_send = True
    transport.fail_stream = {"b"}  # b died: the broadcast broke and it cannot load over the stream either
    outcome = sync.push(2)
    assert outcome.stream == ["a"] and outcome.failed == ["b"] and not outcome.served_by_all
    assert list(sync.replicas) == ["a"] and sync.served_version == 2
    transport.fail_send = False
    sync.push(3)
    # The group is built without b; b, on probation, is only offered the version over the stream
    # (test_engine_sync_probation.py).
    assert transport.calls[-3:] == [("build", ("a",), {"a": 1}, 2), ("send", 3), ("stream", "b", 3)]


def test_a_version_is_not_counted_until_every_replica_serves_it():
    transport = ScriptedTransport()
    sync = EngineSync(transport)
    sync.join(ReplicaInfo("a"))
    assert sync.served_version is None
    sync.push(1)
    sync.join(ReplicaInfo("late"))  # joined after version 1: serves nothing yet
    assert sync.served_version is None
    transport.fail_build = True
    transport.fail_stream = {"late"}
    sync.push(2)
    assert sync.served_version == 2 and list(sync.replicas) == ["a"]


def test_a_push_to_no_replica_does_nothing():
    transport = ScriptedTransport()
    assert EngineSync(transport).push(1).engine == [] and transport.calls == []
