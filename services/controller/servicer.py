"""The controller's gRPC servicer (fleetrl.v1.Controller): a thin edge converting wire messages to scheduler,
registry and orchestrator calls, and their answers back to wire messages."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import grpc

from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.gateway.assembly import DROP_REASONS
from fleetrl.services.controller.orchestrator import Orchestrator
from fleetrl.v1 import controller_pb2, controller_pb2_grpc

MAX_LEASE_WAIT_S = 5.0
"""The longest a LeaseRows call is held (`LeaseRowsRequest.wait_s` is capped to it)."""
LEASE_RECHECK_S = 0.2
"""A held LeaseRows call tries to lease again at least this often, notified or not: what a gateway's poll interval
was, so a change nobody signals (a replica back in rotation) is seen no later than before, and many gateways holding
calls cost the controller no more than their polls did."""
KIND_NAMES = {
    controller_pb2.GATEWAY: "gateway",
    controller_pb2.INFERENCE: "inference",
    controller_pb2.TRAINER: "trainer",
    controller_pb2.REFERENCE: "reference",
}
KIND_ENUMS = {v: k for k, v in KIND_NAMES.items()}
OUTCOMES = {controller_pb2.ACCEPTED: "accepted", controller_pb2.REJECTED: "rejected", controller_pb2.FAILED: "failed"}


class ControllerServicer(controller_pb2_grpc.ControllerServicer):
    def __init__(
        self,
        scheduler: RowScheduler,
        members: MemberRegistry,
        orchestrator: Orchestrator,
        *,
        run_id: str,
        heartbeat_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: the scheduler's and the registry's time (leases, heartbeats): monotonic, never the wall clock."""
        self.scheduler = scheduler
        self.members = members
        self.orchestrator = orchestrator
        self.run_id = run_id
        self.heartbeat_interval_s = heartbeat_interval_s
        self.clock = clock

    async def Register(
        self, request: controller_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.RegisterResponse:
        kind = KIND_NAMES.get(request.kind)
        if kind is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Register: kind must be set")
        try:
            member = self.members.register(kind, request.member_id, request.address, self.clock())
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Register: {exc}")
        # A replica joining a running run starts from the base model: it takes no rollouts until it serves the
        # version every other replica serves (a push, or the member poll seeing it loaded).
        self.orchestrator.fleet.joined(member)
        # A gateway that registers after the run ended (slow to start) is told so here: the controller may have
        # stopped waiting for its gateways (wait_gateways_told) and be gone before this gateway's next call.
        self.orchestrator.told_if_finished(request.member_id)
        return controller_pb2.RegisterResponse(
            heartbeat_interval_s=self.heartbeat_interval_s,
            run_id=self.run_id,
            run_finished=self.orchestrator.completed,
            run_stopped=self.orchestrator.stopped,
        )

    async def Heartbeat(
        self, request: controller_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.HeartbeatResponse:
        known = self.members.heartbeat(request.member_id, self.clock())
        self.orchestrator.told_if_finished(request.member_id)
        return controller_pb2.HeartbeatResponse(
            known=known,
            run_finished=self.orchestrator.completed,
            run_stopped=self.orchestrator.stopped,
            evaluate_version=self.orchestrator.evaluate_version,
        )

    async def LeaseRows(
        self, request: controller_pb2.LeaseRowsRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.LeaseRowsResponse:
        now = self.clock()
        if not request.gateway_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "LeaseRows: gateway_id must be set")
        if not self.members.heartbeat(request.gateway_id, now):
            self.members.register("gateway", request.gateway_id, "", now)
        replicas, leases = self._lease(request, now)
        waited = False
        if not leases and request.max_rows > 0 and request.wait_s > 0:
            # Held until rows may be leasable (the gate opened, rows requeued, the run ended) or wait_s passed,
            # re-checking every LEASE_RECHECK_S for changes nobody signals (fleetrl.controller.lease_signal).
            loop = asyncio.get_running_loop()
            deadline = loop.time() + min(request.wait_s, MAX_LEASE_WAIT_S)
            while not leases and not self.orchestrator.finished and (left := deadline - loop.time()) > 0:
                await self.orchestrator.lease_signal.wait(min(left, LEASE_RECHECK_S))
                now = self.clock()
                replicas, leases = self._lease(request, now)
            self.members.heartbeat(request.gateway_id, now)
            waited = True
        trainers = self.members.alive("trainer", now)
        self.orchestrator.told_if_finished(request.gateway_id)
        return controller_pb2.LeaseRowsResponse(
            rows=[
                controller_pb2.LeasedRow(
                    row_id=lease.row_id,
                    submit_version=lease.submit_version,
                    lease_deadline_unix_s=time.time() + (lease.deadline - now),  # wall time, for display
                    row_json=json.dumps(lease.row),
                    attempt=lease.attempt,
                    lease_tag=lease.tag,
                )
                for lease in leases
            ],
            # Not when the data is used up (a final evaluation may follow), and not when this controller stops
            # without finishing the run (run_stopped: a resumed controller may follow).
            run_finished=self.orchestrator.completed,
            run_stopped=self.orchestrator.stopped,
            retry_after_s=0.0 if leases or (waited and not self.orchestrator.finished) else 0.2,
            replicas=[
                controller_pb2.Replica(member_id=m.member_id, address=m.address, version=m.version) for m in replicas
            ],
            groups_address=self.orchestrator.groups_address if trainers else "",
            version=self.scheduler.gate.version,
            evaluate_version=self.orchestrator.evaluate_version,
        )

    def _lease(self, request: controller_pb2.LeaseRowsRequest, now: float) -> tuple[list, list]:
        """The routable replicas, and the rows leased to the gateway now (none while leasing is closed): max_rows,
        or more when its capacity (max_leased) minus the rows still leased to it is more."""
        replicas = self.members.routable_replicas(now)
        if not (replicas and self.orchestrator.leasing_open()):
            return replicas, []
        count = max(request.max_rows, 0)
        if request.max_leased > 0:
            count = max(count, request.max_leased - self.scheduler.leased_to(request.gateway_id))
        return replicas, self.scheduler.lease(request.gateway_id, count, now)

    async def ReportRows(
        self, request: controller_pb2.ReportRowsRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.ReportRowsResponse:
        now = self.clock()
        self.members.heartbeat(request.gateway_id, now)
        results = []
        for report in request.reports:
            outcome = OUTCOMES.get(report.outcome)
            if outcome is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ReportRows: row {report.row_id} has no outcome")
            min_version = None if report.min_version < 0 else report.min_version
            results.append(
                self.scheduler.report(
                    report.row_id, outcome, now, request.gateway_id or None, min_version, report.attempt or None
                )
            )
            if results[-1] == "late":  # a repeat (its reply was lost), another holder's or an old attempt's
                continue
            for why, count in report.samples_dropped.items():
                if why in DROP_REASONS and count >= 0:  # a forged or buggy report cannot invent counters
                    self.scheduler.count_dropped(why, count)
            if results[-1] == "accepted":
                self.orchestrator.record_row_phases(report.row_id, dict(report.phase_s))
                self.orchestrator.record_row_rewards(report.row_id, list(report.rewards))
            if results[-1] == "rejected":
                self.scheduler.count_rejection(report.samples_dropped, report.reason)
                self.orchestrator.record_rejected(list(report.rewards))
        self.orchestrator.rows_reported(len(request.reports), now)
        return controller_pb2.ReportRowsResponse(results=results)

    async def ReportEval(
        self, request: controller_pb2.ReportEvalRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.ReportEvalResponse:
        live = self.scheduler.gate.version
        if not 0 <= request.version <= live:  # only a live version is ever evaluated
            message = f"ReportEval: version {request.version} is not a version of this run (0..{live})"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        self.members.heartbeat(request.gateway_id, self.clock())
        self.orchestrator.record_eval(request.version, dict(request.metrics))
        return controller_pb2.ReportEvalResponse()

    async def GetStatus(
        self, request: controller_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.RunStatus:
        now = self.clock()
        snap = self.scheduler.snapshot()
        return controller_pb2.RunStatus(
            run_id=self.run_id,
            version=self.scheduler.gate.version,
            trained_steps=self.scheduler.trained_steps,
            max_steps=self.scheduler.max_steps or 0,
            counters={k: int(v) for k, v in snap.items()},
            members=[
                controller_pb2.Member(
                    kind=KIND_ENUMS[m.kind],
                    member_id=m.member_id,
                    address=m.address,
                    alive=m.alive(now, self.members.heartbeat_timeout_s),
                    fenced=m.fenced,
                    version=m.version,
                    last_seen_s_ago=now - m.last_seen,
                )
                for m in self.members.members.values()
            ],
            finished=self.orchestrator.finished,
            error=self.orchestrator.error,
            last_metrics=self.orchestrator.last_metrics,
        )
