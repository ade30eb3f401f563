"""The replica fleet's state machine (fleetrl.controller.fleet) and its races, fed events and a clock: no sockets.

Each test plays the events the orchestrator would report (Status replies and misses, load outcomes, joins) in the
order a race delivers them, and checks the fleet's decisions: who is fenced, what is loaded from where, when."""

from __future__ import annotations

import pytest

from fleetrl.controller.fleet import Load, ReplicaFleet
from fleetrl.controller.members import MemberRegistry

TRAINER = "trainer:7000"


def fleet_of(*ids: str, pushed: int = 0, **kwargs) -> ReplicaFleet:
    members = MemberRegistry(heartbeat_timeout_s=30)
    for i, member_id in enumerate(ids):
        members.register("inference", member_id, f"h:{i}", now=0)
    fleet = ReplicaFleet(members, catch_up_backoff_s=2.0, catch_up_backoff_max_s=60.0, **kwargs)
    if pushed:
        push = fleet.start_push(pushed, TRAINER, now=0)
        for load in push.loads:
            assert fleet.load_succeeded(load, pushed)
        assert fleet.finish_push(push, now=0) is None
    return fleet


def answer(fleet: ReplicaFleet, member_id: str, loaded: int, now: float) -> Load | None:
    member = fleet.members.members[member_id]
    return fleet.status_answered(member, fleet.poll_sent(member), loaded, "", 0, now)


def routable(fleet: ReplicaFleet, now: float = 0) -> list[str]:
    return [m.member_id for m in fleet.members.routable_replicas(now)]


# --- the plain paths -----------------------------------------------------------------------------------------------
def test_a_push_loads_every_replica_and_makes_its_version_the_runs():
    fleet = fleet_of("a", "b", pushed=3)
    assert fleet.pushed_version == 3 and fleet.weights_source == TRAINER
    assert routable(fleet) == ["a", "b"]
    assert {m.version for m in fleet.members.members.values()} == {3}
    assert fleet.loading == {}


def test_a_replica_behind_the_run_is_fenced_and_caught_up_from_the_trainer():
    fleet = fleet_of("a", "b", pushed=3)
    load = answer(fleet, "b", 2, now=1)  # it serves an older version (it missed a push)
    assert routable(fleet) == ["a"]
    assert load is not None and (load.member.member_id, load.version, load.plan.source) == ("b", 3, TRAINER)
    assert answer(fleet, "b", 2, now=2) is None  # one load at a time: the catch-up is in flight
    assert fleet.load_succeeded(load, 3)
    assert routable(fleet) == ["a", "b"]


def test_a_joining_replica_is_fenced_until_it_serves_the_runs_version():
    fleet = fleet_of("a", pushed=3)
    joined = fleet.members.register("inference", "c", "h:9", now=1)
    fleet.joined(joined)
    assert routable(fleet, now=1) == ["a"]
    assert answer(fleet, "c", 3, now=2) is None  # it loaded the version by itself (the poll sees it)
    assert routable(fleet, now=2) == ["a", "c"]


def test_one_that_stops_answering_is_fenced_after_two_missed_polls_and_back_once_it_answers():
    fleet = fleet_of("a", "b", pushed=1)
    b = fleet.members.members["b"]
    fleet.status_missed(b, "DEADLINE_EXCEEDED")
    assert routable(fleet) == ["a", "b"]
    fleet.status_missed(b, "DEADLINE_EXCEEDED")
    assert routable(fleet) == ["a"] and "did not answer Status 2 times" in b.fence_reason
    assert answer(fleet, "b", 1, now=3) is None
    assert routable(fleet, now=3) == ["a", "b"]


def test_only_replicas_that_all_answered_and_refused_fail_the_run():
    fleet = fleet_of("a", "b", pushed=1)
    push = fleet.start_push(2, TRAINER, now=1)
    for load in push.loads:
        fleet.load_failed(load, "INVALID_ARGUMENT", "bad checksum", now=1, push=push)
    assert fleet.finish_push(push, now=1) == "every inference replica failed to load version 2"

    gone = fleet_of("a", "b", pushed=1)
    push = gone.start_push(2, TRAINER, now=1)
    for load in push.loads:
        gone.load_failed(load, "UNAVAILABLE", "connection refused", now=1, push=push)
    assert gone.finish_push(push, now=1) is None  # restarting, not refusing: the run waits for one to answer
    assert gone.pushed_version == 2 and routable(gone, now=1) == []


# --- a reply from an old process -----------------------------------------------------------------------------------
def test_a_late_reply_from_the_old_process_does_not_unfence_its_successor():
    fleet = fleet_of("a", pushed=3)
    old = fleet.members.members["a"]
    token = fleet.poll_sent(old)
    new = fleet.members.register("inference", "a", "h:new", now=1)  # restarted: base model, another port
    fleet.joined(new)
    assert fleet.status_answered(old, token, 3, "", 0, now=2) is None  # the old process: "version 3"
    assert new.fenced and new.version == 0 and routable(fleet, now=2) == []


