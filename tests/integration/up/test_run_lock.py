"""One live run per log_path (issue 28): while `fleetrl up` runs, a second `fleetrl up` on its folder, plain,
`--resume` or `--overwrite`, is refused (exit 2) naming the live run's pid, and the live run's files are untouched;
the live run then finishes with one metrics line per step. Before the lock, `--resume` started a second set of
services on the same journal and `--overwrite` deleted the live run's files."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.up.conftest import REPO, fleetrl_up, read_metrics, start_fleetrl_up, wait_for_steps, write_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_second_start_on_a_live_runs_folder_is_refused_naming_its_pid(tmp_path, tiny_model_dir):
    hold = tmp_path / "hold"
    config = write_run(
        tmp_path,
        tiny_model_dir,
        # Rows 0 and 1 make step 1; every later row waits while `hold` exists (made before the start), so the run
        # stays live however many rows were in flight (holding after step 1 let rows already past the hold finish
        # the run under the checks: the journal's -shm went with its connection).
        {"max_steps": 3, "shuffle": False, "rollout_extras": {"hold_file": str(hold), "hold_from_row": 2}},
        {"rollout": "tests.integration.up.rollouts:make_held_rollout_fn"},
        n_rows=12,
    )
    run_dir = tmp_path / "run"
    hold.touch()
    proc = start_fleetrl_up(config)
    try:
        wait_for_steps(proc, run_dir, 1)
        files = {p.name: p.stat().st_size for p in run_dir.iterdir() if p.is_file()}
        for extra in ([], ["--resume"], ["--overwrite"]):
            other = fleetrl_up(config, timeout_s=120, extra=extra)
            assert other.returncode == 2, (extra, other.stderr[-2000:])
            assert f"in use by a live run (`fleetrl up`, pid {proc.pid})" in other.stderr, (extra, other.stderr)
            assert proc.poll() is None
            for name in files:  # nothing of the live run deleted
                assert (run_dir / name).exists(), (extra, name)
        hold.unlink()
        _, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert [m["step"] for m in read_metrics(run_dir) if "train/loss" in m] == [1, 2, 3]
    # `fleetrl status` on the finished run describes it from its folder (before: UNAVAILABLE, exit 1).
    status = subprocess.run(
        [sys.executable, "-m", "fleetrl", "status", "--log-path", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode == 0, status.stderr
    assert "finished at step 3, version 3" in status.stdout and str(run_dir / "final") in status.stdout
    # The lock went with the run: a new start is refused only because the folder holds a (finished) run.
    again = fleetrl_up(config, timeout_s=120, extra=[])
    assert again.returncode == 2 and "live run" not in again.stderr and "--overwrite" in again.stderr
