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
    read_metrics,
    service_pids,
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
    proc = start_fleetrl_up(config)
    try:
        wait_for_steps(proc, run_dir, 4)
        os.kill(service_pids(config, "trainer")[0], signal.SIGKILL)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    before = [m["step"] for m in read_metrics(run_dir)]
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None
    saved = json.loads((checkpoint / STATE_FILE).read_text())["steps_done"]
    assert saved % 3 == 0 and 3 <= saved <= max(before)

    resumed = fleetrl_up(config, extra=["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = read_metrics(run_dir)
    after = [m["step"] for m in lines][len(before) :]
    assert after == list(range(saved + 1, 9)), (before, after)  # training went on from the checkpoint
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
    assert final_state["steps_done"] == 8 and sorted(final_state["trained_row_ids"]) == trained


def test_resume_without_a_checkpoint_starts_the_weights_over(tmp_path, tiny_model_dir):
    # No periodic checkpoint: the killed trainer left nothing, so the resumed run aligns the ledger to version 0,
    # retrains every row from the base model, and the replicas (serving the base model) stay routable.
    config = write_run(
        tmp_path,
        tiny_model_dir,
        {"max_steps": 4, "rollout_extras": {"tool_latency_s": 0.2}},
        {"rollout": "tests.integration.up.rollouts:make_slow_rollout_fn"},
        n_rows=40,
    )
    run_dir = tmp_path / "run"
    proc = start_fleetrl_up(config)
    try:
        wait_for_steps(proc, run_dir, 2)
        os.kill(service_pids(config, "trainer")[0], signal.SIGKILL)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert latest_checkpoint(run_dir / "checkpoints") is None
    before = len(read_metrics(run_dir))
    resumed = fleetrl_up(config, extra=["--resume"], timeout_s=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)][before:] == [1, 2, 3, 4]
    assert "aligned to the trainer's version 0" in (run_dir / "controller.log").read_text()
    ledger = Journal(run_dir / "controller.sqlite").rows()
    trained = [r for r, info in ledger.items() if info["status"] == "trained"]
    assert len(trained) == 8 and all(ledger[r]["trained_count"] == 1 for r in trained)
