"""Checkpoints a resume can trust (issue 45): a checkpoint is whole only with its manifest (every file's size and
SHA-256), written last; `latest` moves to it only then. A resume verifies the latest and, when a file of it was
truncated, zeroed or deleted, passes it over for the newest whole one, saying which and why; with none whole it
names the damaged file. Before, a truncated shard of `latest` failed inside DCP's reader (`torch.load`).

Real DCP checkpoints of a small model and its Adam state, in one process (DCP without a process group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fleetrl.trainer.checkpoint import (
    LATEST,
    MANIFEST,
    CheckpointDamaged,
    TrainerState,
    checkpoint_path,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from fleetrl.trainer.distributed import DistContext

CTX = DistContext()
REPO = Path(__file__).resolve().parents[3]


def parts(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return model, optimizer, scheduler


def train_and_save(root, versions):
    """Save a checkpoint at each of `versions` after an optimizer step; each version's weights differ."""
    model, optimizer, scheduler = parts()
    weights = {}
    for version in versions:
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        state = TrainerState(steps_done=version)
        save_checkpoint(root, model=model, optimizer=optimizer, scheduler=scheduler, state=state, ctx=CTX)
        weights[version] = {k: v.clone() for k, v in model.state_dict().items()}
    return weights


def shard(path):
    return next(p for p in sorted(path.iterdir()) if p.suffix == ".distcp")


def truncate(file):
    os.truncate(file, file.stat().st_size // 2)


def zero(file):
    file.write_bytes(bytes(file.stat().st_size))


def delete(file):
    file.unlink()


def test_a_saved_checkpoint_is_whole_with_a_manifest_and_named_latest(tmp_path):
    train_and_save(tmp_path, [2])
    path = checkpoint_path(tmp_path, 2)
    manifest = json.loads((path / MANIFEST).read_text())["files"]
    assert {"trainer_state.json", ".metadata", "rng-rank0.json"} <= set(manifest)
    assert all(entry["size"] == (path / name).stat().st_size for name, entry in manifest.items())
    assert verify_checkpoint(path) is None and (tmp_path / LATEST).read_text().strip() == path.name
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, path.name]  # no .partial left


@pytest.mark.parametrize("damage", [truncate, zero, delete])
@pytest.mark.parametrize("which", ["shard", "metadata", "state"])
def test_a_damaged_latest_is_passed_over_for_the_newest_whole_one(tmp_path, damage, which):
    weights = train_and_save(tmp_path, [2, 4])
    latest = checkpoint_path(tmp_path, 4)
    file = {"shard": shard(latest), "metadata": latest / ".metadata", "state": latest / "trainer_state.json"}[which]
    damage(file)
    reason = verify_checkpoint(latest)
    assert reason is not None and str(file) in reason
    point = resume_checkpoint(tmp_path)
    assert point.path == checkpoint_path(tmp_path, 2) and point.skipped == [(latest, reason)]
    assert "step-00000004 is damaged" in point.note() and "resuming from step-00000002" in point.note()
    model, optimizer, scheduler = parts(seed=1)
    state = load_checkpoint(point.path, model=model, optimizer=optimizer, scheduler=scheduler, ctx=CTX)
    assert state.version == 2
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, weights[2][key], atol=0, rtol=0)


@pytest.mark.parametrize("damage", [truncate, zero, delete])
def test_with_no_whole_checkpoint_the_damaged_file_is_named(tmp_path, damage):
    train_and_save(tmp_path, [2])
    file = shard(checkpoint_path(tmp_path, 2))
    damage(file)
    with pytest.raises(CheckpointDamaged) as refused:
        resume_checkpoint(tmp_path)
    message = str(refused.value)
    assert "\n" not in message and str(file) in message and f"no whole checkpoint in {tmp_path}" in message


def test_no_checkpoint_at_all_is_no_resume_point_and_an_unfinished_save_is_never_loaded(tmp_path):
    assert resume_checkpoint(tmp_path).path is None
    assert resume_checkpoint(tmp_path / "absent").path is None
    train_and_save(tmp_path, [2])
    # A save cut short: its .partial folder, and a step folder without a manifest (a copy cut short).
    (tmp_path / "step-00000004.partial").mkdir()
    (tmp_path / "step-00000006").mkdir()
    (tmp_path / LATEST).write_text("step-00000006\n")
    point = resume_checkpoint(tmp_path)
    assert point.path == checkpoint_path(tmp_path, 2) and "manifest.json is missing" in point.skipped[0][1]
    (tmp_path / LATEST).write_bytes(bytes(14))  # the pointer itself zeroed: the newest whole folder
    assert resume_checkpoint(tmp_path).path == checkpoint_path(tmp_path, 2)


def test_saving_a_version_again_replaces_it_whole(tmp_path):
    train_and_save(tmp_path, [2])
    (tmp_path / "step-00000002.partial").mkdir()  # an earlier save of it cut short
    train_and_save(tmp_path, [2])
    assert verify_checkpoint(checkpoint_path(tmp_path, 2)) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-00000002"]


KILLED_MID_SAVE = """
import os, signal, sys
import torch.distributed.checkpoint as dcp
from tests.unit.trainer.test_checkpoint_trust import train_and_save
train_and_save(sys.argv[1], [2])
real_save = dcp.save
def save_then_die(*args, **kwargs):
    real_save(*args, **kwargs)  # the shards of version 4 are on disk, its manifest not yet
    os.kill(os.getpid(), signal.SIGKILL)
dcp.save = save_then_die
train_and_save(sys.argv[1], [4])
"""


def test_a_trainer_killed_mid_save_resumes_from_the_checkpoint_before(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", KILLED_MID_SAVE, str(tmp_path)], cwd=REPO, timeout=300, capture_output=True
    )
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    assert (tmp_path / "step-00000004.partial" / ".metadata").exists()  # it died with version 4 half written
    point = resume_checkpoint(tmp_path)
    assert point.path == checkpoint_path(tmp_path, 2) and point.skipped == []
    train_and_save(tmp_path, [3])  # the next save clears what the killed one left
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-00000002", "step-00000003"]
