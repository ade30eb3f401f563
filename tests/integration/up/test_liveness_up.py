"""Liveness you can see, end to end (issue 45, item 5): the trainer of a `fleetrl up` run SIGSTOPped while it
trains; the controller warns, naming the trainer and its silence, while its TrainStep is out, `fleetrl up`'s
console shows those warnings, and once the trainer resumes the run finishes. Before, nothing was logged until the
trainer resumed."""

from __future__ import annotations

import os
import signal

import pytest

from tests.integration.up.conftest import read_metrics, service_pids, start_fleetrl_up, wait_for_steps, write_run
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_stopped_trainer_is_warned_about_on_the_console_while_its_train_step_is_out(tmp_path, tiny_model_dir):
    config = write_run(tmp_path, tiny_model_dir, {"max_steps": 6}, {})
    run_dir = tmp_path / "run"
    proc = start_fleetrl_up(config)
    try:
        wait_for_steps(proc, run_dir, 2)
        (pid,) = service_pids(config, "trainer")
        os.kill(pid, signal.SIGSTOP)
        try:
            # The next TrainStep goes out to the stopped trainer (still within heartbeat_timeout_s); past 3 poll
            # intervals (6 s) of silence the controller warns.
            log = run_dir / "controller.log"
            wait_until(
                lambda: "WARNING fleetrl.controller.liveness: TrainStep(step" in log.read_text(),
                120,
                "a liveness warning in controller.log",
            )
        finally:
            os.kill(pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    console = [line for line in out.splitlines() if line.startswith("fleetrl up: controller: TrainStep(step")]
    assert console, out[-3000:]
    assert "to the trainer at " in console[0] and "has not answered Status for " in console[0]
    assert len(read_metrics(run_dir)) == 6