def test_a_late_timeout_from_the_old_process_is_no_miss_against_its_successor():
    fleet = fleet_of("a", "b", pushed=0)  # no push yet: a restarted replica is not fenced for its version
    old = fleet.members.members["a"]
    new = fleet.members.register("inference", "a", "h:new", now=1)
    fleet.status_missed(old, "DEADLINE_EXCEEDED")  # the old process's poll times out after the restart
    assert new.missed_polls == 0
    fleet.status_missed(new, "UNAVAILABLE")  # one miss of its own does not fence it (before: two counted)
    assert routable(fleet, now=1) == ["a", "b"]


def test_a_load_that_ends_for_the_old_process_changes_nothing_for_its_successor():
    fleet = fleet_of("a", pushed=2)
    load = answer(fleet, "a", 1, now=1)  # behind: caught up
    assert load is not None
    new = fleet.members.register("inference", "a", "h:new", now=2)
    fleet.joined(new)
    assert not fleet.load_succeeded(load, 2)  # the old process loaded it; the new one serves the base model
    assert new.fenced and routable(fleet, now=2) == []
    assert fleet.status_answered(new, fleet.poll_sent(new), 0, "", 0, now=3) is not None  # its own catch-up


# --- a push and a fence crossing -----------------------------------------------------------------------------------
def test_a_status_reply_sent_before_a_push_landed_does_not_fence_the_replica_it_brought_up_to_date():
    fleet = fleet_of("a", "b", pushed=1)
    a = fleet.members.members["a"]
    token = fleet.poll_sent(a)  # Status to "a" is sent; it answers from before the swap: "version 1"
    push = fleet.start_push(2, TRAINER, now=1)
    for load in push.loads:
        fleet.load_succeeded(load, 2)
    assert fleet.finish_push(push, now=1) is None
    # The reply arrives after the push landed: stale, it must not fence "a" and push version 2 to it again.
    assert fleet.status_answered(a, token, 1, "", 0, now=2) is None
    assert routable(fleet, now=2) == ["a", "b"] and a.version == 2


def test_a_status_reply_sent_before_a_push_failed_does_not_unfence_the_replica():
    fleet = fleet_of("a", "b", pushed=1)
    a = fleet.members.members["a"]
    token = fleet.poll_sent(a)
    push = fleet.start_push(2, TRAINER, now=1)
    a_load, b_load = push.loads
    fleet.load_failed(a_load, "INTERNAL", "out of memory", now=1, push=push)
    assert a.fenced
    # Its Status reply, sent before the failure, says "version 1", which is the run's version until the push
    # ends: it must not put "a" back in rotation while "b" is still loading.
    fleet.status_answered(a, token, 1, "", 0, now=2)
    assert a.fenced
    fleet.load_succeeded(b_load, 2)
    assert fleet.finish_push(push, now=2) is None and routable(fleet, now=2) == ["b"]


def test_a_catch_up_to_the_previous_version_that_lands_during_a_push_leaves_the_replica_fenced():
    fleet = fleet_of("a", "b", pushed=1)
    catch_up = answer(fleet, "b", 0, now=1)  # "b" is behind: a catch-up to version 1 starts
    assert catch_up is not None and catch_up.version == 1
    push = fleet.start_push(2, TRAINER, now=1)
    assert [load.member.member_id for load in push.loads] == ["a"]  # "b" is still loading: skipped
    fleet.load_succeeded(catch_up, 1)  # it lands mid-push: version 1 is still the run's
    fleet.load_succeeded(push.loads[0], 2)
    assert fleet.finish_push(push, now=1) is None
    b = fleet.members.members["b"]
    assert b.fenced and "the run is at 2" in b.fence_reason and routable(fleet, now=1) == ["a"]
    load = answer(fleet, "b", 1, now=2)  # the next poll catches it up to version 2
    assert load is not None and load.version == 2


def test_a_replica_that_stops_answering_during_a_push_is_abandoned_and_fenced():
    fleet = fleet_of("a", "b", pushed=1)
    push = fleet.start_push(2, TRAINER, now=1)
    a_load, b_load = push.loads
    for _ in range(2):
        fleet.status_missed(b_load.member, "DEADLINE_EXCEEDED")
    assert not fleet.unresponsive(a_load) and fleet.unresponsive(b_load)
    fleet.push_abandoned(b_load)
    fleet.load_cancelled(b_load)
    fleet.load_succeeded(a_load, 2)
    assert fleet.finish_push(push, now=1) is None
    assert routable(fleet, now=1) == ["a"] and fleet.loading == {}


# --- a replica that keeps refusing catch-up ------------------------------------------------------------------------
def test_a_replica_that_keeps_refusing_catch_up_backs_off_exponentially_up_to_a_bound():
    fleet = fleet_of("a", "b", pushed=3)
    now, waits = 0.0, []
    load = answer(fleet, "b", 0, now=now)
    for _ in range(9):
        assert load is not None
        fleet.load_failed(load, "INTERNAL", "refused", now=now)
        first_try = now
        load = answer(fleet, "b", 0, now=now)  # polled at once: is it tried again already?
        while load is None:
            now += 1.0  # polls every second
            load = answer(fleet, "b", 0, now=now)
        waits.append(now - first_try)
    assert waits == [0, 2, 4, 8, 16, 32, 60, 60, 60]  # the first at the next poll, then doubling, at most 60 s
    assert fleet.load_succeeded(load, 3)
    b = fleet.members.members["b"]
    assert not b.fenced and b.version == 3


