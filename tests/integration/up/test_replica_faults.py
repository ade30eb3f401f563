"""A replica that stops answering (SIGSTOP) is fenced within a few heartbeats, the weight push does not wait for
it, its rollouts go to the other replica, and it returns to rotation once it answers and serves the current
version."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.integration.up.conftest import read_metrics, start_fleetrl_up, wait_for_steps, write_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def replica_pid(run_dir, index: int) -> int:
    """The inference replica `fleetrl up` started as inference-<index> (found by its ready file)."""
    out = subprocess.run(
        ["pgrep", "-f", f"serve inference .*{run_dir}/ready/inference-{index}.json"], capture_output=True, text=True
    )
    (pid,) = out.stdout.split()
    return int(pid)


def wait_for_text(path, text: str, proc, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path.name} within {timeout_s} s")


def test_a_stopped_replica_is_fenced_and_the_run_goes_on(tmp_path, tiny_model_dir):
    config = write_run(
        tmp_path,
        tiny_model_dir,
        {"max_steps": 40, "max_head_offpolicy_versions": 1, "rollout_extras": {"tool_latency_s": 0.1}},
        {
            "rollout": "tests.integration.up.rollouts:make_slow_rollout_fn",
            "replicas": 2,
            "gateway_args": ["--generate-timeout", "5"],
        },
        n_rows=120,
    )
    run_dir = tmp_path / "run"
    proc = start_fleetrl_up(config)
    stopped = None
    try:
        wait_for_steps(proc, run_dir, 3)
        stopped = replica_pid(run_dir, 0)
        os.kill(stopped, signal.SIGSTOP)
        controller_log = run_dir / "controller.log"
        wait_for_text(controller_log, "did not answer Status", proc)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        steps_at_fence = len(read_metrics(run_dir))
        # Training goes on with one replica: pushes do not wait for the stopped one, rollouts avoid it.
        wait_for_steps(proc, run_dir, steps_at_fence + 3, timeout_s=120)
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        wait_for_text(controller_log, "back in rotation", proc)
        _, err = proc.communicate(timeout=300)
    finally:
        if stopped is not None and proc.poll() is None:
            os.kill(stopped, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    steps = [m for m in read_metrics(run_dir) if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 41))
    assert all(m["async/version_offset_max"] <= 1 for m in steps)
