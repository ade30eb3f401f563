from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.journal import Journal
from fleetrl.controller.scheduler import RowScheduler

ROWS = [{"q": i} for i in range(8)]


def make(p=2, g=2, o=1, journal=None, rows=ROWS, epochs=1, **kw):
    cursor = DatasetCursor(rows, epochs=epochs, shuffle=False)
    gate = OffPolicyGate(p, g, o)
    return RowScheduler(cursor, gate, prompt_groups_per_step=p, journal=journal, **kw)


def test_leases_bounded_by_gate_and_steps_form_in_order():
    s = make(p=2, g=2, o=1)
    leases = s.lease("gw", 10, now=0)
    assert len(leases) == 4  # (v + O + 1) * B / G = 2 * 4 / 2 rows
    assert {lease.submit_version for lease in leases} == {0}
    for lease in leases[:2]:
        assert s.report(lease.row_id, "accepted", now=1) == "accepted"
    step = s.take_step()
    assert step.step == 1 and step.row_ids == (0, 1) and step.version_offsets == (0, 0)
    assert s.take_step() is None
    assert s.lease("gw", 10, now=2) == []  # gate full until a version is published
    s.step_trained(step)
    s.publish(1)
    assert len(s.lease("gw", 10, now=3)) == 2


def test_expired_lease_requeues_row_and_late_report_is_ignored():
    s = make(p=1, g=2, o=0, lease_timeout_s=10)
    (lease,) = s.lease("gw-a", 5, now=0)
    assert s.lease("gw-b", 5, now=5) == []
    (again,) = s.lease("gw-b", 5, now=11)  # gw-a's lease expired
    assert again.row_id == lease.row_id and again.attempt == 2
    assert s.report(lease.row_id, "accepted", now=12, gateway_id="gw-a") == "late"
    assert s.report(again.row_id, "accepted", now=12, gateway_id="gw-b") == "accepted"
    assert s.counters["rows_requeued_expired"] == 1 and s.counters["late_reports"] == 1
    assert s.take_step().row_ids == (lease.row_id,)


def test_rejected_row_is_replaced_and_failed_row_retried_then_given_up():
    s = make(p=1, g=2, o=0, max_attempts=2)
    (a,) = s.lease("gw", 5, now=0)
    assert s.report(a.row_id, "rejected", now=1) == "rejected"
    (b,) = s.lease("gw", 5, now=1)
    assert b.row_id != a.row_id  # a replacement row, the rejected one is closed
    assert s.report(b.row_id, "failed", now=2) == "retry"
    (c,) = s.lease("gw", 5, now=2)
    assert c.row_id == b.row_id
    assert s.report(c.row_id, "failed", now=3) == "failed"
    assert s.counters["rows_rejected"] == 1 and s.counters["rows_failed"] == 1


def test_stale_group_is_requeued_not_trained():
    s = make(p=1, g=2, o=1)
    leases = s.lease("gw", 5, now=0)  # two rows at version 0 (O=1)
    assert len(leases) == 2
    # The first group's tokens were (wrongly) produced by a replica two versions behind the second step.
    s.report(leases[0].row_id, "accepted", now=1)
    step1 = s.take_step()
    s.step_trained(step1)
    s.publish(1)
    # leases[1] joins step 2 (trains against version 1); a token from version -1 would be 2 behind: stale.
    assert s.report(leases[1].row_id, "accepted", now=2, min_version=-1) == "stale"
    assert s.counters["rows_requeued_stale"] == 1
    (again,) = [lease for lease in s.lease("gw", 5, now=3) if lease.row_id == leases[1].row_id]
    assert again.submit_version == 1


def test_stale_policy_train_keeps_the_group():
    s = make(p=1, g=2, o=0, stale_policy="train")
    (a,) = s.lease("gw", 5, now=0)
    assert s.report(a.row_id, "accepted", now=1, min_version=-3) == "accepted"
    assert s.take_step().version_offsets == (3,)


