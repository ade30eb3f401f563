"""Helpers for `fleetrl up` runs: a run.toml over the session's tiny model and the rows file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[3]


def write_run(tmp_path: Path, model_dir: str, run: dict, up: dict, n_rows: int = 24) -> Path:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"count {i} to {i + 3}:"}) + "\n" for i in range(n_rows)))
    base = {
        "base_model": model_dir,
        "dataset": str(rows),
        "log_path": str(tmp_path / "run"),
        "completions_per_prompt": 4,
        "prompt_groups_per_step": 2,
        "max_completion_tokens": 8,
        "max_seq_len": 64,
        "learning_rate": 1e-3,
        "kl_beta": 0.0,
        "max_steps": 3,
        "seed": 0,
    }
    base.update(run)
    up_table = {"rollout": "tests.integration.up.rollouts:make_rollout_fn", "engine": "hf", "startup_timeout_s": 240}
    up_table.update(up)
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"run": base, "up": up_table}))
    return path


def fleetrl_up(config: Path, timeout_s: float = 420, extra: list[str] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetrl", "up", str(config), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def start_fleetrl_up(config: Path, *extra: str) -> subprocess.Popen[str]:
    """`fleetrl up` in the background (stop it with `proc.communicate` / `proc.kill`)."""
    return subprocess.Popen(
        [sys.executable, "-m", "fleetrl", "up", str(config), *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_steps(proc: subprocess.Popen[str], run_dir: Path, steps: int, timeout_s: float = 300) -> None:
    """Until metrics.jsonl has `steps` lines (fails if `fleetrl up` exits first or time runs out)."""

    def reached() -> bool:
        return len(read_metrics(run_dir)) >= steps or proc.poll() is not None

    wait_until(reached, timeout_s, f"the run to reach step {steps}", poll_s=0.1)
    assert len(read_metrics(run_dir)) >= steps, f"the run did not reach step {steps} (fleetrl up exited)"


def service_pids(config: Path, kind: str) -> list[int]:
    """PIDs of the `fleetrl serve <kind>` processes a `fleetrl up` of `config` started."""
    out = subprocess.run(["pgrep", "-f", f"serve {kind} --config {config}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def up_run(tmp_path: Path, tiny_model_dir: str):
    def run(run: dict | None = None, up: dict | None = None, n_rows: int = 24, **kw):
        config = write_run(tmp_path, tiny_model_dir, run or {}, up or {}, n_rows)
        result = fleetrl_up(config, **kw)
        return result, tmp_path / "run"

    return run


def kill_trainer_after(
    config: Path, run_dir: Path, steps: int, before_kill: Callable[[int], None] | None = None
) -> int:
    """Run `fleetrl up` until `steps` steps are recorded, SIGKILL its trainer, and return `fleetrl up`'s exit code.
    `before_kill` is called with the trainer's pid first (to inspect the live process)."""
    proc = start_fleetrl_up(config)
    try:
        wait_for_steps(proc, run_dir, steps)
        pid = service_pids(config, "trainer")[0]
        if before_kill is not None:
            before_kill(pid)
        os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode
