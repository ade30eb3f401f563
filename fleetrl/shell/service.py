"""The serving lifecycle every fleetrl service shares, written once.

    class Reference(Service):
        name = "reference"
        async def start(self) -> dict:          # bind and start everything; the ready file's content
            await self.grpc.start(); return {"grpc_port": self.port}
        async def close(self, code: int) -> None:
            await self.grpc.stop(grace=2.0)

    code = await run_service(Reference(...), ShellConfig(host=..., metrics_port=0, ready_file=path))

`run_service`:
1. starts the Prometheus endpoint (when `metrics_port` is not None) and hands its registry to `Service.bind_metrics`;
2. awaits `Service.start()` and writes the ready file (its info plus `metrics_port`) once every endpoint serves;
3. runs `Service.run(stop)` (default: wait for a signal) and turns its result into the exit code;
4. on SIGINT/SIGTERM calls `Service.on_signal(count)` (default: set `stop`); a service that finishes work in
   flight first (the controller's step, the trainer's checkpoint) overrides it;
5. always awaits `Service.close(code)`, then keeps /metrics up for `metrics_linger_s` after a clean exit (so a
   scrape sees the final values) unless another signal comes;
6. while the service runs, gives freed heap memory back to the OS every $FLEETRL_HEAP_TRIM_S seconds
   (fleetrl.shell.heap: glibc keeps what several threads freed, and a long run's RSS would creep up).

An exception from `start` or `run` is logged with its traceback and the exit code is 1; a failure is never silent.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from fleetrl.ready_file import write_ready_file
from fleetrl.shell.heap import heap_trim_interval, trim_heap_every
from fleetrl.telemetry import MetricsServer, linger_then_close, start_metrics_server

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_SIGNALLED = 130


@dataclass(frozen=True)
class ShellConfig:
    """What the shell needs from a service's config: where /metrics binds and where the ready file goes."""

    host: str = "127.0.0.1"
    metrics_port: int | None = None
    ready_file: str | Path | None = None
    metrics_linger_s: float = 0.0

    @classmethod
    def of(cls, config: Any) -> ShellConfig:
        """The shell settings of a service config that has these fields (missing ones take the defaults)."""
        return cls(
            host=getattr(config, "host", "127.0.0.1"),
            metrics_port=getattr(config, "metrics_port", None),
            ready_file=getattr(config, "ready_file", None),
            metrics_linger_s=getattr(config, "metrics_linger_s", 0.0) or 0.0,
        )


class Service:
    """One service's own parts; `run_service` drives them. Subclasses override what they need."""

    name = "service"

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        """Register the service's Prometheus collectors on the endpoint's registry (called before `start`)."""

    async def start(self) -> dict[str, Any]:
        """Bind and start every endpoint; return what the ready file says (ports, addresses)."""
        return {}

    async def run(self, stop: asyncio.Event) -> int:
        """The service's life once started; returns the exit code. Default: serve until a signal sets `stop`."""
        await stop.wait()
        return EXIT_OK

    def on_signal(self, count: int, stop: asyncio.Event) -> None:
        """SIGINT/SIGTERM number `count` (1, 2, ...) arrived. Default: stop at once."""
        stop.set()

    async def close(self, code: int) -> None:
        """Release everything `start` made (called whatever happened, with the exit code)."""


async def run_service(service: Service, shell: ShellConfig) -> int:
    """Run `service` under the shared lifecycle (see the module docstring); returns its exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    linger_stop = asyncio.Event()  # a signal after the service closed ends the metrics linger
    signals = 0
    closed = False

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        log.info("%s: signal %d received", service.name, signals)
        if closed:
            linger_stop.set()
        else:
            service.on_signal(signals, stop)

    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread (in-process use): no handlers
            pass
    metrics: MetricsServer | None = None
    code = EXIT_FAILED
    trim_stop = asyncio.Event()
    trimmer: asyncio.Task[int] | None = None
    try:
        trim_interval_s = heap_trim_interval()
        if shell.metrics_port is not None:
            metrics = start_metrics_server(shell.metrics_port, host=shell.host)
            service.bind_metrics(metrics.registry)
        info = dict(await service.start())
        if metrics is not None:
            info.setdefault("metrics_port", metrics.port)
        if shell.ready_file:
            write_ready_file(shell.ready_file, info)
        log.info("%s serving: %s", service.name, info)
        trimmer = asyncio.create_task(trim_heap_every(trim_interval_s, trim_stop), name="heap-trim")
        code = await service.run(stop)
    except asyncio.CancelledError:
        code = EXIT_SIGNALLED if signals else EXIT_FAILED
        if not signals:
            raise
    except Exception:
        log.exception("%s failed", service.name)
        code = EXIT_FAILED
    finally:
        if trimmer is not None:
            trim_stop.set()
            await asyncio.gather(trimmer, return_exceptions=True)
        try:
            await service.close(code)
        except Exception:
            log.exception("%s: closing failed", service.name)
            code = code or EXIT_FAILED
        finally:
            closed = True
            linger = shell.metrics_linger_s if code == EXIT_OK and not stop.is_set() else 0.0
            try:
                await linger_then_close(metrics, linger, linger_stop)
            finally:
                for sig in installed:
                    loop.remove_signal_handler(sig)
    return code