def test_max_steps_limits_leases_and_final_partial_step():
    s = make(p=2, g=2, o=3, max_steps=1)
    assert len(s.lease("gw", 10, now=0)) == 2
    s2 = make(p=2, g=2, o=3, rows=ROWS[:3])
    leases = s2.lease("gw", 10, now=0)
    assert len(leases) == 3
    for lease in leases:
        s2.report(lease.row_id, "accepted", now=1)
    assert s2.take_step().row_ids == (0, 1)
    last = s2.take_step()
    assert last.row_ids == (2,)  # data used up, nothing in flight: the partial step is trained too
    s2.step_trained(last)
    assert s2.finished()


def test_every_row_trained_once_or_closed_with_journal_resume(tmp_path):
    journal = Journal(tmp_path / "ledger.sqlite")
    s = make(p=2, g=2, o=1, journal=journal, rows=ROWS, lease_timeout_s=5)
    leases = s.lease("gw", 10, now=0)
    for lease in leases[:3]:
        s.report(lease.row_id, "accepted", now=1)
    step = s.take_step()
    s.step_trained(step)
    s.publish(1)
    journal.close()

    # The controller restarts: rows not yet trained return to the queue; version and cursor come back.
    journal = Journal(tmp_path / "ledger.sqlite")
    r = RowScheduler.resume(
        journal,
        ROWS,
        gate_factory=lambda v: OffPolicyGate(2, 2, 1, version=v),
        cursor_kwargs={"shuffle": False},
        prompt_groups_per_step=2,
    )
    assert r.gate.version == 1 and r.next_step == 2
    now = 10
    while not r.finished():
        for lease in r.lease("gw", 10, now=now):
            r.report(lease.row_id, "rejected" if lease.row_id == 7 else "accepted", now=now)
        while (st := r.take_step()) is not None:
            r.step_trained(st)
            r.publish(r.gate.version + 1)
        now += 1
        assert now < 100, "scheduler did not finish"
    ledger = journal.rows()
    assert set(ledger) == set(range(8))
    for row_id, info in ledger.items():
        if row_id == 7:
            assert info["status"] == "rejected"
        else:
            assert info["status"] == "trained" and info["trained_count"] == 1


def test_max_steps_counts_steps_being_trained():
    # A step handed to the trainer but not yet trained still uses its rows' share of the budget.
    s = make(p=1, g=2, o=3, max_steps=2)
    leases = s.lease("gw", 10, now=0)
    assert len(leases) == 2
    s.report(leases[0].row_id, "accepted", now=1)
    step = s.take_step()  # in training now
    assert step.step == 1
    assert s.lease("gw", 10, now=2) == []  # row 2 is still leased: the budget of 2 steps is used
    s.report(leases[1].row_id, "failed", now=3)  # requeued: its slot may be leased again
    again = s.lease("gw", 10, now=3)
    assert [lease.row_id for lease in again] == [leases[1].row_id]


def test_release_gateway_requeues_only_its_rows():
    s = make(p=2, g=2, o=1)
    a = s.lease("gw-a", 2, now=0)
    b = s.lease("gw-b", 2, now=0)
    assert sorted(s.release_gateway("gw-a")) == sorted(lease.row_id for lease in a)
    assert set(s.leases) == {lease.row_id for lease in b}
    assert s.counters["rows_requeued_expired"] == 2
    again = s.lease("gw-b", 2, now=1)
    assert {lease.row_id for lease in again} == {lease.row_id for lease in a}


def test_a_row_stale_on_every_attempt_is_closed_not_requeued_forever():
    s = make(p=1, g=2, o=0, max_attempts=2)
    for expected in ("stale", "failed"):
        (lease,) = s.lease("gw", 1, now=0)
        assert s.report(lease.row_id, "accepted", now=1, min_version=-5) == expected
    assert s.counters["rows_failed_stale"] == 1
    (fresh,) = s.lease("gw", 1, now=2)
    assert fresh.row_id != lease.row_id


