"""`fleetrl serve gateway` as a service (services/gateway/server.py): the library's gateway under the shell, with
the exit codes, ready file and /metrics a gateway process always had; and `run_gateway`/`build_gateway`
(fleetrl/gateway/run.py), the library's entry that in-process gateways share."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fleetrl import Config
from fleetrl.exit_codes import EXIT_CIRCUIT_OPEN, EXIT_USER_CODE
from fleetrl.gateway.circuit_breaker import CircuitBreaker
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.run import UserCodeError, build_gateway, run_gateway
from fleetrl.services.gateway.server import GatewayService, serve
from fleetrl.shell.service import EXIT_FAILED, EXIT_OK, EXIT_SIGNALLED, ShellConfig, run_service


class FakeGateway:
    """What the service reads of a `Gateway`: `run()`, and `counters`/`breaker`/`row_seconds_sum` for /metrics."""

    def __init__(self, code: int = EXIT_OK, *, error: Exception | None = None, ready_file: Path | None = None) -> None:
        self.code = code
        self.error = error
        self.ready_file = ready_file
        self.counters: Counter[str] = Counter({"rollouts_ok": 5, "rows_accepted": 2, "rows_done": 2})
        self.breaker = CircuitBreaker(window=2, min_attempts=1, max_failure_rate=0.5)
        self.row_seconds_sum = 1.5
        self.scraped = ""
        self.ready_at_run: dict[str, Any] | None = None

    async def run(self) -> int:
        if self.ready_file is not None:  # the ready file is written before the gateway runs
            self.ready_at_run = json.loads(self.ready_file.read_text())
            port = self.ready_at_run["metrics_port"]
            if port is not None:
                url = f"http://127.0.0.1:{port}/metrics"
                self.scraped = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
        if self.error is not None:
            raise self.error
        return self.code


def test_metrics_and_the_ready_file_are_served_and_the_gateways_exit_code_is_the_services(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    gateway = FakeGateway(EXIT_CIRCUIT_OPEN, ready_file=ready)
    code = asyncio.run(run_service(GatewayService(gateway), ShellConfig(metrics_port=0, ready_file=ready)))  # type: ignore[arg-type]
    assert code == EXIT_CIRCUIT_OPEN
    assert gateway.ready_at_run is not None and set(gateway.ready_at_run) == {"metrics_port"}
    assert gateway.ready_at_run["metrics_port"] > 0
    assert 'fleetrl_gateway_rollouts_total{result="ok"} 5.0' in gateway.scraped
    assert "fleetrl_gateway_rows_done_total 2.0" in gateway.scraped


def test_without_metrics_the_ready_file_says_metrics_port_none(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    gateway = FakeGateway(EXIT_OK, ready_file=ready)
    code = asyncio.run(run_service(GatewayService(gateway), ShellConfig(metrics_port=None, ready_file=ready)))  # type: ignore[arg-type]
    assert code == EXIT_OK
    assert json.loads(ready.read_text()) == {"metrics_port": None}


def test_a_gateway_that_raises_exits_1() -> None:
    gateway = FakeGateway(error=RuntimeError("controller lost"))
    assert asyncio.run(run_service(GatewayService(gateway), ShellConfig())) == EXIT_FAILED  # type: ignore[arg-type]


def test_a_stop_cancels_the_running_gateway() -> None:
    cancelled = []

    class Endless(FakeGateway):
        async def run(self) -> int:
            self.started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(True)
                raise
            return EXIT_OK

    async def main() -> int:
        gateway = Endless()
        gateway.started = asyncio.Event()  # type: ignore[attr-defined]
        stop = asyncio.Event()
        running = asyncio.create_task(GatewayService(gateway).run(stop))  # type: ignore[arg-type]
        await gateway.started.wait()  # type: ignore[attr-defined]
        stop.set()
        return await running

    assert asyncio.run(main()) == EXIT_SIGNALLED
    assert cancelled == [True]


def gateway_config(tmp_path: Path, base_model: str, **values: Any) -> GatewayConfig:
    run = Config(base_model=base_model, dataset="unused", completions_per_prompt=2)
    return GatewayConfig(run=run, ready_file=str(tmp_path / "ready.json"), **values)


def test_a_rollout_factory_that_cannot_be_loaded_exits_4_before_the_ready_file(
    tmp_path: Path, tiny_model_dir: str
) -> None:
    config = gateway_config(tmp_path, tiny_model_dir, rollout="fleetrl_no_such_module:make_rollout_fn")
    assert asyncio.run(serve(config)) == EXIT_USER_CODE
    assert not (tmp_path / "ready.json").exists()


def test_user_code_that_cannot_be_loaded_is_a_user_code_error_naming_it(tmp_path: Path) -> None:
    config = gateway_config(tmp_path, "unused", rollout="unused:unused", dynamic_filter="fleetrl_no_such_module:keep")
    with pytest.raises(UserCodeError, match="fleetrl_no_such_module"):
        build_gateway(config, lambda setup: None, tokenizer=object())
    assert asyncio.run(run_gateway(config, lambda setup: None, tokenizer=object())) == EXIT_USER_CODE
