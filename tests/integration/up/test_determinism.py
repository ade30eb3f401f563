"""Same seed, same weights: two synchronous `fleetrl up` runs end with the same model, and so does a run whose
trainer is killed mid-run and resumed from its last checkpoint.

What makes it hold (docs/ARCHITECTURE.md, "Determinism"): every sampling request of a rollout is seeded from (run
seed, row, version, sample index, call index), the trainer builds a step's batch in row order whatever order the
groups arrived in, and the hf replica decodes one sequence at a time (`--max-num-seqs 1`). The last is needed on
CPU: a sequence's logprobs move by ~1e-6 with whatever else shares its batch, and with batching on these runs
ended 1.3e-6 apart (two uninterrupted) and 6e-5 apart (resumed), against an update of 1.8e-3.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from fleetrl.trainer.checkpoint import STATE_FILE, latest_checkpoint
from tests.integration.up.conftest import (
    fleetrl_up,
    kill_trainer_after,
    read_metrics,
    write_run,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 6
# lr 3e-4 keeps the even-token reward below 1 for every step (at 1e-3 it saturates by step 4 and later steps
# train nothing, which would make the resumed steps trivially equal).
RUN = {"max_steps": STEPS, "synchronous_training": True, "dcp_save_interval": 1, "learning_rate": 3e-4}
UP = {"inference_args": ["--max-num-seqs", "1"]}


def final_weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "final" / "model.safetensors"))


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def steps_done(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / STATE_FILE).read_text())["steps_done"])


def run_to_the_end(tmp_path: Path, model_dir: str) -> Path:
    config = write_run(tmp_path, model_dir, RUN, UP)
    result = fleetrl_up(config)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["optim/grad_norm"] > 0 and m["data/groups_skipped"] == 0 for m in metrics)  # every step updates
    return tmp_path / "run"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> dict:
    """The final weights of one uninterrupted run (shared by the tests of this module)."""
    return final_weights(run_to_the_end(tmp_path_factory.mktemp("baseline"), tiny_model_dir))


def test_two_runs_with_the_same_seed_end_with_the_same_weights(baseline, tmp_path, tiny_model_dir):
    run_dir = run_to_the_end(tmp_path, tiny_model_dir)
    base = load_file(str(next(Path(tiny_model_dir).glob("*.safetensors"))))
    # The runs trained (the weights moved by far more than the tolerance) and ended at the same place.
    assert max_difference({k: v for k, v in baseline.items() if k in base}, base) > 5e-4
    assert max_difference(final_weights(run_dir), baseline) <= 1e-6


def test_a_killed_and_resumed_run_ends_with_the_uninterrupted_weights(baseline, tmp_path, tiny_model_dir):
    config = write_run(tmp_path, tiny_model_dir, RUN, UP)
    run_dir = tmp_path / "run"
    assert kill_trainer_after(config, run_dir, 3) == 1
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None
    saved = steps_done(checkpoint)
    assert 3 <= saved < STEPS  # killed mid-run: the resumed run has steps left to train

    resumed = fleetrl_up(config, extra=["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed at version {saved}" in (run_dir / "controller.log").read_text()
    assert steps_done(latest_checkpoint(run_dir / "checkpoints")) == STEPS
    assert max_difference(final_weights(run_dir), baseline) <= 1e-5
