"""A rollout that hangs is cancelled after rollout_timeout_s, dropped, counted and logged with its row, and not
retried; a hung evaluation hook is cancelled after eval_timeout_s and reported failed."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fleetrl import Config
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.sampling_seed import RolloutKey
from fleetrl.gateway.worker import Gateway
from tests.controller_standin import RecordingController

RUN = Config(base_model="unused", dataset="unused", completions_per_prompt=2)


def test_a_hung_rollout_is_cancelled_dropped_counted_and_not_retried(caplog):
    calls, cancelled = [], []

    async def hung_rollout(row: dict) -> Any:
        calls.append(row)
        try:
            await asyncio.Event().wait()  # a tool that never answers
        except asyncio.CancelledError:
            cancelled.append(row)
            raise

    config = GatewayConfig(run=RUN, rollout="unused:unused", rollout_timeout_s=0.05, rollout_retries=3)
    gateway = Gateway(config, rollout_factory=lambda setup: hung_rollout)
    asyncio.run(gateway.prepare_rollouts())
    with caplog.at_level(logging.WARNING):
        result = asyncio.run(gateway.one_rollout({"q": 1}, RolloutKey(0, 17, 0, 0)))
    assert isinstance(result, TimeoutError)
    assert len(calls) == 1 and len(cancelled) == 1  # cancelled once, not retried
    assert gateway.counters["rollouts_timed_out"] == 1 and gateway.counters["rollouts_failed"] == 1
    assert "row 17: a rollout ran past rollout_timeout_s" in caplog.text


def test_a_hung_evaluation_hook_is_cancelled_and_reported_failed():
    async def hung_eval(setup: Any, rows: list[dict]) -> dict[str, float]:
        await asyncio.Event().wait()
        return {}

    config = GatewayConfig(run=RUN, rollout="unused:unused", eval_timeout_s=0.05)
    gateway = Gateway(
        config, rollout_factory=lambda setup: None, evaluation_fn=hung_eval, controller=RecordingController()
    )
    asyncio.run(gateway.evaluate(3))
    (report,) = gateway.stub.evals
    assert report.version == 3 and report.metrics["failed"] == 1.0 and report.metrics["timed_out"] == 1.0