def test_success_or_a_new_process_starts_the_back_off_over():
    fleet = fleet_of("a", "b", pushed=3)
    for _ in range(4):
        load = answer(fleet, "b", 0, now=100)
        if load is None:
            load = fleet.catch_up(fleet.members.members["b"], 0, now=10_000)
        fleet.load_failed(load, "INTERNAL", "refused", now=100)
    assert answer(fleet, "b", 0, now=101) is None  # 4 in a row: waiting 8 s
    new = fleet.members.register("inference", "b", "h:new", now=101)  # restarted: a new process
    fleet.joined(new)
    assert answer(fleet, "b", 0, now=101) is not None  # tried at once

    fleet = fleet_of("a", "b", pushed=3)
    for _ in range(3):
        load = answer(fleet, "b", 0, now=0) or fleet.catch_up(fleet.members.members["b"], 0, now=10_000)
        fleet.load_failed(load, "INTERNAL", "refused", now=0)
    load = fleet.catch_up(fleet.members.members["b"], 0, now=10_000)
    fleet.load_succeeded(load, 3)
    fleet.members.members["b"].fenced = True  # it misses a later push ...
    load = answer(fleet, "b", 0, now=10_001)
    fleet.load_failed(load, "INTERNAL", "refused", now=10_001)
    assert answer(fleet, "b", 0, now=10_001) is not None  # ... and its first refusal is retried at once again


def test_a_catch_up_overtaken_by_a_newer_push_is_not_a_refusal():
    fleet = fleet_of("a", "b", pushed=1)
    load = answer(fleet, "b", 0, now=1)
    fleet.pushed_version = 2  # a newer version went out meanwhile
    assert not fleet.load_succeeded(load, 1)
    b = fleet.members.members["b"]
    assert b.fenced and b.version == 1
    again = answer(fleet, "b", 1, now=1)
    assert again is not None and again.version == 2


# --- members that never return -------------------------------------------------------------------------------------
def test_a_joined_replica_that_never_returns_is_dropped_and_a_configured_one_is_kept():
    fleet = fleet_of("inference-0", pushed=1, configured=["inference-0"], forget_after_s=300)
    joined = fleet.members.register("inference", "inference-extra", "h:9", now=10)
    fleet.joined(joined)
    load = answer(fleet, "inference-extra", 0, now=10)
    assert load is not None and fleet.load_in_flight(joined)
    assert fleet.forget_silent(now=310) == []  # silent for exactly 300 s: not yet
    assert [m.member_id for m in fleet.forget_silent(now=311)] == ["inference-extra"]
    assert list(fleet.members.members) == ["inference-0"]  # the configured one, as silent, stays
    assert fleet.loading == {}
    fleet.load_failed(load, "UNAVAILABLE", "gone", now=312)  # its load ends late: nothing to fence
    assert "inference-extra" not in fleet.members.members
    push = fleet.start_push(2, TRAINER, now=312)
    assert [load.member.member_id for load in push.loads] == []  # nor pushed (the configured one is dead too)
    back = fleet.members.register("inference", "inference-extra", "h:9", now=400)  # it comes back: registers
    fleet.joined(back)
    assert back.fenced and answer(fleet, "inference-extra", 0, now=400) is not None


def test_a_heartbeating_replica_is_not_dropped():
    fleet = fleet_of(pushed=1, forget_after_s=300)
    fleet.members.register("inference", "x", "h:9", now=0)
    for now in range(0, 1000, 2):
        fleet.members.heartbeat("x", now)
        assert fleet.forget_silent(now) == []


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="catch_up_backoff_s"):
        ReplicaFleet(MemberRegistry(), catch_up_backoff_s=0)
    with pytest.raises(ValueError, match="forget_after_s"):
        ReplicaFleet(MemberRegistry(), forget_after_s=0)


def test_a_replica_that_loaded_through_its_relay_is_the_source_of_the_next_catch_up():
    members = MemberRegistry(heartbeat_timeout_s=30)
    for member_id in ("a", "b"):
        members.register("inference", member_id, f"h:{member_id}", now=0)
    fleet = ReplicaFleet(members, weight_fanout="chain")
    for member_id in ("a", "b"):
        fleet.status_answered(members.members[member_id], 0, 0, f"relay-{member_id}", 0, now=0)
    push = fleet.start_push(1, TRAINER, now=0)
    assert [(load.plan.source, load.plan.relay) for load in push.loads] == [(TRAINER, True), ("relay-a", True)]
    for load in push.loads:
        fleet.load_succeeded(load, 1)
    assert fleet.finish_push(push, now=0) is None
    joined = members.register("inference", "c", "h:c", now=1)
    fleet.joined(joined)
    load = fleet.status_answered(joined, 0, 0, "relay-c", 0, now=1)  # before any poll says "a" holds version 1
    assert load is not None and load.plan.source == "relay-a" and load.plan.relay
