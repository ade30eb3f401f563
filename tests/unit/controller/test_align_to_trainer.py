"""After a restart the trainer's checkpoint is the truth: `RowScheduler.align_to_trainer`."""

import pytest

from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.journal import Journal
from fleetrl.controller.scheduler import RowScheduler

ROWS = [{"q": i} for i in range(12)]


def gate_at(version):
    return OffPolicyGate(2, 2, 1, version=version)


def fresh(journal=None):
    return RowScheduler(DatasetCursor(ROWS, shuffle=False), gate_at(0), prompt_groups_per_step=2, journal=journal)


def resume(path):
    return RowScheduler.resume(Journal(path), ROWS, gate_at, {"shuffle": False}, prompt_groups_per_step=2)


def run_steps(s, steps, now=0):
    """Lease, accept and train until `steps` steps are trained; a step formed after that stays assigned."""
    while s.trained_steps < steps:
        for lease in s.lease("gw", 2, now=now):
            s.report(lease.row_id, "accepted", now=now)
        while s.trained_steps < steps and (step := s.take_step()) is not None:
            s.step_trained(step)
            s.publish(step.step)
        now += 1
    return now


def finish(s, now=100):
    trained_in = {}
    while not s.finished():
        for lease in s.lease("gw", 10, now=now):
            s.report(lease.row_id, "accepted", now=now)
        while (step := s.take_step()) is not None:
            s.step_trained(step)
            s.publish(step.step)
            trained_in.update(dict.fromkeys(step.row_ids, step.step))
        now += 1
        assert now < 200, "scheduler did not finish"
    return trained_in


def test_checkpoint_behind_the_journal_requeues_later_steps(tmp_path):
    s = fresh(Journal(tmp_path / "j"))
    run_steps(s, 3)
    s.journal.close()
    r = resume(tmp_path / "j")
    assert r.gate.version == 3 and r.next_step == 4
    moved = r.align_to_trainer(1)  # the trainer's last checkpoint was after step 1
    assert sorted(moved["requeued"]) == [2, 3, 4, 5] and moved["counted_trained"] == []
    assert r.gate.version == 1 and r.next_step == 2 and r.trained_steps == 1
    trained_in = finish(r)
    assert min(trained_in.values()) == 2  # steps go on from the trainer's version
    ledger = r.journal.rows()
    assert set(ledger) == set(range(12))
    assert all(info["status"] == "trained" and info["trained_count"] == 1 for info in ledger.values())


def test_trainer_one_step_ahead_counts_that_step_trained(tmp_path):
    s = fresh(Journal(tmp_path / "j"))
    run_steps(s, 1)
    for lease in s.lease("gw", 2, now=50):
        s.report(lease.row_id, "accepted", now=50)
    step = s.take_step()  # handed to the trainer, which trains it; the controller dies before hearing back
    assert step.step == 2
    s.journal.close()
    r = resume(tmp_path / "j")
    assert set(step.row_ids) <= set(r.queue)
    moved = r.align_to_trainer(2)
    assert sorted(moved["counted_trained"]) == sorted(step.row_ids) and moved["requeued"] == []
    assert not set(step.row_ids) & set(r.queue) and r.next_step == 3
    trained_in = finish(r)
    assert not set(step.row_ids) & set(trained_in)  # never trained twice
    assert all(info["status"] == "trained" for info in r.journal.rows().values())


def test_mismatches_that_cannot_be_aligned_are_named(tmp_path):
    new = fresh()
    assert new.align_to_trainer(0) == {"requeued": [], "counted_trained": []}
    with pytest.raises(ValueError, match="restart both with --resume"):
        new.align_to_trainer(4)
    s = fresh(Journal(tmp_path / "j"))
    run_steps(s, 1)
    s.journal.close()
    with pytest.raises(ValueError, match="belongs to another run"):
        resume(tmp_path / "j").align_to_trainer(5)


def test_rows_of_lost_steps_come_back_first_step_by_step_so_the_same_steps_form_again(tmp_path):
    s = fresh(Journal(tmp_path / "j"))
    run_steps(s, 4)
    s.journal.close()
    original = {r: int(info["step"]) for r, info in Journal(tmp_path / "j").rows().items() if info["step"] > 0}
    r = resume(tmp_path / "j")
    r.align_to_trainer(1)  # steps 2, 3 and 4 are lost: several steps, not one
    assert list(r.queue)[:6] == sorted(original, key=lambda row: (original[row], row))[2:8]
    trained_in = finish(r)
    assert all(trained_in[row] == step for row, step in original.items() if step > 1)
