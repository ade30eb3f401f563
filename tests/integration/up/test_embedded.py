"""`fleetrl.main` from a user's script: Ctrl-C checkpoints the last step; a run that trains nothing fails with the
reason and exports nothing, and the same log_path is then refused without `overwrite=True`, the old run's rows left
as they were."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from fleetrl.trainer.checkpoint import STATE_FILE, latest_checkpoint
from tests.integration.up.conftest import REPO, read_metrics, wait_for_steps

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = """
import json, sys
from fleetrl import Config, main
from tests.integration.up.rollouts import make_rollout_fn

if __name__ == "__main__":
    cfg = Config(**json.loads(sys.argv[1]))
    rows = [{"prompt": f"count {i} to {i + 3}:"} for i in range(int(sys.argv[2]))]
    sys.exit(main(cfg, rollout_fn_factory=make_rollout_fn, rows=rows, engine="hf", startup_timeout_s=240)["exit_code"])
"""


def test_fleetrl_main_fails_a_run_that_trains_nothing(tmp_path, tiny_model_dir):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    cfg = {
        "base_model": tiny_model_dir,
        "log_path": str(run_dir),
        "completions_per_prompt": 4,
        "prompt_groups_per_step": 2,
        "max_completion_tokens": 2,
        "max_seq_len": 5,  # every prompt is longer: every row is rejected
        "kl_beta": 0.0,
        "max_steps": 3,
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}

    def train(rows: int) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, str(script), json.dumps(cfg), str(rows)]
        return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    failed = train(4)
    assert failed.returncode == 1, failed.stdout[-2000:] + failed.stderr[-3000:]
    assert "the run failed: all 4 rows rejected: 4 too long for max_seq_len 5" in failed.stderr
    assert not (run_dir / "final").exists()

    refused = train(8)
    assert refused.returncode == 2 and "holds a run" in refused.stderr and "overwrite" in refused.stderr
    assert len((run_dir / "rows.jsonl").read_text().splitlines()) == 4  # the refused run wrote nothing


SLOW_SCRIPT = """
import json, sys
from fleetrl import Config, main
from tests.integration.up.rollouts import make_slow_rollout_fn

if __name__ == "__main__":
    cfg = Config(**json.loads(sys.argv[1]))
    rows = [{"prompt": f"count {i} to {i + 3}:"} for i in range(40)]
    summary = main(cfg, rollout_fn_factory=make_slow_rollout_fn, rows=rows, engine="hf", startup_timeout_s=240)
    sys.exit(summary["exit_code"])
"""


def test_ctrl_c_on_fleetrl_main_saves_the_last_step(tmp_path, tiny_model_dir):
    script = tmp_path / "train.py"
    script.write_text(SLOW_SCRIPT)
    run_dir = tmp_path / "run"
    cfg = {
        "base_model": tiny_model_dir,
        "log_path": str(run_dir),
        "completions_per_prompt": 4,
        "prompt_groups_per_step": 2,
        "max_completion_tokens": 8,
        "max_seq_len": 64,
        "kl_beta": 0.0,
        "max_steps": 20,
        "rollout_extras": {"tool_latency_s": 0.2},
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        [sys.executable, str(script), json.dumps(cfg)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_steps(proc, run_dir, 2)
        proc.send_signal(signal.SIGINT)  # Ctrl-C in the user's terminal
        _out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    steps = [m["step"] for m in read_metrics(run_dir)]
    assert 2 <= len(steps) < 20
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None, err[-3000:]
    assert json.loads((checkpoint / STATE_FILE).read_text())["steps_done"] == len(steps)  # nothing lost
