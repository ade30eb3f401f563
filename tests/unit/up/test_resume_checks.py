"""`fleetrl up --resume` checks the run it continues before any service starts (issue 45): the trainer's latest
checkpoint is verified against its manifest, a damaged one is passed over for the newest whole one (said on the
console), and with none whole the resume is refused (exit 2) in one line naming the damaged file. Before, a
truncated file of `latest` failed inside DCP's reader after every service had started (exit 1, a traceback)."""

from __future__ import annotations

import json
import os

from fleetrl import Config
from fleetrl.controller.journal import Journal
from fleetrl.trainer.checkpoint import checkpoint_path
from fleetrl.up.config import UpConfig
from fleetrl.up.run import check_log_dir, main
from tests.unit.trainer.test_checkpoint_trust import shard, train_and_save


def stopped_run(log_dir, versions=(2, 4)):
    """A stopped run's folder: its journal and the trainer's checkpoints (real DCP)."""
    journal = Journal(log_dir / "controller.sqlite")
    journal.set_state("trained_steps", max(versions))
    journal.close()
    train_and_save(log_dir / "checkpoints", list(versions))
    return log_dir / "checkpoints"


def test_a_damaged_latest_is_passed_over_for_the_newest_whole_one_and_said(tmp_path, capsys):
    checkpoints = stopped_run(tmp_path / "run")
    damaged = shard(checkpoint_path(checkpoints, 4))
    os.truncate(damaged, damaged.stat().st_size // 2)
    cfg = Config(base_model="m", log_path=str(tmp_path / "run"))
    lock = check_log_dir(cfg, UpConfig.from_dict({"rollout": "m:f"}, "t"), resume=True, overwrite=False)
    assert lock is not None
    lock.release()
    err = capsys.readouterr().err
    assert f"checkpoint step-00000004 is damaged: {damaged} has" in err
    assert "resuming from step-00000002, the newest whole one" in err


def test_a_resume_with_no_whole_checkpoint_is_refused_naming_the_file_before_anything_starts(tmp_path, capsys):
    log_dir = tmp_path / "run"
    checkpoints = stopped_run(log_dir, versions=(2,))
    damaged = shard(checkpoint_path(checkpoints, 2))
    damaged.write_bytes(bytes(damaged.stat().st_size))  # zeroed: the same size, other bytes
    config = tmp_path / "run.json"
    (tmp_path / "rollout.py").write_text("def make(setup):\n    return None\n")
    config.write_text(
        json.dumps({"run": {"base_model": "m", "log_path": str(log_dir)}, "up": {"rollout": "rollout.py:make"}})
    )
    assert main([str(config), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("fleetrl up: --resume: no whole checkpoint in")
    assert f"{damaged} does not match its manifest's checksum" in err
    assert not list(log_dir.glob("*.log"))  # no service started
