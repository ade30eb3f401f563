"""`fleetrl up` with kl_beta > 0 on the tiny model, in each reference placement (issue 26 item 5): by default a
frozen copy in the trainer's ranks (`--reference local`, no reference process, no reference log), or with
reference_placement = "service" a reference service started on the trainer's device and dtype. Either way the KL
term reaches the loss and is logged."""

from __future__ import annotations

import pytest

from fleetrl import metric_names as mn
from tests.integration.up.conftest import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("placement", ["trainer", "service"])
def test_up_logs_the_kl_with_the_reference_in_each_placement(up_run, placement):
    up = {} if placement == "trainer" else {"reference_placement": "service"}
    result, run_dir = up_run({"kl_beta": 0.05, "max_steps": 2}, up)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    kl = [m[mn.KL_REFERENCE] for m in metrics]
    assert abs(kl[0]) < 1e-5  # step 1 trains the base weights: the policy is the reference (up to rounding)
    assert kl[1] > 0, kl  # then the policy has moved away from the frozen reference
    trainer_command = (run_dir / "trainer.log").read_text().splitlines()[0]  # the supervisor's "$ argv" line
    if placement == "trainer":
        assert "--reference local" in trainer_command
        assert not (run_dir / "reference.log").exists()
        assert "reference" not in result.stdout + result.stderr  # never started, never waited for
    else:
        reference_command = (run_dir / "reference.log").read_text().splitlines()[0]
        assert "--device cpu --dtype float32" in reference_command  # the trainer's CPU and compute dtype
        assert "--reference 127.0.0.1:" in trainer_command
        assert "reference ready" in result.stdout
