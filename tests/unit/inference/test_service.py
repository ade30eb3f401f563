"""services/inference/server.py under the service shell, on a scripted engine (no model, HTTP API off): the ready
file keeps its keys, /metrics is the shell's endpoint serving the inference collectors, gRPC answers, and the
service closes with the exit code of its run."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

from fleetrl.rpc import open_channel
from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.server import advertised_address, create_server
from fleetrl.shell.service import EXIT_OK, ShellConfig, run_service
from fleetrl.v1 import inference_pb2, inference_pb2_grpc
from tests.unit.inference.fakes import ScriptedEngine


def _config(tmp_path: Path, **overrides: object) -> InferenceConfig:
    settings = {
        "model": "/models/fake",
        "engine": "hf",
        "grpc_port": 0,
        "http_port": None,
        "metrics_port": 0,
        "ready_file": str(tmp_path / "ready.json"),
        **overrides,
    }
    return InferenceConfig(**settings)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


async def test_the_shell_writes_the_ready_file_and_serves_the_inference_metrics(tmp_path: Path) -> None:
    config = _config(tmp_path)
    service = create_server(config, ScriptedEngine())
    seen: dict = {}

    async def probe(stop: asyncio.Event) -> int:  # runs once the shell wrote the ready file
        ready = json.loads(Path(config.ready_file).read_text())
        seen["ready"] = ready
        seen["metrics"] = await asyncio.to_thread(_scrape, ready["metrics_port"])
        async with open_channel(f"127.0.0.1:{ready['grpc_port']}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            seen["status"] = await stub.Status(inference_pb2.StatusRequest(), timeout=10)
        return EXIT_OK

    service.run = probe  # type: ignore[method-assign]
    assert await run_service(service, ShellConfig.of(config)) == EXIT_OK
    ready = seen["ready"]
    assert set(ready) == {"host", "grpc_port", "http_port", "metrics_port", "relay_address"}
    assert ready["host"] == "127.0.0.1" and ready["grpc_port"] == service.grpc_port and ready["http_port"] is None
    assert ready["relay_address"] == service.relay.address == seen["status"].relay_address
    assert ready["relay_address"].startswith("tcp://127.0.0.1:") and seen["status"].relay_version == 0
    assert isinstance(ready["metrics_port"], int) and ready["metrics_port"] > 0
    assert "fleetrl_inference_loaded_version 0.0" in seen["metrics"]
    assert (seen["status"].engine, seen["status"].model) == ("fake", "/models/fake")
    assert service.metrics_server is None  # the shell's endpoint, not one of its own


async def test_without_metrics_the_ready_file_says_so(tmp_path: Path) -> None:
    config = _config(tmp_path, metrics_port=None, relay_port=None)
    service = create_server(config, ScriptedEngine())
    seen: dict = {}

    async def probe(stop: asyncio.Event) -> int:
        seen["ready"] = json.loads(Path(config.ready_file).read_text())
        return EXIT_OK

    service.run = probe  # type: ignore[method-assign]
    assert await run_service(service, ShellConfig.of(config)) == EXIT_OK
    assert seen["ready"] == {
        "host": "127.0.0.1",
        "grpc_port": service.grpc_port,
        "http_port": None,
        "metrics_port": None,
        "relay_address": None,
    }


async def test_in_process_the_service_serves_its_own_metrics(tmp_path: Path) -> None:
    service = create_server(_config(tmp_path, ready_file=None), ScriptedEngine())
    info = await service.start()
    try:
        assert info["metrics_port"] == service.metrics_port is not None
        assert "fleetrl_inference_queue_depth 0.0" in await asyncio.to_thread(_scrape, service.metrics_port)
    finally:
        await service.stop()


async def test_run_ends_its_controller_registration_at_stop(tmp_path: Path) -> None:
    config = _config(tmp_path, controller_address="127.0.0.1:1", member_id="inference-test")
    service = create_server(config, ScriptedEngine())
    stop = asyncio.Event()
    stop.set()
    tasks_before = asyncio.all_tasks()
    assert await service.run(stop) == EXIT_OK
    assert asyncio.all_tasks() == tasks_before  # the registration task is gone
    await service.close(EXIT_OK)


def test_the_advertised_address_names_this_machine_for_a_wildcard_bind() -> None:
    assert advertised_address("10.0.0.5", 50051) == "10.0.0.5:50051"
    assert advertised_address("::1", 7) == "[::1]:7"
    assert not advertised_address("0.0.0.0", 7).startswith("0.0.0.0")
