"""`fleetrl up --resume`: the trainer is killed mid-run; the resumed run starts from the trainer's last checkpoint,
pushes that version to a fresh replica, retrains the steps the checkpoint had not seen, and finishes."""

from __future__ import annotations

import json
import os
import signal

import pytest

from fleetrl.controller.journal import Journal
from fleetrl.trainer.checkpoint import STATE_FILE, latest_checkpoint
from tests.integration.up.conftest import (
    fleetrl_up,
    kill_trainer_after,
    read_metrics,
    start_fleetrl_up,
    wait_for_steps,
    write_run,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_resume_after_the_trainer_is_killed(tmp_path, tiny_model_dir):
    config = write_run(
        tmp_path,
        tiny_model_dir,
        {
            "max_steps": 8,
            "dcp_save_interval": 3,
            "max_head_offpolicy_versions": 1,
            "rollout_extras": {"tool_latency_s": 0.2},
        },
        {"rollout": "tests.integration.up.rollouts:make_slow_rollout_fn"},
        n_rows=40,
    )
    run_dir = tmp_path / "run"
    assert kill_trainer_after(config, run_dir, 4) == 1
    before = [m["step"] for m in read_metrics(run_dir)]
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None
    saved = json.loads((checkpoint / STATE_FILE).read_text())["steps_done"]
    assert saved % 3 == 0 and 3 <= saved <= max(before)

    resumed = fleetrl_up(config, extra=["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # One line per step: the lines of steps the checkpoint had not seen were replaced by the retrained ones.
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, 9)), before
    controller_log = (run_dir / "controller.log").read_text()
    assert f"resumed at version {saved}: every replica serves it" in controller_log
    if max(before) > saved:
        assert f"aligned to the trainer's version {saved}" in controller_log
    # Every row of the 8 steps was trained exactly once by the weights that count, and the trainer and the
    # controller agree on which: the rows of steps lost with the killed trainer were trained again.
    ledger = Journal(run_dir / "controller.sqlite").rows()
    trained = sorted(r for r, info in ledger.items() if info["status"] == "trained")
    assert len(trained) == 16 and all(ledger[r]["trained_count"] == 1 for r in trained)
    assert sorted({ledger[r]["step"] for r in trained}) == list(range(1, 9))
    final_state = json.loads((latest_checkpoint(run_dir / "checkpoints") / STATE_FILE).read_text())
    assert final_state["steps_done"] == 8 and _ids(final_state["trained_rows"]) == trained


def test_resume_without_a_checkpoint_refuses_unless_the_weights_may_restart(tmp_path, tiny_model_dir):
    # No periodic checkpoint and a killed trainer: nothing to resume the weights from. --resume says so instead of
    # silently training steps 1..k again; --resume --restart-weights aligns the ledger to version 0, retrains every
    # row from the base model (the replicas, serving the base model, stay routable) and the record has one line
    # per step.
    config = write_run(
        tmp_path,
        tiny_model_dir,
        {"max_steps": 4, "rollout_extras": {"tool_latency_s": 0.2}},
        {"rollout": "tests.integration.up.rollouts:make_slow_rollout_fn"},
        n_rows=40,
    )
    run_dir = tmp_path / "run"
    kill_trainer_after(config, run_dir, 2)
    assert latest_checkpoint(run_dir / "checkpoints") is None
    before = read_metrics(run_dir)
    refused = fleetrl_up(config, extra=["--resume"], timeout_s=300)
    assert refused.returncode == 1
    assert "no checkpoint to resume from" in refused.stderr and "--restart-weights" in refused.stderr
    assert read_metrics(run_dir) == before  # the refused resume changed nothing
    resumed = fleetrl_up(config, extra=["--resume", "--restart-weights"], timeout_s=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4]
    assert "aligned to the trainer's version 0" in (run_dir / "controller.log").read_text()
    ledger = Journal(run_dir / "controller.sqlite").rows()
    trained = [r for r, info in ledger.items() if info["status"] == "trained"]
    assert len(trained) == 8 and all(ledger[r]["trained_count"] == 1 for r in trained)


def test_ctrl_c_saves_the_last_step_and_resume_loses_nothing(tmp_path, tiny_model_dir):
    # dcp_save_interval = 0: the only checkpoint is the one Ctrl-C makes. SIGINT reaches `fleetrl up` (its children
    # run in their own sessions), which stops the gateways and the controller first (the controller finishes the
    # step in flight and writes its line), then the trainer, which saves its last trained step.
    config = write_run(
        tmp_path,
        tiny_model_dir,
        {"max_steps": 5, "rollout_extras": {"tool_latency_s": 0.2}},
        {"rollout": "tests.integration.up.rollouts:make_slow_rollout_fn"},
        n_rows=40,
    )
    run_dir = tmp_path / "run"
    proc = start_fleetrl_up(config)
    try:
        wait_for_steps(proc, run_dir, 2)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    steps = [m["step"] for m in read_metrics(run_dir)]
    assert steps == list(range(1, len(steps) + 1)) and 2 <= len(steps) < 5
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None, err[-3000:]
    assert json.loads((checkpoint / STATE_FILE).read_text())["steps_done"] == len(steps)
    assert Journal(run_dir / "controller.sqlite").state()["trained_steps"] == len(steps)
    assert not (run_dir / "final").exists()

    # The same log_path without --resume: refused, the old run untouched.
    again = fleetrl_up(config, timeout_s=60)
    assert again.returncode == 2 and "--resume" in again.stderr and "--overwrite" in again.stderr
    assert latest_checkpoint(run_dir / "checkpoints") == checkpoint

    resumed = fleetrl_up(config, extra=["--resume"], timeout_s=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed at version {len(steps)}: every replica serves it" in (run_dir / "controller.log").read_text()
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4, 5]  # nothing lost, nothing trained twice
    ledger = Journal(run_dir / "controller.sqlite").rows()
    trained = [r for r, info in ledger.items() if info["status"] == "trained"]
    assert len(trained) == 10 and all(ledger[r]["trained_count"] == 1 for r in trained)


def test_resume_passes_over_a_damaged_latest_checkpoint_and_retrains_from_the_one_before(tmp_path, tiny_model_dir):
    # Issue 45: a truncated file of `latest` failed the resume inside DCP's reader (rc 1) after every service had
    # started, with a whole checkpoint beside it. Now `fleetrl up --resume` says it takes the one before, the
    # trainer loads it, the journal aligns to it, and the steps after it are trained again, each once.
    config = write_run(
        tmp_path,
        tiny_model_dir,
        {"max_steps": 6, "dcp_save_interval": 2, "rollout_extras": {"tool_latency_s": 0.2}},
        {"rollout": "tests.integration.up.rollouts:make_slow_rollout_fn"},
        n_rows=40,
    )
    run_dir = tmp_path / "run"
    kill_trainer_after(config, run_dir, 4)
    latest = latest_checkpoint(run_dir / "checkpoints")
    assert latest is not None and latest.name in ("step-00000004", "step-00000006"), latest
    older = int(latest.name.split("-")[1]) - 2
    shard = next(p for p in sorted(latest.iterdir()) if p.suffix == ".distcp")
    os.truncate(shard, shard.stat().st_size // 2)
    resumed = fleetrl_up(config, extra=["--resume"], timeout_s=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"checkpoint {latest.name} is damaged: {shard} has" in resumed.stderr
    assert f"resuming from step-{older:08d}, the newest whole one" in resumed.stderr
    controller_log = (run_dir / "controller.log").read_text()
    assert f"resumed at version {older}: every replica serves it" in controller_log
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    ledger = Journal(run_dir / "controller.sqlite").rows()
    trained = sorted(r for r, info in ledger.items() if info["status"] == "trained")
    assert len(trained) == 12 and all(ledger[r]["trained_count"] == 1 for r in trained)
    final_state = json.loads((latest_checkpoint(run_dir / "checkpoints") / STATE_FILE).read_text())
    assert final_state["steps_done"] == 6 and _ids(final_state["trained_rows"]) == trained


def _ids(trained_rows: dict) -> list[int]:
    """The row ids of a checkpoint's `trained_rows` (RowIdSet.to_json: ranges above a floor, here 0)."""
    assert trained_rows["floor"] == 0
    return [i for start, end in trained_rows["ranges"] for i in range(start, end)]
