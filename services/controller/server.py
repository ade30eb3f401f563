"""Builds and runs the controller: journal + scheduler + registry + trackers + gRPC servicer + orchestrator loop."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc

from fleetrl.controller.dataset import DatasetCursor, load_rows
from fleetrl.controller.journal import Journal
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.gate import OffPolicyGate
from fleetrl.ready_file import write_ready_file
from fleetrl.rpc import create_grpc_server
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator, RunStopped
from fleetrl.services.controller.servicer import ControllerServicer
from fleetrl.trackers import make_trackers
from fleetrl.v1 import controller_pb2_grpc

log = logging.getLogger(__name__)


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
    rows = load_rows(config.rows_path or run.dataset or "", max_rows=run.max_rows)
    kwargs = dict(
        prompt_groups_per_step=run.prompt_groups_per_step,
        stale_policy=run.stale_policy,
        lease_timeout_s=config.lease_timeout_s,
        max_attempts=config.max_row_attempts,
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
        scheduler = RowScheduler.resume(journal, rows, gate_at, cursor_kwargs, **kwargs)
        log.info("resumed from %s at version %d", journal.path, scheduler.gate.version)
        return scheduler
    return RowScheduler(DatasetCursor(rows, **cursor_kwargs), gate_at(0), journal=journal, **kwargs)


def create_server(config: ControllerConfig) -> ControllerServer:
    run = config.run
    log_path = Path(run.log_path)
    journal_path = Path(config.journal_path or log_path / "controller.sqlite")
    if not config.resume and journal_path.exists():
        journal_path.unlink()  # a fresh run starts a fresh ledger
        for suffix in ("-wal", "-shm"):
            Path(str(journal_path) + suffix).unlink(missing_ok=True)
    journal = Journal(journal_path)
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
    now = time.time()
    if config.trainer_address:
        members.register("trainer", "trainer", config.trainer_address, now)
    for i, address in enumerate(config.inference_addresses):
        members.register("inference", f"inference-{i}", address, now, version=scheduler.gate.version)
    orchestrator = Orchestrator(
        run,
        scheduler,
        members,
        metrics_path=metrics_path,
        auth_token=config.auth_token,
        train_step_timeout_s=config.train_step_timeout_s,
        weight_push_timeout_s=config.weight_push_timeout_s,
        heartbeat_interval_s=config.heartbeat_interval_s,
        start_timeout_s=config.start_timeout_s,
        evaluation=config.evaluation,
        eval_timeout_s=config.eval_timeout_s,
        stall_timeout_s=config.stall_timeout_s,
        restart_weights=config.restart_weights,
        trackers=trackers,
    )
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


async def serve(config: ControllerConfig) -> int:
    """Run until the data is used up (exit 0), the run fails (exit 1) or a signal stops it (exit 130)."""
    from fleetrl.services.controller.metrics import ControllerMetrics
    from fleetrl.telemetry import linger_then_close, start_metrics_server

    ctl = create_server(config)
    await ctl.server.start()
    metrics_server = None
    if config.metrics_port is not None:
        metrics_server = start_metrics_server(config.metrics_port, host=config.host)
        ControllerMetrics(metrics_server.registry, ctl.scheduler, ctl.members, ctl.orchestrator)
    if config.ready_file:
        info = {"grpc_port": ctl.port, "address": ctl.address}
        if metrics_server is not None:
            info["metrics_port"] = metrics_server.port
        write_ready_file(config.ready_file, info)
    log.info("controller serving on %s", ctl.address)
    loop = asyncio.get_running_loop()
    run_task = asyncio.create_task(ctl.orchestrator.run(), name="orchestrator")
    stop = asyncio.Event()

    def on_signal() -> None:
        # The first signal stops the run after the step in flight, so its metrics line is written and the trainer
        # (stopped after the controller by `fleetrl up`) checkpoints the step; before the run has started there is
        # nothing to finish, and a second signal stops at once.
        stop.set()
        if ctl.orchestrator.stop_requested or not ctl.orchestrator.started:
            run_task.cancel()
        else:
            log.info("stopping after the step in flight (signal again to stop now)")
            ctl.orchestrator.request_stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    code = 0
    try:
        await run_task
    except (asyncio.CancelledError, RunStopped):
        log.info("controller stopped by signal")
        code = 130
    except Exception:
        code = 1
    finally:
        # Let gateways see run_finished before the server goes away.
        await asyncio.sleep(min(config.heartbeat_interval_s, 1.0))
        await ctl.server.stop(grace=2.0)
        await ctl.orchestrator.close()
        ctl.orchestrator.close_trackers(failed=code == 1)
        ctl.journal.close()
        await linger_then_close(metrics_server, config.metrics_linger_s, stop)
    return code
