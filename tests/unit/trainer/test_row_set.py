"""The trainer's trained rows stay bounded: ranges, not one entry per row of the run (issue 28 item 5)."""

from __future__ import annotations

import json
import random

import pytest

from fleetrl.trainer import PolicyTrainer
from fleetrl.trainer.checkpoint import write_manifest
from fleetrl.trainer.row_set import RowIdSet
from tests.unit.trainer.helpers import make_cfg, tiny_groups


def test_membership_and_merging():
    rows = RowIdSet.of([5, 3, 4, 10, 12, 11, 0])
    assert rows.ranges() == [[0, 1], [3, 6], [10, 13]]
    assert all(i in rows for i in (0, 3, 4, 5, 10, 11, 12)) and not any(i in rows for i in (1, 2, 6, 9, 13))
    rows.update([1, 2])  # fills the gap: three ranges become two
    assert rows.ranges() == [[0, 6], [10, 13]] and len(rows) == 9
    rows.add(4)  # already in
    assert rows.ranges() == [[0, 6], [10, 13]]
    assert "4" not in rows and -1 not in rows
    with pytest.raises(ValueError, match=">= 0"):
        rows.add(-3)


def test_a_whole_run_in_near_order_is_a_few_ranges_not_a_set_of_every_row():
    rng = random.Random(0)
    ids = list(range(200_000))
    rejected = set(rng.sample(ids, 200))  # rows closed without training: each leaves a gap
    trained = [i for i in ids if i not in rejected]
    for start in range(0, len(trained), 64):  # steps finish out of order within a window
        window = trained[start : start + 64]
        rng.shuffle(window)
        trained[start : start + 64] = window
    rows = RowIdSet()
    for i in trained:
        rows.add(i)
    assert len(rows) == len(trained)
    assert rows.num_ranges <= len(rejected) + 1
    assert all(i in rows for i in trained[:1000]) and not any(i in rows for i in rejected)
    assert len(json.dumps(rows.to_json())) < 10_000  # a checkpoint's share: kilobytes, not 200k ids


def test_past_max_ranges_the_lowest_fold_into_a_floor():
    rows = RowIdSet.of(range(0, 20, 2), max_ranges=3)  # ids 0, 2, ..., 18: ten one-id ranges
    assert rows.num_ranges == 3 and rows.ranges() == [[14, 15], [16, 17], [18, 19]]
    assert rows.floor == 13 and all(i in rows for i in range(13))  # far behind: counts as trained
    assert 15 not in rows and 17 not in rows
    again = RowIdSet.from_json(json.loads(json.dumps(rows.to_json())), max_ranges=3)
    assert again.ranges() == rows.ranges() and again.floor == rows.floor
    again.add(5)  # below the floor: nothing to add
    assert again.ranges() == rows.ranges()


def test_the_trainer_saves_ranges_and_resumes_them(tiny_model_dir, tmp_path):
    cfg = make_cfg(tiny_model_dir, tmp_path)
    trainer = PolicyTrainer(cfg)
    groups = tiny_groups(tiny_model_dir, num_groups=4)
    trainer.train_step(groups[:2])
    trainer.train_step(groups[2:])
    assert trainer.state.trained_rows == {"floor": 0, "ranges": [[0, 4]]} and trainer.trained_row_count == 4
    trainer.save_checkpoint()
    resumed = PolicyTrainer(cfg)
    assert resumed.resume() and all(resumed.is_trained(g.row_id) for g in groups) and not resumed.is_trained(4)
    trainer.close()
    resumed.close()


def test_a_checkpoint_with_the_old_list_of_ids_still_resumes(tiny_model_dir, tmp_path):
    cfg = make_cfg(tiny_model_dir, tmp_path)
    trainer = PolicyTrainer(cfg)
    trainer.train_step(tiny_groups(tiny_model_dir, num_groups=2))
    path = trainer.save_checkpoint()
    state_file = path / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state.pop("trained_rows")
    state["trained_row_ids"] = [0, 1, 7]
    state_file.write_text(json.dumps(state))
    write_manifest(path)  # as that trainer would have sealed it
    resumed = PolicyTrainer(cfg)
    assert resumed.resume() and [resumed.is_trained(i) for i in (0, 1, 2, 7)] == [True, True, False, True]
    trainer.close()
    resumed.close()
