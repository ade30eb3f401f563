"""The comparison tests/integration/up/test_determinism.py makes of two runs fails where the runs differ: other
samples at a step, a step missing, a step trained twice with other samples, weights more than 1 % of the update
apart. Files written here, no run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.integration.up import test_determinism as det


def write_run(run_dir: Path, steps: dict[int, list[list[str]]], weights: dict[str, torch.Tensor]) -> Path:
    """A run folder with samples.jsonl (each step's blocks of completions, as logged) and final weights."""
    (run_dir / "final").mkdir(parents=True)
    lines = [
        json.dumps({"step": step, "row_id": i // 4, "completion": text, "reward": 0.5})
        for step, blocks in steps.items()
        for block in blocks
        for i, text in enumerate(block)
    ]
    (run_dir / "samples.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "metrics.jsonl").write_text("")
    save_file(weights, str(run_dir / "final" / "model.safetensors"))
    return run_dir


INITIAL = {"w": torch.zeros(10)}
BASE_WEIGHTS = {"w": torch.ones(10)}
BASE_STEPS = {s: [[f"s{s}-{i}" for i in range(det.SAMPLES_PER_STEP)]] for s in range(1, det.STEPS + 1)}


@pytest.fixture
def baseline_run(tmp_path: Path) -> Path:
    return write_run(tmp_path / "base", BASE_STEPS, BASE_WEIGHTS)


def test_the_same_run_and_a_step_logged_twice_with_the_same_samples_pass(tmp_path, baseline_run):
    det.check_same_run(write_run(tmp_path / "same", BASE_STEPS, BASE_WEIGHTS), baseline_run, BASE_WEIGHTS, INITIAL)
    # Step 4 logged just before the kill and again first after the resume: adjacent in samples.jsonl.
    twice = {**BASE_STEPS, 4: BASE_STEPS[4] * 2}
    close = {"w": torch.ones(10) + 1e-3}  # 0.1 % of the update
    det.check_same_run(write_run(tmp_path / "resumed", twice, close), baseline_run, BASE_WEIGHTS, INITIAL)


@pytest.mark.parametrize(
    "steps",
    [
        {**BASE_STEPS, 3: [[*BASE_STEPS[3][0][:-1], "other"]]},  # one sample differs
        {s: b for s, b in BASE_STEPS.items() if s != 6},  # a step missing
        {**BASE_STEPS, 2: [BASE_STEPS[2][0][:-1]]},  # a sample missing
        {**BASE_STEPS, 4: [BASE_STEPS[4][0], [*BASE_STEPS[4][0][:-1], "other"]]},  # retrained with other samples
    ],
)
def test_other_samples_fail(tmp_path, baseline_run, steps):
    with pytest.raises(AssertionError):
        det.check_same_run(write_run(tmp_path / "run", steps, BASE_WEIGHTS), baseline_run, BASE_WEIGHTS, INITIAL)


def test_weights_more_than_one_percent_of_the_update_apart_fail(tmp_path, baseline_run):
    far = {"w": torch.ones(10) * 1.02}
    with pytest.raises(AssertionError, match=r"relative difference 0\.02"):
        det.check_same_run(write_run(tmp_path / "run", BASE_STEPS, far), baseline_run, BASE_WEIGHTS, INITIAL)
