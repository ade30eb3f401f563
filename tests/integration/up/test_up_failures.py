"""`fleetrl up` under failure: a gateway killed mid-run, a rollout function that misbehaves, auth tokens."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from fleetrl.commands.status import fetch_status
from fleetrl.controller.journal import Journal
from fleetrl.group_stream import GroupSender
from fleetrl.rollout import RolloutSample
from fleetrl.rollout_group import RolloutGroup
from tests.integration.up.conftest import (
    REPO,
    read_metrics,
    service_pids,
    start_fleetrl_up,
    wait_for_steps,
    write_run,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_kill_one_of_two_gateways_mid_run(tmp_path, tiny_model_dir):
    from tests.integration.up.test_replica_faults import wait_for_text

    hold = tmp_path / "hold"
    config = write_run(
        tmp_path,
        tiny_model_dir,
        {
            "max_steps": 5,
            "max_head_offpolicy_versions": 1,
            "rollout_extras": {"tool_latency_s": 0.3, "hold_file": str(hold)},
        },
        {
            "gateways": 2,
            "rollout": "tests.integration.up.rollouts:make_held_rollout_fn",
            "controller_args": ["--lease-timeout", "120", "--heartbeat-timeout", "5"],
            "gateway_args": ["--max-rows-in-flight", "1"],  # both gateways always hold a row
            "auth_token": "s3cret-token",
        },
        n_rows=40,
    )
    run_dir = tmp_path / "run"
    proc = start_fleetrl_up(config)
    try:
        wait_for_steps(proc, run_dir, 1)
        # Held still until the replacement gateway has joined: the run cannot finish first (it did once, and
        # `fleetrl up` then waited out 15 s for a gateway started after the run's end).
        hold.touch()
        # A client without the run's token is refused by the controller.
        ready = (run_dir / "ready" / "controller.json").read_text()
        address = __import__("json").loads(ready)["address"]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(fetch_status(address))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        victims = service_pids(config, "gateway")
        assert len(victims) == 2
        os.kill(victims[0], signal.SIGKILL)
        wait_for_text(run_dir / "gateway-r1.log", "started (controller", proc, timeout_s=240)
        hold.unlink()
        _out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "starting gateway-r1" in err  # the killed gateway was replaced
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    # The killed gateway missed its heartbeats: its row came back long before its 120 s lease would expire.
    assert metrics[-1]["producer/rows_requeued_expired"] >= 1
    rows = Journal(run_dir / "controller.sqlite").rows()
    trained = [r for r, info in rows.items() if info["status"] == "trained"]
    assert len(trained) == 5 * 2 and len(set(trained)) == len(trained)
    assert all(info["trained_count"] <= 1 for info in rows.values())
    assert all(info["status"] in ("trained", "queued", "rejected") for info in rows.values())


def test_misbehaving_rollouts_are_dropped_and_counted(up_run):
    result, run_dir = up_run({"max_steps": 3}, {"rollout": "tests.integration.up.rollouts:make_faulty_rollout_fn"})
    assert result.returncode == 0, result.stderr[-3000:]
    last = read_metrics(run_dir)[-1]
    assert last["step"] == 3
    assert last["producer/samples_dropped_error"] >= 1
    assert last["producer/samples_dropped_none"] >= 1
    assert last["producer/samples_dropped_invalid"] >= 1
    gateway_log = (run_dir / "gateway-0.log").read_text()
    assert "ZeroDivisionError" in gateway_log and "invalid RolloutSample.loss_mask" in gateway_log


def test_a_rollout_that_always_fails_opens_the_circuit_breaker(up_run):
    result, _ = up_run({}, {"rollout": "tests.integration.up.rollouts:make_broken_rollout_fn"}, timeout_s=300)
    assert result.returncode == 1
    assert "circuit breaker open" in result.stderr
    assert "20 of the last 20 rollouts failed" in result.stderr and "KeyError" in result.stderr


def test_status_then_a_crashed_trainer_stops_the_run_with_its_log_tail(tmp_path, tiny_model_dir):
    config = write_run(
        tmp_path,
        tiny_model_dir,
        {"max_steps": 50, "rollout_extras": {"tool_latency_s": 0.3}},
        {"rollout": "tests.integration.up.rollouts:make_slow_rollout_fn"},
        n_rows=200,
    )
    run_dir = tmp_path / "run"
    proc = start_fleetrl_up(config)
    try:
        wait_for_steps(proc, run_dir, 1)
        address = __import__("json").loads((run_dir / "ready" / "controller.json").read_text())["address"]
        # Auth is on by default: the run's random token is in its log folder, and a client without it is refused.
        assert (run_dir / "auth_token").stat().st_mode & 0o777 == 0o600
        status = subprocess.run(
            [sys.executable, "-m", "fleetrl", "status", "--run", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert "trained steps" in status.stdout and "trainer" in status.stdout and "gateway" in status.stdout
        assert "trainer version " in status.stdout  # asked of the trainer itself
        # With no argument, from the run's folder: found from its ready files; --json keeps numbers as numbers.
        here = subprocess.run(
            [sys.executable, "-m", "fleetrl", "status", "--json"],
            cwd=run_dir,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert here.returncode == 0, here.stderr
        reply = json.loads(here.stdout)
        assert isinstance(reply["trained_steps"], int) and reply["trained_steps"] >= 1
        assert isinstance(reply["trainer"]["version"], int) and reply["trainer"]["version"] >= 1
        assert reply["trainer"]["steps_done"] >= reply["trained_steps"] and reply["log_path"] == str(run_dir)
        refused = subprocess.run(
            [sys.executable, "-m", "fleetrl", "status", address], capture_output=True, text=True, timeout=60
        )
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
        # A local process injecting a forged group (row 0, a reward of 1e9) without the token: dropped unread.
        trainer_info = __import__("json").loads((run_dir / "ready" / "trainer.json").read_text())
        forged = RolloutSample([1, 2, 3], [0.0, -0.1, -0.1], [0, 1, 1], 1e9)
        with GroupSender(trainer_info["groups_address"], auth_token="") as sender:
            sender.send(RolloutGroup(0, 0, [forged, forged], attempt=1))
        deadline = time.monotonic() + 60
        while "dropped (auth)" not in (run_dir / "trainer.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "dropped (auth)" in (run_dir / "trainer.log").read_text()
        os.kill(service_pids(config, "trainer")[0], signal.SIGKILL)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "trainer exited with code -9" in err
    assert "--- last lines of" in err and "trainer.log" in err
    assert len(read_metrics(run_dir)) < 50  # the run stopped; it did not keep going without a trainer


def test_a_run_that_trains_nothing_fails_and_exports_nothing(up_run):
    # Every prompt is longer than max_seq_len: the gateway drops every sample as too long and rejects every row.
    # The run must not end as a success with the untrained model exported as final/.
    result, run_dir = up_run({"max_seq_len": 5, "max_completion_tokens": 2}, n_rows=6, timeout_s=300)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert "all 6 rows rejected: 6 too long for max_seq_len 5" in result.stderr
    assert "run finished" not in result.stdout
    assert not (run_dir / "final").exists()
    assert read_metrics(run_dir) == []


def test_a_rollout_factory_that_cannot_be_imported_fails_at_start_without_restarts(up_run):
    # Refused by the config check before any service starts (issue 45: it used to fail in gateway-0, rc 1, once
    # every service had started); exit 2, naming up.rollout and the module.
    result, run_dir = up_run(up={"rollout": "tests.integration.up.no_such_module:make_rollout_fn"}, timeout_s=240)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "fleetrl up: up.rollout:" in result.stderr
    assert "cannot import module 'tests.integration.up.no_such_module'" in result.stderr
    assert not list(run_dir.glob("*.log"))  # no service was started
