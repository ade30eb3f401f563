"""The one in-process stand-in for the controller that tests hand a `Gateway` (`Gateway(..., controller=...)`): it
records the reports and evaluations it is sent and answers each as the controller does. Tests of the gRPC edge
itself (timeouts, retries, a controller that goes away) serve a real `ControllerServicer` instead."""

from __future__ import annotations

from typing import Any

from fleetrl.v1 import controller_pb2


class RecordingController:
    """Records `ReportRows` reports and `ReportEval` requests. `report_result` is what `ReportRows` answers for
    every report: "" (the default) as applied, or e.g. "retry"."""

    def __init__(self, report_result: str = "") -> None:
        self.report_result = report_result
        self.reports: list[Any] = []
        self.evals: list[Any] = []
        self.version = self.trained_steps = 0

    async def ReportRows(self, request: Any, timeout: float | None = None) -> Any:
        self.reports.extend(request.reports)
        results = [self.report_result] * len(request.reports) if self.report_result else []
        return controller_pb2.ReportRowsResponse(results=results)

    async def GetStatus(self, request: Any, timeout: float | None = None) -> Any:
        """The run's versions (`version`, `trained_steps`: 0 unless a test sets them)."""
        return controller_pb2.RunStatus(version=self.version, trained_steps=self.trained_steps)

    async def ReportEval(self, request: Any, timeout: float | None = None) -> Any:
        self.evals.append(request)
        return controller_pb2.ReportEvalResponse()
