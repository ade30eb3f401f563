"""Shared telemetry helpers for every fleetrl service: a Prometheus /metrics endpoint and logging setup.

    metrics = start_metrics_server(port=0)          # its own CollectorRegistry; port 0 = pick one
    requests = Counter("x_requests", "...", registry=metrics.registry)
    ... scrape http://127.0.0.1:{metrics.port}/metrics ...
    metrics.close()

Each service gets its own registry (not prometheus_client's global one), so several services or tests in one
process never collide on metric names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_POLL_S = 0.05  # how often the endpoint's loop looks for a stop: close() returns within this (0.5 s by default)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes are not logged."""


@dataclass
class MetricsServer:
    """A running /metrics HTTP endpoint serving `registry`."""

    registry: CollectorRegistry
    host: str
    port: int
    _httpd: object
    _thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving (idempotent)."""
        httpd = self._httpd
        if httpd is None:
            return
        self._httpd = None
        httpd.shutdown()  # type: ignore[attr-defined]
        httpd.server_close()  # type: ignore[attr-defined]
        self._thread.join(timeout=5.0)


def start_metrics_server(
    port: int = 0,
    *,
    host: str = "127.0.0.1",
    registry: CollectorRegistry | None = None,
) -> MetricsServer:
    """Serve Prometheus metrics of `registry` (a new one if None) at http://host:port/metrics.

    port 0 picks a free port (see `.port`). Raises OSError naming the address if it cannot bind.
    """
    registry = registry if registry is not None else CollectorRegistry()

    class _Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    try:
        httpd = make_server(host, port, make_wsgi_app(registry), _Server, handler_class=_QuietHandler)
    except OSError as exc:
        raise OSError(f"could not start the metrics endpoint on {host}:{port}: {exc}") from exc
    thread = threading.Thread(target=httpd.serve_forever, args=(_POLL_S,), name="metrics-http", daemon=True)
    thread.start()
    return MetricsServer(registry, host, int(httpd.server_port), httpd, thread)


async def linger_then_close(server: MetricsServer | None, seconds: float, stop: asyncio.Event | None = None) -> None:
    """Keep serving the final values for `seconds` (so a Prometheus scraping every N s sees them: use more than N),
    or until `stop` is set, then close. A service that ends with its run calls this on the way out."""
    if server is None:
        return
    if seconds > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for((stop or asyncio.Event()).wait(), timeout=seconds)
    server.close()


def setup_logging(level: str | int | None = None, *, service: str | None = None) -> None:
    """Log to stderr in one line per record; level from the argument, else $FLEETRL_LOG_LEVEL, else INFO.

    Idempotent: calling it again only changes the level. `service` prefixes every line (e.g. "inference").
    """
    level = level if level is not None else os.environ.get("FLEETRL_LOG_LEVEL", "INFO")
    if isinstance(level, str):
        name = level.upper()
        if name not in logging.getLevelNamesMapping():
            raise ValueError(f"unknown log level {level!r}")
        level = logging.getLevelNamesMapping()[name]
    root = logging.getLogger()
    fmt = LOG_FORMAT if service is None else f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"
    handler = next((h for h in root.handlers if getattr(h, "_fleetrl", False)), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler._fleetrl = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    handler.setFormatter(logging.Formatter(fmt))
    root.setLevel(level)
