"""The rollout gateway service: the library's `Gateway` (fleetrl.gateway) under the service shell.

    code = await serve(config)   # 0 run finished, 3 circuit breaker open, 4 the user's code cannot load, 1 other

The gateway answers no gRPC API (it is a client of the controller and the inference replicas), so the shell serves
only /metrics (`GatewayMetrics`, when `metrics_port` is set) and writes the ready file (`metrics_port`, None when
off). SIGINT/SIGTERM cancel the gateway: its rows in flight are dropped and the controller leases them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from prometheus_client import CollectorRegistry

from fleetrl.exit_codes import EXIT_USER_CODE
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.run import UserCodeError, build_gateway
from fleetrl.gateway.worker import Gateway
from fleetrl.services.gateway.metrics import GatewayMetrics
from fleetrl.shell.service import EXIT_SIGNALLED, Service, ShellConfig, run_service

log = logging.getLogger(__name__)


class GatewayService(Service):
    """A built `Gateway` run until the run is finished (or a signal), its counters on /metrics."""

    name = "gateway"

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.metrics: GatewayMetrics | None = None

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        self.metrics = GatewayMetrics(registry, self.gateway)

    async def start(self) -> dict[str, Any]:
        return {} if self.metrics is not None else {"metrics_port": None}

    async def run(self, stop: asyncio.Event) -> int:
        work = asyncio.create_task(self.gateway.run(), name="gateway")
        stopped = asyncio.create_task(stop.wait(), name="gateway-stop")
        try:
            await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
        if work.cancelled():
            return EXIT_SIGNALLED
        return work.result()


async def serve(config: GatewayConfig) -> int:
    """Build the gateway (the tokenizer and the user's code) and run it under the shell; its exit code."""
    try:
        gateway = build_gateway(config)
    except UserCodeError as exc:  # deterministic: restarting the gateway cannot fix the user's code
        log.error("%s", exc)
        return EXIT_USER_CODE
    return await run_service(GatewayService(gateway), ShellConfig.of(config))
