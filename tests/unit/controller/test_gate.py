import pytest

from fleetrl.controller.gate import GateError, OffPolicyGate


def test_issue_vector_b4_g1_o1_c3():
    gate = OffPolicyGate(
        prompt_groups_per_step=4,
        completions_per_prompt=1,
        max_head_offpolicy_versions=1,
        max_concurrency=3,
    )
    assert gate.batch_size == 4
    assert gate.capacity() == 3
    a = gate.try_admit()
    b = gate.try_admit()
    assert gate.capacity() == 1
    gate.resolve(a.row_id, accepted=True)
    gate.resolve(b.row_id, accepted=True)
    assert gate.capacity() == 3
    gate.publish()
    assert gate.capacity() == 3
    assert gate.staleness_capacity() == (1 + 1 + 1) * 4 - 2


def test_o0_admits_no_row_of_batch_two_before_first_publish():
    gate = OffPolicyGate(prompt_groups_per_step=2, completions_per_prompt=4, max_head_offpolicy_versions=0)
    rows = [gate.try_admit() for _ in range(2)]
    assert all(r is not None and r.submit_version == 0 for r in rows)
    assert gate.try_admit() is None  # a third row would belong to batch 2
    for r in rows:
        gate.resolve(r.row_id, accepted=True)
    assert gate.try_admit() is None  # trained but not yet published
    gate.publish()
    nxt = gate.try_admit()
    assert nxt is not None and nxt.submit_version == 1


def test_rejected_row_frees_capacity_for_a_replacement():
    gate = OffPolicyGate(1, 4, 0)
    row = gate.try_admit()
    assert gate.try_admit() is None
    gate.resolve(row.row_id, accepted=False)
    replacement = gate.try_admit()
    assert replacement is not None and replacement.row_id != row.row_id


def test_row_is_atomic_needs_g_samples_of_capacity():
    gate = OffPolicyGate(
        prompt_groups_per_step=1,
        completions_per_prompt=4,
        max_head_offpolicy_versions=5,
        max_concurrency=6,
    )
    assert gate.try_admit() is not None
    assert gate.capacity() == 2
    assert gate.try_admit() is None  # 2 < G = 4


def test_async_o2_runs_ahead_at_most_three_batches():
    gate = OffPolicyGate(1, 2, 2)
    admitted = []
    while (a := gate.try_admit()) is not None:
        admitted.append(a)
    assert len(admitted) == 3  # (v + O + 1) * B / G = 3 rows of one batch each


def test_synchronous_forces_on_policy():
    gate = OffPolicyGate(1, 2, 3, synchronous=True)
    assert gate.try_admit() is not None
    assert gate.try_admit() is None


def test_resume_restarts_counters_from_version():
    gate = OffPolicyGate(2, 2, 1, version=7)
    assert gate.accepted == 7 * 4
    assert gate.capacity() == (1 + 1) * 4
    assert gate.try_admit().submit_version == 7


def test_misuse_is_reported():
    gate = OffPolicyGate(1, 2, 1)
    with pytest.raises(GateError, match="not in flight"):
        gate.resolve(42, accepted=True)
    with pytest.raises(GateError, match="only move forward"):
        gate.publish(0)
    with pytest.raises(ValueError, match="max_concurrency"):
        OffPolicyGate(1, 4, 1, max_concurrency=3)
    with pytest.raises(ValueError, match="max_head_offpolicy_versions"):
        OffPolicyGate(1, 4, -1)


def test_publish_jump_adds_headroom_per_version():
    gate = OffPolicyGate(1, 2, 1)
    gate.publish(3)  # weights pushed every 3 steps
    assert gate.staleness_capacity() == (3 + 1 + 1) * 2
