"""The shared service lifecycle (fleetrl/shell/service.py), driven with real signals, a real /metrics endpoint and a
real ready file."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from fleetrl.shell.service import EXIT_FAILED, EXIT_OK, Service, ShellConfig, run_service


class Recorder(Service):
    name = "recorder"

    def __init__(self, *, fail_start: bool = False, code: int = EXIT_OK, wait_for_stop: bool = False) -> None:
        self.fail_start = fail_start
        self.code = code
        self.wait_for_stop = wait_for_stop
        self.events: list[str] = []
        self.closed_with: int | None = None
        self.scraped = ""
        self.port = 0

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        Counter("recorder_things", "things", registry=registry).inc(3)
        self.events.append("metrics")

    async def start(self) -> dict:
        self.events.append("start")
        if self.fail_start:
            raise RuntimeError("cannot bind")
        return {"grpc_port": 1234}

    async def run(self, stop: asyncio.Event) -> int:
        self.events.append("run")
        if self.wait_for_stop:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, handled by the shell's handler on this loop
            await asyncio.wait_for(stop.wait(), 30)
        return self.code

    async def close(self, code: int) -> None:
        self.closed_with = code


def test_ready_file_names_every_endpoint_and_metrics_serve(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    service = Recorder()
    code = asyncio.run(run_service(service, ShellConfig(metrics_port=0, ready_file=ready)))
    info = json.loads(ready.read_text())
    assert code == EXIT_OK and service.closed_with == EXIT_OK
    assert info["grpc_port"] == 1234 and info["metrics_port"] > 0
    assert service.events == ["metrics", "start", "run"]


def test_metrics_endpoint_serves_the_services_collectors(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"

    class Scraping(Recorder):
        async def run(self, stop: asyncio.Event) -> int:
            port = json.loads(ready.read_text())["metrics_port"]
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())
            self.scraped = body.decode()
            return EXIT_OK

    service = Scraping()
    assert asyncio.run(run_service(service, ShellConfig(metrics_port=0, ready_file=ready))) == EXIT_OK
    assert "recorder_things_total 3.0" in service.scraped


def test_a_failing_start_exits_1_closes_and_writes_no_ready_file(tmp_path: Path, caplog) -> None:
    ready = tmp_path / "ready.json"
    service = Recorder(fail_start=True)
    code = asyncio.run(run_service(service, ShellConfig(ready_file=ready)))
    assert code == EXIT_FAILED and service.closed_with == EXIT_FAILED
    assert not ready.exists()
    assert "recorder failed" in caplog.text and "cannot bind" in caplog.text


def test_run_exit_code_is_the_process_exit_code() -> None:
    service = Recorder(code=3)
    assert asyncio.run(run_service(service, ShellConfig())) == 3
    assert service.closed_with == 3


def test_a_signal_sets_stop_and_the_service_ends_cleanly() -> None:
    service = Recorder(wait_for_stop=True)
    assert asyncio.run(run_service(service, ShellConfig())) == EXIT_OK
    assert service.closed_with == EXIT_OK


def test_on_signal_is_the_services_to_override() -> None:
    counts: list[int] = []

    class TwoSignals(Recorder):
        def on_signal(self, count: int, stop: asyncio.Event) -> None:
            counts.append(count)
            if count == 2:
                stop.set()

        async def run(self, stop: asyncio.Event) -> int:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.wait_for(stop.wait(), 30)
            return 130

    assert asyncio.run(run_service(TwoSignals(), ShellConfig())) == 130
    assert counts == [1, 2]


def test_signal_handlers_are_removed_afterwards() -> None:
    asyncio.run(run_service(Recorder(), ShellConfig()))
    with pytest.raises(KeyboardInterrupt):  # Python's own handler is back: SIGINT raises in the main thread again
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("SIGINT did not raise")
