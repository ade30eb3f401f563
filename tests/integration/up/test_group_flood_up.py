"""Genuine work is never starved, end to end (issue 45, item 4): with the run's token, 1,200 forged groups on the
trainer's group port of a `fleetrl up` run (more than its buffer holds). The genuine groups still get in, every step
is trained without waiting out the group timeout, and no forged sample is trained. Before, genuine groups were
refused as "buffer full" and each step waited the group timeout (300 s) for them: 18 steps in 7 minutes."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from fleetrl.group_stream import GroupSender
from fleetrl.rollout import RolloutSample
from fleetrl.rollout_group import RolloutGroup
from tests.integration.up.conftest import read_metrics, start_fleetrl_up, wait_for_steps, write_run
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_flood_of_forged_groups_does_not_stall_the_run(tmp_path, tiny_model_dir):
    # Rollouts with a slow tool call: the run is still going when the flood has been taken in.
    config = write_run(
        tmp_path,
        tiny_model_dir,
        {"max_steps": 12, "rollout_extras": {"tool_latency_s": 0.3}},
        {"rollout": "tests.integration.up.rollouts:make_slow_rollout_fn"},
        n_rows=48,
    )
    run_dir = tmp_path / "run"
    proc = start_fleetrl_up(config)
    try:
        wait_for_steps(proc, run_dir, 1)
        token = (run_dir / "auth_token").read_text().strip()
        trainer = json.loads((run_dir / "ready" / "trainer.json").read_text())
        address, metrics_url = trainer["groups_address"], f"http://127.0.0.1:{trainer['metrics_port']}/metrics"
        forged = RolloutSample([1, 2, 3], [0.0, -0.1, -0.1], [0, 1, 1], 1e9)
        with GroupSender(address, auth_token=token) as sender:
            for i in range(1200):  # rows the controller never leased, with made-up tags
                sender.send(RolloutGroup(10_000 + i, 0, [forged, forged], source="forger", attempt=1, lease_tag=i + 1))

        def pushed_out() -> float:  # groups a full buffer made room for (the flood overflowing it: 1,200 > 256)
            with urllib.request.urlopen(metrics_url, timeout=10) as reply:
                text = reply.read().decode()
            match = re.search(r"^fleetrl_trainer_groups_refused_full_total (\S+)$", text, re.M)
            return float(match.group(1)) if match else 0.0

        wait_until(lambda: pushed_out() >= 900, 120, "the flood taken in by the trainer")
        assert proc.poll() is None and len(read_metrics(run_dir)) < 12  # the run goes on after the flood
        _out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    metrics = read_metrics(run_dir)
    assert len(metrics) == 12
    assert all(m.get("rollout/raw_reward", 0) < 1e6 for m in metrics)  # no forged sample trained
    controller_log = (run_dir / "controller.log").read_text()
    assert "did not arrive within" not in controller_log  # no step sat out the group wait
    assert "dropped as too slow" not in controller_log
