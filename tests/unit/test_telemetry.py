"""fleetrl.telemetry: a /metrics endpoint per registry, scraped over real HTTP; logging setup."""

from __future__ import annotations

import asyncio
import logging
import urllib.error
import urllib.request

import pytest
from prometheus_client import Counter

from fleetrl.telemetry import linger_then_close, setup_logging, start_metrics_server


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return reply.read().decode()


def test_metrics_endpoint_serves_its_own_registry() -> None:
    a, b = start_metrics_server(0), start_metrics_server(0)
    try:
        assert a.port != b.port
        Counter("fleetrl_test_things", "things", registry=a.registry).inc(3)
        Counter("fleetrl_test_things", "same name, other registry", registry=b.registry).inc(1)
        assert "fleetrl_test_things_total 3.0" in _scrape(a.url)
        assert "fleetrl_test_things_total 1.0" in _scrape(b.url)
    finally:
        a.close()
        b.close()
    a.close()  # idempotent


def test_port_in_use_names_the_address() -> None:
    first = start_metrics_server(0)
    try:
        with pytest.raises(OSError, match=str(first.port)):
            start_metrics_server(first.port)
    finally:
        first.close()


def test_setup_logging_is_idempotent_and_checks_the_level(capsys: pytest.CaptureFixture) -> None:
    setup_logging("debug", service="svc")
    setup_logging("INFO", service="svc")
    handlers = [h for h in logging.getLogger().handlers if getattr(h, "_fleetrl", False)]
    assert len(handlers) == 1
    assert logging.getLogger().level == logging.INFO
    with pytest.raises(ValueError, match="log level"):
        setup_logging("loud")
    for handler in handlers:
        logging.getLogger().removeHandler(handler)


async def test_linger_keeps_the_final_values_scrapeable_until_stopped() -> None:
    server = start_metrics_server(0)
    Counter("final_steps", "steps", registry=server.registry).inc(3)
    stop = asyncio.Event()
    lingering = asyncio.create_task(linger_then_close(server, 60.0, stop))
    await asyncio.sleep(0)  # one loop turn: the task runs until it parks on `stop` (no time passes)
    assert "final_steps_total 3.0" in await asyncio.to_thread(_scrape, server.url)  # the run is over, still served
    assert not lingering.done()
    stop.set()  # SIGTERM: no need to wait out the linger
    await asyncio.wait_for(lingering, timeout=5)
    with pytest.raises(urllib.error.URLError):
        _scrape(server.url)
