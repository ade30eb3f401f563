"""A replica that failed a version both ways (through the group and over the stream) is kept out of the next group
builds while it is named again at the same address (fleetrl.weights.engine_sync, `probation`): a dead replica the
controller has not yet seen die would otherwise hold every build's rendezvous until its timeout (60 s a push,
measured in tests/integration/up/test_engine_weights_up.py). It is offered each version over the stream, and rejoins
the group at the next push once a stream load succeeds; one that left (or restarted at a new address) starts fresh.
Pure: the scripted transport of test_engine_sync."""

from __future__ import annotations

from fleetrl.weights.engine_sync import EngineSync, ReplicaInfo
from tests.unit.weights.test_engine_sync import ScriptedTransport


def builds(transport: ScriptedTransport) -> list[tuple[str, ...]]:
    return [call[1] for call in transport.calls if call[0] == "build"]


def failing_fleet() -> tuple[EngineSync, ScriptedTransport]:
    """Replicas a and b; version 1's transfer fails and b cannot load it over the stream either."""
    transport = ScriptedTransport()
    sync = EngineSync(transport)
    sync.join(ReplicaInfo("a"))
    sync.join(ReplicaInfo("b"))
    transport.fail_send, transport.fail_stream = True, {"b"}
    outcome = sync.push(1)
    assert (outcome.stream, outcome.failed) == (["a"], ["b"])
    transport.fail_send = False
    return sync, transport


def test_a_replica_that_failed_both_ways_is_kept_out_of_the_next_build_while_named_again():
    sync, transport = failing_fleet()
    sync.join(ReplicaInfo("b"))  # named again by the next push (the controller has not seen it die)
    outcome = sync.push(2)
    assert builds(transport) == [("a", "b"), ("a",)]  # the group is built without it
    assert (outcome.engine, outcome.stream, outcome.failed) == (["a"], [], ["b"])
    assert ("stream", "b", 2) in transport.calls  # still offered the version, over the stream
    assert sync.served_version == 2  # the fleet that counts: a


def test_it_rejoins_the_group_once_a_stream_load_succeeds():
    sync, transport = failing_fleet()
    transport.fail_stream = set()  # it was only slow: loads over the stream now
    outcome = sync.push(2)
    assert (outcome.engine, outcome.stream, outcome.failed) == (["a"], ["b"], [])
    assert sync.served_version == 2
    outcome = sync.push(3)
    assert builds(transport) == [("a", "b"), ("a",), ("a", "b")]
    assert (outcome.engine, outcome.stream) == (["a", "b"], [])


def test_a_replica_restarted_elsewhere_starts_fresh():
    sync, transport = failing_fleet()
    sync.leave("b")  # restarted at a new address: the driver makes it leave and join again
    sync.join(ReplicaInfo("b"))
    outcome = sync.push(2)
    assert builds(transport)[-1] == ("a", "b") and outcome.engine == ["a", "b"]


def test_a_fleet_of_replicas_on_probation_only_builds_no_group():
    transport = ScriptedTransport()
    sync = EngineSync(transport)
    sync.join(ReplicaInfo("b"))
    transport.fail_send, transport.fail_stream = True, {"b"}
    sync.push(1)
    outcome = sync.push(2)
    assert builds(transport) == [("b",)] and outcome.failed == ["b"]
