"""A replica that stops answering (SIGSTOP) is fenced within a few heartbeats, the weight push does not wait for
it, its rollouts go to the other replica, and it returns to rotation once it answers and serves the current
version."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest

from tests.integration.up.conftest import read_metrics, start_fleetrl_up, wait_for_steps, write_run
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def stop_while_serving(run_dir, index: int, proc, timeout_s: float = 120.0) -> int:
    """SIGSTOP replica `index` the moment its /metrics shows Generate calls in flight (so some are stuck on it);
    returns its pid."""
    import urllib.request

    pid = replica_pid(run_dir, index)
    port = json.loads((run_dir / "ready" / f"inference-{index}.json").read_text())["metrics_port"]

    def stopped_while_serving() -> bool:
        assert proc.poll() is None, "fleetrl up exited before the replica could be stopped"
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        serving = [line for line in text.splitlines() if line.startswith("fleetrl_inference_in_flight_requests ")]
        if serving and float(serving[0].split()[1]) >= 1:
            os.kill(pid, signal.SIGSTOP)
            return True
        return False

    wait_until(stopped_while_serving, timeout_s, f"replica {index} with a Generate call in flight", poll_s=0.002)
    return pid


def replica_pid(run_dir, index: int) -> int:
    """The inference replica `fleetrl up` started as inference-<index> (found by its ready file)."""
    out = subprocess.run(
        ["pgrep", "-f", f"serve inference .*{run_dir}/ready/inference-{index}.json"], capture_output=True, text=True
    )
    (pid,) = out.stdout.split()
    return int(pid)


def wait_for_text(path, text: str, proc, timeout_s: float = 120) -> None:
    def logged() -> bool:
        assert proc.poll() is None, f"fleetrl up exited before {text!r} was in {path.name}"
        return path.exists() and text in path.read_text()

    wait_until(logged, timeout_s, f"{text!r} in {path.name}", poll_s=0.2)


def test_a_stopped_replica_is_fenced_and_the_run_goes_on(tmp_path, tiny_model_dir):
    hold = tmp_path / "hold"
    config = write_run(
        tmp_path,
        tiny_model_dir,
        # Long completions keep Generate calls in flight (a row's calls go out as one request), so some are on the
        # replica when it stops.
        {
            # Enough steps that the run cannot end before the fence and three steps after it (it is held from
            # then until the replica is back); 40 steps only ran on longer after that.
            "max_steps": 20,
            "max_head_offpolicy_versions": 1,
            "rollout_extras": {"tool_latency_s": 0.1, "hold_file": str(hold)},
            "max_completion_tokens": 48,
            "max_seq_len": 96,
        },
        {
            "rollout": "tests.integration.up.rollouts:make_held_rollout_fn",
            "replicas": 2,
            # The default Generate timeout is 120 s: calls stuck on the stopped replica must move when it is fenced.
            # Status polls every 1 s instead of 2 s: the fence (two missed polls) comes in ~3 s instead of ~7 s.
            "controller_args": ["--heartbeat-interval", "1"],
        },
        n_rows=60,
    )
    run_dir = tmp_path / "run"
    proc = start_fleetrl_up(config)
    stopped = None
    try:
        wait_for_steps(proc, run_dir, 3)
        stopped = stop_while_serving(run_dir, 0, proc)
        controller_log = run_dir / "controller.log"
        wait_for_text(controller_log, "did not answer Status", proc)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        steps_at_fence = len(read_metrics(run_dir))
        # Training goes on with one replica: pushes do not wait for the stopped one, rollouts avoid it.
        wait_for_steps(proc, run_dir, steps_at_fence + 3, timeout_s=120)
        hold.touch()  # the run stays at this step until the resumed replica is back in rotation: it cannot end first
        resumed_at = controller_log.stat().st_size
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        wait_for_pattern(controller_log, r"replica inference-0 .*back in rotation", proc, after=resumed_at)
        hold.unlink()
        _, err = proc.communicate(timeout=300)
    finally:
        if stopped is not None and proc.poll() is None:
            os.kill(stopped, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    steps = [m for m in read_metrics(run_dir) if "train/loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 21))
    assert all(m["async/version_offset_max"] <= 1 for m in steps)
    # No row waited out the 120 s Generate timeout: calls stuck on the stopped replica moved to the other as soon as
    # it was fenced (the mechanism is unit-tested: test_calls_in_flight_to_a_fenced_replica_move_to_another_at_once).
    # Whether any call was on it when it stopped is a race (a row's calls are one short request now), so the log line
    # "calls in flight retried elsewhere" is not required; a stuck row would show in the gateway's worst latency.
    gateway_log = (run_dir / "gateway-0.log").read_text()
    worst_ms = float(re.search(r"p99=([\d.]+) ms", gateway_log).group(1))
    assert worst_ms < 60_000, gateway_log[-2000:]


def replica_status(address: str, token: str):
    import grpc

    from fleetrl.v1 import inference_pb2, inference_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        return stub.Status(inference_pb2.StatusRequest(), metadata=[("authorization", f"Bearer {token}")], timeout=10)


def wait_for_pattern(path, pattern: str, proc, after: int = 0, timeout_s: float = 240) -> str:
    """The first match of `pattern` in `path` past byte `after` (fails if `proc` exits or time runs out)."""
    found: list[str] = []

    def matched() -> bool:
        assert proc.poll() is None, f"fleetrl up exited before {pattern!r} was in {path.name}"
        match = re.search(pattern, path.read_bytes()[after:].decode(errors="replace")) if path.exists() else None
        if match:
            found.append(match.group(0))
        return bool(match)

    wait_until(matched, timeout_s, f"{pattern!r} in {path.name}", poll_s=0.2)
    return found[0]


def held_run(tmp_path, tiny_model_dir, max_steps: int, replicas: int):
    """A run whose rollouts wait after sampling while `hold` exists (the test holds it still around a change)."""
    hold = tmp_path / "hold"
    extras = {"hold_file": str(hold)}
    config = write_run(
        tmp_path,
        tiny_model_dir,
        {"max_steps": max_steps, "max_head_offpolicy_versions": 1, "rollout_extras": extras},
        {"rollout": "tests.integration.up.rollouts:make_held_rollout_fn", "replicas": replicas},
        n_rows=3 * max_steps,
    )
    return config, hold


def test_a_killed_replica_is_restarted_rejoins_and_no_row_is_lost_or_trained_twice(tmp_path, tiny_model_dir):
    from tests.integration.up.test_up_modes import check_ledger

    config, hold = held_run(tmp_path, tiny_model_dir, max_steps=10, replicas=2)
    run_dir = tmp_path / "run"
    controller_log = run_dir / "controller.log"
    proc = start_fleetrl_up(config)
    try:
        wait_for_steps(proc, run_dir, 3)
        hold.touch()  # the run stays at this step until the restarted replica is back in rotation
        killed_at = controller_log.stat().st_size
        os.kill(replica_pid(run_dir, 0), signal.SIGKILL)
        # fleetrl up restarts it on new ports; it registers as inference-0 at its new address (version 0, fenced)
        # and the controller pushes it the current version.
        wait_for_pattern(controller_log, r"replica inference-0 .*back in rotation", proc, after=killed_at)
        hold.unlink()
        _, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "inference-0 exited with -9; starting inference-0-r1 (rejoins as inference-0)" in err
    restarted_log = (run_dir / "inference-0-r1.log").read_text()
    assert "registered with the controller as inference inference-0" in restarted_log
    assert "loaded weights version" in restarted_log
    steps = [m for m in read_metrics(run_dir) if "train/loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 11))
    check_ledger(run_dir, steps=10, groups_per_step=2)  # every row trained exactly once


def test_with_its_only_replica_killed_the_run_waits_for_the_restart_and_loses_no_row(tmp_path, tiny_model_dir):
    from tests.integration.up.test_up_modes import check_ledger

    config, _ = held_run(tmp_path, tiny_model_dir, max_steps=8, replicas=1)
    run_dir = tmp_path / "run"
    proc = start_fleetrl_up(config)
    try:
        wait_for_steps(proc, run_dir, 3)
        os.kill(replica_pid(run_dir, 0), signal.SIGKILL)  # nothing can be sampled until the restart is caught up
        _, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "starting inference-0-r1 (rejoins as inference-0)" in err
    assert [m["step"] for m in read_metrics(run_dir) if "train/loss" in m] == list(range(1, 9))
    check_ledger(run_dir, steps=8, groups_per_step=2)
    gateway_log = (run_dir / "gateway-0.log").read_text()
    # Calls waited for the restarted replica: no rollout failed, so no breaker count and no rejected row.
    assert "rollout raised" not in gateway_log and "circuit breaker" not in gateway_log


def test_a_replica_started_by_hand_joins_a_running_run_and_takes_traffic(tmp_path, tiny_model_dir):
    import json
    import sys

    from fleetrl.ready_file import wait_ready_file
    from tests.integration.up.conftest import REPO

    config, hold = held_run(tmp_path, tiny_model_dir, max_steps=12, replicas=2)
    run_dir = tmp_path / "run"
    proc = start_fleetrl_up(config)
    extra = None
    try:
        wait_for_steps(proc, run_dir, 2)
        hold.touch()  # held still while the third replica starts and is brought to the current version
        controller = json.loads((run_dir / "ready" / "controller.json").read_text())["address"]
        token = (run_dir / "auth_token").read_text().strip()
        ready = tmp_path / "extra.json"
        argv = [sys.executable, "-m", "fleetrl", "serve", "inference", "--model", tiny_model_dir]
        argv += ["--engine", "hf", "--grpc-port", "0", "--no-http", "--no-metrics", "--ready-file", str(ready)]
        argv += ["--controller", controller, "--member-id", "inference-extra"]
        env = {**os.environ, "FLEETRL_AUTH_TOKEN": token, "OMP_NUM_THREADS": "1"}
        with open(tmp_path / "extra.log", "wb") as log:
            extra = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        address = f"127.0.0.1:{wait_ready_file(ready, 240, extra)['grpc_port']}"
        line = wait_for_pattern(run_dir / "controller.log", r"replica inference-extra .*back in rotation", proc)
        pushed = int(line.split("version ")[1].split()[0].rstrip(":"))
        assert pushed >= 2 and replica_status(address, token).loaded_version >= pushed  # brought to the run's version
        hold.unlink()

        def took_rollouts() -> bool:  # its counter outlives the run: no race with the run's end
            return replica_status(address, token).requests > 0

        wait_until(took_rollouts, 240, "the joined replica to take rollouts", poll_s=0.2)
        extra.terminate()  # it leaves the run: fenced after missed polls, calls to it retried on the others
        extra.wait(timeout=60)
        _, err = proc.communicate(timeout=400)
    finally:
        if extra is not None and extra.poll() is None:
            extra.kill()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "registered with the controller as inference inference-extra" in (tmp_path / "extra.log").read_text()
    assert [m["step"] for m in read_metrics(run_dir) if "train/loss" in m] == list(range(1, 13))