def test_superseded_attempts_are_named_for_eviction_and_steps_name_their_attempt():
    # The gateway sends a group before reporting it, so a stale attempt is already at the trainer: the scheduler
    # names it as superseded, and the step that trains the row names the fresh attempt.
    s = make(p=1, g=2, o=0)
    (first,) = s.lease("gw", 1, now=0)
    assert s.report(first.row_id, "accepted", now=1, min_version=0) == "accepted"
    step1 = s.take_step()
    assert step1.groups == ((first.row_id, 1),)
    s.step_trained(step1)
    s.publish(1)
    (stale,) = s.lease("gw", 1, now=2)
    assert s.report(stale.row_id, "accepted", now=3, min_version=0) == "stale"  # step 2 trains against v1
    assert s.take_superseded() == [(stale.row_id, 1)]
    assert s.take_superseded() == []  # handed over once
    (fresh,) = s.lease("gw", 1, now=4)
    assert (fresh.row_id, fresh.attempt) == (stale.row_id, 2)
    assert s.report(fresh.row_id, "accepted", now=5, min_version=1) == "accepted"
    assert s.take_step().groups == ((fresh.row_id, 2),)


def test_expired_and_failed_attempts_are_superseded():
    s = make(p=1, g=2, o=0, lease_timeout_s=10)
    (a,) = s.lease("gw", 1, now=0)
    s.expire(now=11)
    (b,) = s.lease("gw", 1, now=11)
    assert s.report(b.row_id, "failed", now=12) == "retry"
    assert s.take_superseded() == [(a.row_id, 1), (b.row_id, 2)]


def test_a_report_of_an_older_attempt_is_late_even_from_the_same_gateway():
    # Attempt 1's lease expired and the same gateway leased the row again: attempt 1's report (checked against an
    # older version) must not be taken for attempt 2's.
    s = make(p=1, g=2, o=0, lease_timeout_s=10)
    (a,) = s.lease("gw", 1, now=0)
    (b,) = s.lease("gw", 1, now=11)
    assert b.row_id == a.row_id and b.attempt == 2
    assert s.report(a.row_id, "accepted", now=12, gateway_id="gw", attempt=1) == "late"
    assert s.report(b.row_id, "accepted", now=12, gateway_id="gw", attempt=2) == "accepted"
    assert s.take_step().groups == ((b.row_id, 2),)


def test_each_lease_gets_a_random_tag_that_its_step_names():
    s = make(p=2, g=2, o=1)
    leases = s.lease("gw", 2, now=0)
    assert len({lease.tag for lease in leases}) == 2 and all(lease.tag > 0 for lease in leases)
    for lease in leases:
        s.report(lease.row_id, "accepted", now=1)
    step = s.take_step()
    assert step.refs == tuple((lease.row_id, 1, lease.tag) for lease in leases)


def test_dropped_samples_and_rejection_causes_are_counted_by_name():
    s = make()
    s.count_dropped("too_long", 2)
    s.count_dropped("too_long", 1)
    s.count_rejection({"too_long": 3})
    s.count_rejection({}, "dynamic filter")
    assert s.counters["samples_dropped_too_long"] == 3
    assert s.counters["rows_rejected_too_long"] == 1
    assert sum(v for k, v in s.counters.items() if k.startswith("rows_rejected_")) == 2


def test_a_slow_row_is_dropped_after_max_stale_attempts_saying_slow_not_wrong(caplog):
    # Issue 28 item 9: the limit is its own setting (a row that fails is still retried max_attempts times), and the
    # warning says what happened: slow, not wrong (before: it blamed the rollout's per-token versions).
    s = make(p=1, g=2, o=0, max_attempts=2, max_stale_attempts=4)
    for expected in ("stale", "stale", "stale", "failed"):
        (lease,) = s.lease("gw", 1, now=0)
        assert s.report(lease.row_id, "accepted", now=1, min_version=-5) == expected
    assert s.counters["rows_failed_stale"] == 1 and lease.attempt == 4
    assert "dropped as too slow" in caplog.text and "slow, not wrong" in caplog.text
    assert "max_stale_attempts" in caplog.text and "per-token versions" not in caplog.text
