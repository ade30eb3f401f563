"""A rollout scores through the judge pool under `fleetrl up` (issue 32 part 3): examples/judge on the tiny model
with a judge of other weights (same tokenizer) in a pool of two frozen replicas. The example's rollout awaits the
judge's answer for every sample and raises without a judge pool, so trained steps carrying its metrics mean the
judge answered; the judges run as their own processes (judge-<i>.log) and the controller never lists them."""

from __future__ import annotations

import pytest

from fleetrl.tiny_model import build_tiny_model
from tests.integration.examples.arithmetic_up import step_metrics, up_example

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_rollout_scores_through_the_judge_pool(tiny_model_dir, tmp_path):
    judge = str(build_tiny_model(tmp_path / "judge", seed=5))
    result, log_path = up_example(
        "judge", tiny_model_dir, tmp_path, **{"up.judge_model": judge, "up.judge_replicas": 2}
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    steps = step_metrics(log_path)
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert 0.0 <= m["env/all/judged"] <= 1.0 and "env/all/judge_correct" in m  # the judge's verdicts
    for i in range(2):
        log = (log_path / f"judge-{i}.log").read_text()
        assert f"--model {judge}" in log and "serve inference" in log
    controller = (log_path / "controller.log").read_text().splitlines()[0]
    assert controller.count("--inference") == 1  # the policy replica only: the judges are never sent weights
