"""The controller SIGKILLed while the trainer trains a step it will never hear back about, with a version still
travelling to the replicas (overlapped pushes, O = 1), then `fleetrl up --resume` (issue 45, item 3): every step
appears exactly once in metrics.jsonl and in samples.jsonl, every row is trained exactly once, and the bound holds
on every trained sample.

The kill is made deterministic: the trainer is stopped (SIGSTOP) until the controller's liveness warning names the
TrainStep it has sent; then the controller is stopped, the trainer continued until its log says it trained that
step (its reply waits, unread, in the stopped controller's socket), and the controller is killed. The trainer
checkpoints that step as `fleetrl up` stops it, so the resumed journal is one step behind the trainer: before the
fix that step was counted as trained but had no line in either file.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from fleetrl.controller.journal import Journal
from tests.integration.up.conftest import read_metrics, service_pids, start_fleetrl_up, wait_for_steps, write_run
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TRAIN_STEP_WARNING = re.compile(r"WARNING fleetrl\.controller\.liveness: TrainStep\(step (\d+)\)")


def test_a_controller_killed_mid_push_resumes_with_every_step_once(tmp_path, tiny_model_dir):
    config = write_run(
        tmp_path,
        tiny_model_dir,
        {
            "max_steps": 8,
            "max_head_offpolicy_versions": 1,
            "overlap_weight_push": True,
            "log_samples_interval": 1,
            "rollout_extras": {"tool_latency_s": 0.3},  # steps slow enough to stop the trainer between two
        },
        {"gateways": 2, "rollout": "tests.integration.up.rollouts:make_slow_rollout_fn"},
        n_rows=40,
    )
    run_dir = tmp_path / "run"
    controller_log, trainer_log = run_dir / "controller.log", run_dir / "trainer.log"
    proc = start_fleetrl_up(config)
    try:
        wait_for_steps(proc, run_dir, 2)  # step 2's line is written: its version's push has just begun
        (trainer,) = service_pids(config, "trainer")
        (controller,) = service_pids(config, "controller")
        os.kill(trainer, signal.SIGSTOP)
        try:
            wait_until(
                lambda: TRAIN_STEP_WARNING.search(controller_log.read_text()), 120, "the controller's TrainStep out"
            )
            step = int(TRAIN_STEP_WARNING.search(controller_log.read_text()).group(1))
            os.kill(controller, signal.SIGSTOP)
        finally:
            os.kill(trainer, signal.SIGCONT)
        wait_until(
            lambda: f"step {step} -> version {step}:" in trainer_log.read_text(), 120, f"the trainer to train {step}"
        )
        os.kill(controller, signal.SIGKILL)
        proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    unseen = [m["step"] for m in read_metrics(run_dir)]
    assert step not in unseen, "the controller recorded the step it was killed in: nothing left to recover"

    resumed = start_fleetrl_up(config, "--resume")
    try:
        _, err = resumed.communicate(timeout=420)
    finally:
        if resumed.poll() is None:
            resumed.kill()
    assert resumed.returncode == 0, err[-3000:]
    metrics = [m for m in read_metrics(run_dir) if not any(k.startswith("eval/") for k in m)]
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert all(m["async/version_offset_max"] <= 1 for m in metrics)
    assert [m["step"] for m in metrics if m.get("record/recovered")] == [step]  # from the trainer's record
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    per_step = {s: sum(1 for x in samples if x["step"] == s) for s in range(1, 9)}
    assert set(per_step.values()) == {4}, per_step  # log_samples_count 4, every step, once
    ledger = Journal(run_dir / "controller.sqlite").rows()
    trained = [r for r, info in ledger.items() if info["status"] == "trained"]
    assert len(trained) == 16 and all(ledger[r]["trained_count"] == 1 for r in trained)
    assert sorted({ledger[r]["step"] for r in trained}) == list(range(1, 9))
