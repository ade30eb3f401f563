import pytest

from fleetrl.controller.members import MemberRegistry


def test_heartbeat_timeout_marks_dead_and_reregister_refreshes():
    reg = MemberRegistry(heartbeat_timeout_s=10)
    reg.register("gateway", "gw-1", "", now=0)
    reg.register("inference", "inf-1", "127.0.0.1:1", now=0)
    assert reg.heartbeat("gw-1", now=8)
    assert [m.member_id for m in reg.alive("gateway", now=15)] == ["gw-1"]
    assert reg.alive("inference", now=15) == []
    assert [m.member_id for m in reg.dead(now=15)] == ["inf-1"]
    reg.register("inference", "inf-1", "127.0.0.1:2", now=16)
    assert reg.alive("inference", now=16)[0].address == "127.0.0.1:2"
    assert not reg.heartbeat("unknown", now=16)


def test_fenced_replica_is_not_routed_until_it_loads():
    reg = MemberRegistry()
    reg.register("inference", "a", "h:1", now=0)
    reg.register("inference", "b", "h:2", now=0)
    reg.fence("a", "LoadWeights(3) timed out")
    assert [m.member_id for m in reg.routable_replicas(now=1)] == ["b"]
    reg.loaded("a", 3)
    assert {m.member_id for m in reg.routable_replicas(now=1)} == {"a", "b"}
    assert reg.members["a"].version == 3


def test_bad_registration_is_named():
    reg = MemberRegistry()
    with pytest.raises(ValueError, match="unknown member kind"):
        reg.register("worker", "x", "", now=0)
    with pytest.raises(ValueError, match="address"):
        reg.register("inference", "x", "", now=0)


def test_registering_again_at_the_same_address_keeps_the_replica_state():
    reg = MemberRegistry()
    reg.register("inference", "inference-0", "h:1", now=0)
    reg.loaded("inference-0", 4)
    reg.missed_poll("inference-0")
    again = reg.register("inference", "inference-0", "h:1", now=5)
    assert (again.version, again.fenced, again.missed_polls, again.last_seen) == (4, False, 1, 5)


def test_a_replica_back_at_another_address_is_a_new_process_at_the_base_model():
    # A restarted replica (fleetrl up gives it its old member id and a new port) serves version 0 again, whatever
    # the old entry knew: it must not be routed to as if it served the current version, nor skipped as unanswering.
    reg = MemberRegistry()
    reg.register("inference", "inference-0", "h:1", now=0)
    reg.loaded("inference-0", 4)
    for _ in range(3):
        reg.missed_poll("inference-0")
    reg.fence("inference-0", "did not answer Status 3 times in a row")
    new = reg.register("inference", "inference-0", "h:2", now=9)
    assert (new.address, new.version, new.missed_polls, new.last_seen) == ("h:2", 0, 0, 9)
    assert reg.members["inference-0"] is new and len(reg.members) == 1
    assert not new.fenced  # the servicer fences it when the run is past version 0 (test_lease_hold)
