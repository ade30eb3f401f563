"""Rollout groups: validation on arrival drops only the bad samples; the JSONL record format round-trips."""

from __future__ import annotations

import json

import pytest

from fleetrl.rollout import RolloutSample
from fleetrl.rollout_group import GroupFormatError, RolloutGroup, read_groups_jsonl, split_valid, write_groups_jsonl


def _sample(**kw) -> RolloutSample:
    values = {"tokens": [1, 2, 3], "logprobs": [0.0, -0.5, -0.25], "loss_mask": [0, 1, 1], "reward": 1.0}
    values.update(kw)
    return RolloutSample(**values)


def test_split_valid_keeps_good_samples_and_names_the_bad_field():
    group = RolloutGroup(3, 1, [_sample(), _sample(loss_mask=[0, 2, 1]), _sample(reward=float("nan"))])
    valid = split_valid(group)
    assert len(valid.samples) == 1
    assert [(d.index, d.field_name) for d in valid.dropped] == [(1, "loss_mask"), (2, "reward")]
    assert "row 3 sample 1" in valid.dropped[0].message


def test_jsonl_round_trip(tmp_path):
    groups = [
        RolloutGroup(0, 2, [_sample(versions=[2, 2, 2], metrics={"correct": 1.0}, text="hi")], source="gw-1"),
        RolloutGroup(1, 2, [_sample(), _sample(reward=0.0)]),
    ]
    path = tmp_path / "groups.jsonl"
    assert write_groups_jsonl(path, groups) == 2
    back = list(read_groups_jsonl(path))
    assert back == groups


def test_bad_records_name_the_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = {"row_id": 0, "submit_version": 0, "samples": []}
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({"row_id": "x", "submit_version": 0, "samples": []}) + "\n")
    with pytest.raises(GroupFormatError, match=r"bad.jsonl:3: row_id must be an int"):
        list(read_groups_jsonl(path))
    path.write_text('{"row_id": 1, "submit_version": 0, "samples": [{"tokens": [1]}]}\n')
    with pytest.raises(GroupFormatError, match=r"missing field\(s\) \['logprobs', 'loss_mask', 'reward'\]"):
        list(read_groups_jsonl(path))
    with pytest.raises(GroupFormatError, match="not found"):
        list(read_groups_jsonl(tmp_path / "nope.jsonl"))
