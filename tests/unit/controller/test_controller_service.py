"""The controller under the service shell (services/controller/server.py: ControllerService): the first signal
stops the run after the step in flight, a second (or one before the run started) stops it at once; exit codes
0/1/130; on the way out the trackers are closed with failed=(code == 1) and the journal is closed. The run loop
itself is replaced by a stand-in, so no trainer or replica is needed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest

from fleetrl import Config
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import RunFailed, RunStopped
from fleetrl.services.controller.server import ControllerService
from fleetrl.shell.service import ShellConfig, run_service


def make_config(tmp_path) -> ControllerConfig:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"q": i}) + "\n" for i in range(4)))
    run = Config(log_path=str(tmp_path / "run"), prompt_groups_per_step=2, completions_per_prompt=2)
    # heartbeat_interval_s bounds the wait on the way out (gateways see run_finished)
    return ControllerConfig(
        run=run, rows_path=str(rows), grpc_port=0, metrics_port=None, heartbeat_interval_s=0.01, heartbeat_timeout_s=1
    )


class Stub(ControllerService):
    """The real wiring with the orchestrator's run loop replaced by `loop(orchestrator, entered)`."""

    def __init__(self, config: ControllerConfig, loop: Callable[..., Awaitable[None]]) -> None:
        super().__init__(config)
        self.loop = loop
        self.entered = asyncio.Event()
        self.trackers_failed: list[bool] = []

    async def start(self) -> dict:
        info = await super().start()
        orchestrator = self.parts.orchestrator
        orchestrator.run = lambda: self.loop(orchestrator, self.entered)
        close_trackers = orchestrator.close_trackers

        def record(failed: bool) -> None:
            self.trackers_failed.append(failed)
            close_trackers(failed)

        orchestrator.close_trackers = record
        return info


async def forever(orchestrator, entered) -> None:
    entered.set()
    await asyncio.Event().wait()


async def until_stop_requested(orchestrator, entered) -> None:
    orchestrator.started = True
    entered.set()
    while not orchestrator.stop_requested:
        orchestrator.wakeup.clear()
        await orchestrator.wakeup.wait()
    raise RunStopped("stopped by a signal after step 0: --resume continues")


async def serve(service: Stub, stop: asyncio.Event) -> int:
    """start, run and close as the shell does, with `stop` in the test's hands."""
    await service.start()
    code = 1
    try:
        code = await service.run(stop)
    finally:
        await service.close(code)
    return code


async def test_a_signal_before_the_run_started_stops_it_at_once(tmp_path):
    service, stop = Stub(make_config(tmp_path), forever), asyncio.Event()
    running = asyncio.create_task(serve(service, stop))
    await service.entered.wait()
    service.on_signal(1, stop)
    assert await running == 130
    assert service.trackers_failed == [False]


async def test_the_first_signal_finishes_the_step_in_flight(tmp_path):
    service, stop = Stub(make_config(tmp_path), until_stop_requested), asyncio.Event()
    running = asyncio.create_task(serve(service, stop))
    await service.entered.wait()
    service.on_signal(1, stop)
    assert service.parts.orchestrator.stop_requested and stop.is_set()
    assert await running == 130
    assert not service._run_task.cancelled()  # it ended by itself (RunStopped), not cancelled
    assert service.trackers_failed == [False]


async def test_a_second_signal_stops_at_once(tmp_path):
    async def ignores_stop(orchestrator, entered) -> None:
        orchestrator.started = True
        await forever(orchestrator, entered)

    service, stop = Stub(make_config(tmp_path), ignores_stop), asyncio.Event()
    running = asyncio.create_task(serve(service, stop))
    await service.entered.wait()
    service.on_signal(1, stop)
    assert service.parts.orchestrator.stop_requested
    service.on_signal(2, stop)
    assert await running == 130
    assert service._run_task.cancelled()


async def test_a_failed_run_exits_1_and_closes_trackers_as_failed(tmp_path):
    async def fails(orchestrator, entered) -> None:
        raise RunFailed("no live trainer registered")

    service = Stub(make_config(tmp_path), fails)
    assert await serve(service, asyncio.Event()) == 1
    assert service.trackers_failed == [True]
    with pytest.raises(Exception, match="closed"):
        service.parts.journal.state()


async def test_under_the_shell_a_finished_run_exits_0_and_the_ready_file_names_the_port(tmp_path):
    async def finishes(orchestrator, entered) -> None:
        orchestrator.finished = True

    config = make_config(tmp_path)
    service, ready = Stub(config, finishes), tmp_path / "ready.json"
    assert await run_service(service, ShellConfig(ready_file=ready)) == 0
    info = json.loads(ready.read_text())
    assert info["grpc_port"] == service.parts.port > 0 and info["address"] == f"127.0.0.1:{service.parts.port}"
    assert service.trackers_failed == [False]
