"""examples/custom_loss under `fleetrl up` on the tiny model: the trainer imports the loss named by import path from
the config's folder and trains two steps with it (its own metric, train/stale_frac, reaches metrics.jsonl); a path
naming nothing stops the trainer at start with a message naming policy_loss."""

from __future__ import annotations

import pytest

from tests.integration.examples.arithmetic_up import step_metrics, up_example

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_example_loss_trains_under_fleetrl_up(tiny_model_dir, tmp_path):
    result, log_path = up_example("custom_loss", tiny_model_dir, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    steps = step_metrics(log_path)  # the loss is found through the config's folder, not the working directory
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert 0.0 <= m["train/stale_frac"] <= 1.0  # the custom loss's own metric: it ran in the trainer


def test_a_loss_path_naming_nothing_stops_the_trainer_at_start(tiny_model_dir, tmp_path):
    result, log_path = up_example("custom_loss", tiny_model_dir, tmp_path, policy_loss="my_losses:missing_loss")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "policy_loss 'my_losses:missing_loss': module 'my_losses' has no attribute 'missing_loss'" in output
    assert not (log_path / "metrics.jsonl").exists() or "data/samples" not in (log_path / "metrics.jsonl").read_text()
