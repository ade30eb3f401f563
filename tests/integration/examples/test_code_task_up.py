"""examples/code_task end to end: `fleetrl up` trains the tiny model on the code-writing task, each reward computed
by running the model's program in the sandbox inside the gateway process (the tiny model writes no working code, so
the check is that every sample was scored there and the run finished, not that it learned)."""

from __future__ import annotations

import pytest

from tests.integration.examples.own_data_up import up_own_example

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_code_task_trains_with_rewards_from_the_sandbox(tiny_model_dir, tmp_path):
    sets = {"base_model": tiny_model_dir, "max_steps": 2}
    metrics = up_own_example("code_task", tmp_path / "run", sets)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:  # every sample went through the sandbox: its metrics are the reward function's
        assert 0.0 <= m["env/all/tests_passed"] <= 3.0 and "env/all/sandbox_stopped" in m
    gateway_logs = "".join(p.read_text() for p in (tmp_path / "run").glob("gateway*.log"))
    assert "sandbox: " in gateway_logs  # the backend it chose, said once
