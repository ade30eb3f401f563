"""Real rollouts fail a few percent of the time: the run goes on (failures dropped and counted). A rollout function
that always fails stops the run with the user's exception: test_up_failures.py's circuit-breaker test (one run of
that configuration for the suite, issue 29)."""

from __future__ import annotations

import pytest

from tests.integration.up.conftest import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FLAKY = {"rollout": "tests.integration.up.rollouts:make_flaky_rollout_fn"}


@pytest.mark.parametrize("share", [0.05, 0.2])
def test_a_share_of_failing_rollouts_does_not_stop_the_run(up_run, share):
    # P = 16, G = 8: 128 rollouts start together; the failing ones fail at once, ahead of the successes.
    run = {
        "prompt_groups_per_step": 16,
        "completions_per_prompt": 8,
        "max_steps": 2,
        "max_completion_tokens": 4,
        "rollout_extras": {"fail_share": share},
    }
    result, run_dir = up_run(run, FLAKY, n_rows=64)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    steps = [m for m in read_metrics(run_dir) if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert steps[-1]["producer/samples_dropped_error"] > 0  # the failures were dropped and counted
