"""Where each replica fetches a pushed version from (fleetrl.controller.push_plan) and which peer a joining replica
fetches from (MemberRegistry.relay_source)."""

import pytest

from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.push_plan import PushSource, push_sources

TRAINER = "tcp://trainer:5555"
REPLICAS = [("a", "tcp://a:1"), ("b", "tcp://b:1"), ("c", "tcp://c:1")]


def test_direct_is_todays_push_everyone_from_the_trainer_without_relaying():
    assert push_sources(REPLICAS, "direct", TRAINER) == {m: PushSource(TRAINER, False) for m, _ in REPLICAS}


def test_a_chain_sends_one_copy_from_the_trainer_and_each_replica_relays_to_the_next():
    assert push_sources(REPLICAS, "chain", TRAINER) == {
        "a": PushSource(TRAINER, True),
        "b": PushSource("tcp://a:1", True),
        "c": PushSource("tcp://b:1", True),
    }


def test_a_tree_relays_to_two():
    plan = push_sources([*REPLICAS, ("d", "tcp://d:1")], "tree", TRAINER)
    assert [plan[m].source for m in "abcd"] == [TRAINER, "tcp://a:1", "tcp://a:1", "tcp://b:1"]


def test_a_replica_that_names_no_relay_fetches_from_the_trainer_and_is_nobodys_upstream():
    plan = push_sources([("a", "tcp://a:1"), ("x", ""), ("c", "tcp://c:1")], "chain", TRAINER)
    assert plan == {
        "a": PushSource(TRAINER, True),
        "x": PushSource(TRAINER, False),
        "c": PushSource("tcp://a:1", True),
    }


def test_a_replica_appended_changes_nobody_elses_source():
    before = push_sources(REPLICAS, "chain", TRAINER)
    after = push_sources([*REPLICAS, ("d", "tcp://d:1")], "chain", TRAINER)
    assert {m: after[m] for m in before} == before and after["d"] == PushSource("tcp://c:1", True)


def test_from_peer_and_an_unknown_fanout():
    assert PushSource("tcp://a:1", True).from_peer(TRAINER) and not PushSource(TRAINER, True).from_peer(TRAINER)
    with pytest.raises(ValueError, match="weight_fanout must be one of"):
        push_sources(REPLICAS, "star", TRAINER)


def test_relay_source_is_a_routable_peer_whose_relay_holds_the_version():
    members = MemberRegistry(heartbeat_timeout_s=30)
    for name, version in (("a", 3), ("b", 2), ("c", 3), ("d", 3)):
        member = members.register("inference", name, f"{name}:50051", 0.0)
        member.relay_address, member.relay_version = f"tcp://{name}:1", version
    members.fence("a", "serves version 2")
    members.members["d"].relay_address = ""
    assert members.relay_source(3, 1.0).member_id == "c"  # a is fenced, b holds 2, d serves no relay
    assert members.relay_source(3, 1.0, exclude="c") is None
    assert members.relay_source(3, 100.0) is None  # nobody is alive
