"""fleetrl.commands.health against real servers: a fleetrl gRPC server with auth on, and a /metrics endpoint."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from fleetrl.commands.health import ProbeError, check_grpc, main, probe_target, resolves
from fleetrl.rpc import create_grpc_server
from fleetrl.telemetry import start_metrics_server
from tests.deploy.from_compose import load_compose
from tests.deploy.localstack import REPO
from tests.waiting import async_wait_until, wait_until


async def start_server(token: str | None = "secret"):  # type: ignore[no-untyped-def]
    health = HealthServicer()
    server, port = create_grpc_server([], port=0, auth_token=token, health=health)
    await server.start()
    return server, port, health


async def test_serving_server_is_healthy_without_the_token(capsys):
    server, port, _ = await start_server()
    try:
        assert await asyncio.to_thread(main, [f"127.0.0.1:{port}"]) == 0
        assert "SERVING" in capsys.readouterr().out
    finally:
        await server.stop(0)


async def test_not_serving_and_closed_ports_are_unhealthy(capsys, free_port):
    server, port, health = await start_server()
    try:
        await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert await asyncio.to_thread(main, [f"127.0.0.1:{port}"]) == 1
        assert "NOT_SERVING" in capsys.readouterr().err
        # Every address must serve: one healthy and one closed port is unhealthy.
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        assert await asyncio.to_thread(main, [f"127.0.0.1:{port}", f"127.0.0.1:{free_port}"]) == 1
        assert f"127.0.0.1:{free_port}" in capsys.readouterr().err
    finally:
        await server.stop(0)


async def test_if_exists_skips_names_that_do_not_resolve_only(free_port):
    server, port, _ = await start_server()
    try:
        args = [f"127.0.0.1:{port}", "--if-exists", "no-such-service.invalid:50061"]
        assert await asyncio.to_thread(main, args) == 0
        args = [f"127.0.0.1:{port}", "--if-exists", f"localhost:{free_port}"]  # resolves, not serving
        assert await asyncio.to_thread(main, args) == 1
    finally:
        await server.stop(0)
    assert not resolves("no-such-service.invalid:1") and resolves("localhost:1")


async def test_wait_retries_until_the_server_comes_up(capsys, free_port):
    err: list[str] = []

    def stderr() -> str:
        err.append(capsys.readouterr().err)
        return "".join(err)

    probe = asyncio.create_task(asyncio.to_thread(main, ["--wait", "60", f"127.0.0.1:{free_port}"]))
    # The server starts only after the probe has found it down, so a 0 means the probe retried.
    await async_wait_until(lambda: "waiting:" in stderr(), 30, "the probe to find the server down")
    assert not probe.done()
    server, _ = create_grpc_server([], port=free_port, health=HealthServicer())
    await server.start()
    try:
        assert await asyncio.wait_for(probe, 30) == 0
    finally:
        await server.stop(0)
    assert "healthy: SERVING" in capsys.readouterr().out


@pytest.mark.timeout(60)  # a probe that never gave up would hang here
def test_wait_gives_up_after_its_timeout(capsys, free_port):
    assert main(["--wait", "2", f"127.0.0.1:{free_port}"]) == 1
    err = capsys.readouterr().err
    assert "waiting:" in err  # it retried before giving up
    assert err.splitlines()[-1].startswith("unhealthy: ") and f"127.0.0.1:{free_port}" in err


def test_http_probe_checks_the_metrics_endpoint(free_port):
    metrics = start_metrics_server(0)
    try:
        assert main(["--http", metrics.url]) == 0
        assert main(["--http", f"http://127.0.0.1:{free_port}/metrics"]) == 1
    finally:
        metrics.close()


def test_usage_errors_exit_2():
    assert main([]) == 2
    assert main(["--auto", "127.0.0.1:1"]) == 2


def test_probe_targets_of_the_compose_commands():
    """--auto (the image HEALTHCHECK) finds the port each compose service's command serves on."""
    services = load_compose(REPO / "docker-compose.yml", {"FLEETRL_AUTH_TOKEN": "x"})["services"]
    expected = {
        "controller": ("grpc", "127.0.0.1:50050"),
        "inference": ("grpc", "127.0.0.1:50051"),
        "trainer": ("grpc", "127.0.0.1:50071"),
        "reference": ("grpc", "127.0.0.1:50061"),
        "gateway": ("http", "http://127.0.0.1:9404/metrics"),
    }
    for name, target in expected.items():
        assert probe_target(["tini", "--", "fleetrl", *services[name]["command"]]) == target, name
    assert probe_target(["fleetrl", "serve", "gateway", "--rollout", "m:f"]) is None  # no metrics port: alive
    assert probe_target(["fleetrl", "serve", "inference", "--model", "m"]) == ("grpc", "127.0.0.1:50051")
    with pytest.raises(ProbeError, match="not a `fleetrl serve"):
        probe_target(["python", "-m", "http.server"])
    with pytest.raises(ProbeError, match="unknown service"):
        probe_target(["fleetrl", "serve", "nothing"])


def _wait_exec(pid: int) -> None:
    """Until the child has exec'd (its /proc cmdline names `serve`): right after fork it is empty or the parent's,
    which the probe rightly refuses (seen under load)."""
    wait_until(lambda: b"serve" in Path(f"/proc/{pid}/cmdline").read_bytes(), 30.0, f"process {pid} to exec")


async def test_auto_reads_the_service_command_of_a_process(free_port):
    server, port, _ = await start_server()
    # A stand-in for the container's PID 1: its command line says which service and port.
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "serve", "controller", "--grpc-port", str(port)]
    )
    try:
        _wait_exec(proc.pid)
        assert await asyncio.to_thread(main, ["--auto", "--pid", str(proc.pid)]) == 0
        other = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)", "serve", "trainer", "--grpc-port", str(free_port)]
        )
        try:
            _wait_exec(other.pid)
            assert await asyncio.to_thread(main, ["--auto", "--pid", str(other.pid)]) == 1
        finally:
            other.kill()
            other.wait()
    finally:
        proc.kill()
        proc.wait()
        await server.stop(0)


def test_check_grpc_names_the_address_on_failure(free_port):
    with pytest.raises(ProbeError, match=f"127.0.0.1:{free_port}"):
        check_grpc(f"127.0.0.1:{free_port}", timeout_s=1)
