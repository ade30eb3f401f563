"""The controller's wiring: journal + scheduler + registry + trackers + orchestrator + gRPC server
(`create_server`), and `ControllerService`, the controller's life under the service shell (fleetrl.shell)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from fleetrl.controller.dataset import DatasetCursor, load_rows
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.journal import Journal
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.mixture import build_mixture
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.rpc import create_grpc_server
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.metrics import ControllerMetrics
from fleetrl.services.controller.orchestrator import Orchestrator, RunStopped
from fleetrl.services.controller.servicer import ControllerServicer
from fleetrl.shell.service import EXIT_FAILED, EXIT_OK, EXIT_SIGNALLED, Service
from fleetrl.trackers import make_trackers
from fleetrl.v1 import controller_pb2_grpc

log = logging.getLogger(__name__)
RUN_END = "run_end.json"
"""In log_path, written when the controller stops: how the run ended (`Orchestrator.end_record`)."""


@dataclass
class ControllerServer:
    config: ControllerConfig
    server: grpc.aio.Server
    port: int
    scheduler: RowScheduler
    members: MemberRegistry
    orchestrator: Orchestrator
    journal: Journal

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"


def build_scheduler(config: ControllerConfig, journal: Journal) -> RowScheduler:
    run = config.run
    mixture = None
    if run.datasets and not config.rows_path:  # several sources, each drawn by weight (fleetrl.controller.mixture)
        sources = [load_rows(source.path, max_rows=run.max_rows) for source in run.datasets]
        mixture = build_mixture(
            run.datasets,
            sources,
            epochs=run.epochs,
            shuffle=run.shuffle,
            seed=run.seed,
            groups_per_step=run.prompt_groups_per_step,
        )
        rows = sources[0]
    else:
        rows = load_rows(config.rows_path or run.dataset or "", max_rows=run.max_rows)
    kwargs = dict(
        prompt_groups_per_step=run.prompt_groups_per_step,
        stale_policy=run.stale_policy,
        lease_timeout_s=config.lease_timeout_s,
        max_attempts=config.max_row_attempts,
        max_stale_attempts=config.max_stale_attempts,
        max_steps=run.max_steps,
    )

    def gate_at(version: int) -> OffPolicyGate:
        return OffPolicyGate(
            run.prompt_groups_per_step,
            run.completions_per_prompt,
            run.max_head_offpolicy_versions,
            max_concurrency=run.max_concurrency,
            synchronous=run.synchronous_training,
            version=version,
        )

    cursor_kwargs = dict(epochs=run.epochs, shuffle=run.shuffle, seed=run.seed)
    if config.resume and journal.state():
        scheduler = RowScheduler.resume(journal, rows, gate_at, cursor_kwargs, cursor=mixture, **kwargs)
        log.info("resumed from %s at version %d", journal.path, scheduler.gate.version)
        return scheduler
    return RowScheduler(mixture or DatasetCursor(rows, **cursor_kwargs), gate_at(0), journal=journal, **kwargs)


def create_server(config: ControllerConfig) -> ControllerServer:
    run = config.run
    log_path = Path(run.log_path)
    journal_path = Path(config.journal_path or log_path / "controller.sqlite")
    if not config.resume and journal_path.exists():
        journal_path.unlink()  # a fresh run starts a fresh ledger
        for suffix in ("-wal", "-shm"):
            Path(str(journal_path) + suffix).unlink(missing_ok=True)
    (log_path / RUN_END).unlink(missing_ok=True)  # a live run has none: `fleetrl status` asks the controller
    journal = Journal(journal_path, give_up_s=config.stall_timeout_s)  # waits out another process's lock
    scheduler = build_scheduler(config, journal)
    members = MemberRegistry(config.heartbeat_timeout_s)
    metrics_path = Path(config.metrics_jsonl or log_path / "metrics.jsonl")
    # At start, so a tracker that cannot start (or take the config) fails the run before anything trains; the
    # resolved config goes to <log_path>/config.json and every tracker.
    trackers = make_trackers(run, metrics_path=metrics_path, resume=config.resume)
    try:
        trackers.log_config(run.model_dump(mode="json"))
    except Exception:
        trackers.close(failed=True)
        raise
    now = time.monotonic()  # leases, heartbeats and liveness: never the wall clock, which can step
    if config.trainer_address:
        members.register("trainer", "trainer", config.trainer_address, now)
    for i, address in enumerate(config.inference_addresses):
        members.register("inference", f"inference-{i}", address, now, version=scheduler.gate.version)
    orchestrator = Orchestrator(config, scheduler, members, metrics_path=metrics_path, trackers=trackers)
    servicer = ControllerServicer(
        scheduler, members, orchestrator, run_id=uuid.uuid4().hex[:12], heartbeat_interval_s=config.heartbeat_interval_s
    )
    server, port = create_grpc_server(
        [lambda s: controller_pb2_grpc.add_ControllerServicer_to_server(servicer, s)],
        host=config.host,
        port=config.grpc_port,
        auth_token=config.auth_token,
        max_receive_mb=16,  # its requests (leases, reports, heartbeats) are small; its replies carry rows
    )
    return ControllerServer(config, server, port, scheduler, members, orchestrator, journal)


class ControllerService(Service):
    """The controller under the service shell (fleetrl.shell.service): the run loop is the service's life.

    Exit codes: 0 when the data (or max_steps) is used up and the trainer exported the final model; 1 when the run
    fails; 130 when a signal stops it. The first SIGINT/SIGTERM stops the run after the step in flight (its metrics
    line is written and the trainer, stopped after the controller by `fleetrl up`, checkpoints it); before the run
    has started there is nothing to finish, and a second signal stops at once."""

    name = "controller"

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.parts: ControllerServer | None = None
        self._registry: CollectorRegistry | None = None
        self._run_task: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        self._registry = registry  # the collector reads the parts `start` builds

    async def start(self) -> dict[str, Any]:
        self.parts = ctl = create_server(self.config)
        await ctl.server.start()
        if self._registry is not None:
            ControllerMetrics(self._registry, ctl.scheduler, ctl.members, ctl.orchestrator)
        log.info("controller serving on %s", ctl.address)
        return {"grpc_port": ctl.port, "address": ctl.address}

    async def run(self, stop: asyncio.Event) -> int:
        assert self.parts is not None
        self._stop = stop
        if stop.is_set():  # a signal while starting: the run has not started, nothing to finish
            log.info("controller stopped by signal")
            return EXIT_SIGNALLED
        self._run_task = asyncio.create_task(self.parts.orchestrator.run(), name="orchestrator")
        try:
            await self._run_task
        except (asyncio.CancelledError, RunStopped) as exc:
            if isinstance(exc, asyncio.CancelledError) and not stop.is_set():  # cancelled from outside
                raise
            log.info("controller stopped by signal")
            return EXIT_SIGNALLED
        except Exception:  # the orchestrator logged why
            return EXIT_FAILED
        return EXIT_OK

    def on_signal(self, count: int, stop: asyncio.Event) -> None:
        stop.set()
        orchestrator = self.parts.orchestrator if self.parts is not None else None
        if orchestrator is None or orchestrator.stop_requested or not orchestrator.started:
            if self._run_task is not None:
                self._run_task.cancel()
        else:
            log.info("stopping after the step in flight (signal again to stop now)")
            orchestrator.request_stop()

    async def close(self, code: int) -> None:
        ctl = self.parts
        if ctl is None:  # building failed (a tracker that cannot start, a bad dataset): nothing was started
            return
        # Let gateways see run_finished before the server goes away (waiting only for those not told yet). An idle
        # gateway's held lease call answers at once; a busy one (a row task still finishing) calls next within a
        # heartbeat interval, so wait that long and a little more: a shorter wait left such a gateway retrying a
        # controller that was gone.
        await ctl.orchestrator.wait_gateways_told(self.config.heartbeat_interval_s + 1.0)
        await ctl.server.stop(grace=2.0)
        await ctl.orchestrator.close()
        if ctl.orchestrator.finished:  # the run loop ran and ended (not a stop before it started)
            write_end_record(Path(self.config.run.log_path) / RUN_END, ctl.orchestrator.end_record())
        ctl.orchestrator.close_trackers(failed=code == EXIT_FAILED)
        ctl.journal.close()
        linger = self.config.metrics_linger_s
        if code == EXIT_FAILED and linger > 0 and self._registry is not None and self._stop is not None:
            # /metrics stays up after a failed run too, so a scrape sees the final values (the shell lingers after
            # a clean exit only); a signal ends the wait.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=linger)


def write_end_record(path: Path, record: dict[str, Any]) -> None:
    """Write `record` to `path` atomically (a reader never sees half of it); a failure (a full disk) is logged."""
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(path)
    except OSError as exc:
        log.warning("could not write %s: %s", path, exc)


def build_service(config: ControllerConfig) -> ControllerService:
    """The controller for `run_service`; its parts are built when it starts (inside the event loop)."""
    return ControllerService(config)
