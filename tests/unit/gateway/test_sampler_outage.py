"""The sampler and the gateway through an inference outage (a replica killed, restarting at a new port): calls go
to another replica, or wait for one; an outage is neither the rollout function's failure nor a row's. Scripted
replicas, no sockets."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from fleetrl import Config
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.sampler import NoReplicaError, Sampler
from fleetrl.gateway.worker import Gateway
from fleetrl.services.inference.engine import SamplingRequest
from fleetrl.v1 import controller_pb2
from tests.controller_standin import RecordingController

REQUEST = SamplingRequest(prompt_token_ids=[1, 2], n=1, max_tokens=2)


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "scripted")


class ScriptedReplica:
    """Answers each Generate with the next scripted item (raising exceptions), then with its name."""

    def __init__(self, name: str, script: list | None = None) -> None:
        self.name, self.script, self.calls = name, list(script or []), 0

    async def generate(self, request: SamplingRequest, timeout_s: float | None = None) -> list[str]:
        self.calls += 1
        item = self.script.pop(0) if self.script else self.name
        if isinstance(item, BaseException):
            raise item
        return [item]

    async def close(self) -> None:
        pass


def sampler_with(*replicas: ScriptedReplica, **kwargs: Any) -> Sampler:
    sampler = Sampler(backoff_s=0.001, check_replies=False, **kwargs)  # the scripts answer names, not completions
    for replica in replicas:
        sampler._clients[replica.name], sampler._in_flight[replica.name] = replica, 0
    return sampler


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


async def test_a_call_to_a_dead_replica_goes_to_the_other():
    dead = ScriptedReplica("a", [rpc_error(grpc.StatusCode.UNAVAILABLE)] * 100)
    sampler = sampler_with(dead, ScriptedReplica("b"))
    sampler.set_replicas(["a", "b"])
    results = [await sampler.generate(REQUEST) for _ in range(4)]
    assert results == [["b"]] * 4 and dead.calls <= 4  # each call tries the dead one at most once


async def test_with_no_replica_a_call_waits_for_one_and_asks_for_the_list():
    # The only replica was killed and fenced (an empty list); its restart registers at a new port.
    restarted = ScriptedReplica("a2")
    sampler = sampler_with(restarted)
    sampler.set_replicas([])
    call = asyncio.create_task(sampler.generate(REQUEST))
    await until(lambda: sampler.wants_replicas)  # the gateway refreshes the list while this is set
    assert not call.done()
    sampler.set_replicas(["a2"])
    assert await asyncio.wait_for(call, 10) == ["a2"]


async def test_the_only_replica_dying_then_coming_back_at_a_new_address_is_waited_for():
    dead = ScriptedReplica("a", [rpc_error(grpc.StatusCode.UNAVAILABLE)] * 1000)
    sampler = sampler_with(dead, ScriptedReplica("a2"))
    sampler.set_replicas(["a"])  # not fenced yet: the gateway still lists it
    call = asyncio.create_task(sampler.generate(REQUEST))
    await until(lambda: dead.calls >= 3)  # refused again and again, never raised
    assert not call.done()
    sampler.set_replicas(["a2"])
    assert await asyncio.wait_for(call, 10) == ["a2"]


async def test_no_replica_for_replica_wait_s_raises_no_replica_error():
    sampler = sampler_with(replica_wait_s=0.01)
    sampler.set_replicas([])
    with pytest.raises(NoReplicaError, match="no live inference replica"):
        await sampler.generate(REQUEST)


async def test_slow_failures_are_tried_max_attempts_times():
    slow = ScriptedReplica("a", [rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)] * 100)
    sampler = sampler_with(slow, max_attempts=3)
    sampler.set_replicas(["a"])
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await sampler.generate(REQUEST)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and slow.calls == 3


async def test_rollouts_that_find_no_replica_neither_trip_the_breaker_nor_reject_the_row():
    async def rollout_fn(row: dict) -> Any:
        raise NoReplicaError("no live inference replica to sample from for 300 s")

    run = Config(base_model="unused", dataset="unused", completions_per_prompt=4)
    config = GatewayConfig(run=run, rollout="unused:unused", rollout_retries=1, breaker_min_attempts=2)
    gateway = Gateway(config, rollout_factory=lambda setup: rollout_fn, controller=RecordingController("retry"))
    await gateway.prepare_rollouts()
    for row_id in range(3):  # 12 rollouts: with failures counted, a breaker judging 2 would have tripped
        await gateway.process_row(controller_pb2.LeasedRow(row_id=row_id, submit_version=0, attempt=1, row_json="{}"))
    assert len(gateway.breaker.window) == 0 and not gateway.breaker.is_open
    assert gateway.counters["rollouts_no_replica"] == 12 and gateway.counters["rollouts_failed"] == 0
    assert [r.outcome for r in gateway.stub.reports] == [controller_pb2.FAILED] * 3  # leased again, not closed
    assert "no inference replica" in gateway.stub.reports[0].reason


class HungReplica(ScriptedReplica):
    """Never answers (a SIGSTOPped process): a call waits until it is cancelled."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.cancelled = 0

    async def generate(self, request: SamplingRequest, timeout_s: float | None = None) -> list[str]:
        self.calls += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return []


async def test_calls_in_flight_to_a_fenced_replica_move_to_another_at_once():
    # Without this the call waits out the whole Generate timeout (120 s by default) on the hung replica.
    hung, live = HungReplica("a"), ScriptedReplica("b")
    sampler = sampler_with(hung, live, request_timeout_s=3600)
    sampler.set_replicas(["a"])
    call = asyncio.ensure_future(sampler.generate(REQUEST))
    await until(lambda: hung.calls == 1)
    sampler.set_replicas(["b"])  # the controller fenced "a" (missed polls)
    assert await asyncio.wait_for(call, timeout=10) == ["b"]
    assert hung.cancelled == 1 and sampler.retries == 1


async def test_a_cancelled_caller_is_not_retried_elsewhere():
    hung, live = HungReplica("a"), ScriptedReplica("b")
    sampler = sampler_with(hung, live)
    sampler.set_replicas(["a", "b"])
    sampler._in_flight["b"] = 5  # steer the call to "a"
    call = asyncio.ensure_future(sampler.generate(REQUEST))
    await until(lambda: hung.calls == 1)
    call.cancel()  # a rollout timeout
    with pytest.raises(asyncio.CancelledError):
        await call
    assert hung.cancelled == 1 and live.calls == 0
