"""Replies from an inference replica are checked before a rollout sees them: a token outside the vocabulary, a
non-finite or positive logprob, lists of different lengths or an impossible version are the replica's fault (counted
against it, asked of another replica, the replica routed around when it keeps at it), never the rollout's. The
replicas are real gRPC servers on loopback; the fencing rule is a pure class fed a clock."""

from __future__ import annotations

import math
from typing import Any

import grpc
import pytest

from fleetrl import Config
from fleetrl.clients.inference_types import Completion, SamplingRequest
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.replica_replies import ReplicaHealth, reply_fault
from fleetrl.gateway.sampler import NoReplicaError, Sampler
from fleetrl.gateway.worker import Gateway
from fleetrl.rollout import RolloutSample
from fleetrl.v1 import controller_pb2, inference_pb2, inference_pb2_grpc
from tests.controller_standin import RecordingController

VOCAB = 100
HONEST = {"token_ids": [7, 8], "logprobs": [-0.5, -1.0], "versions": [1, 1]}
GARBAGE = {
    "negative token id": {"token_ids": [-5, 8]},
    "token id past the vocabulary": {"token_ids": [7, VOCAB]},
    "NaN logprob": {"logprobs": [math.nan, -1.0]},
    "infinite logprob": {"logprobs": [-math.inf, -1.0]},
    "positive logprob": {"logprobs": [-0.5, 3.0]},
    "fewer logprobs than tokens": {"logprobs": [-0.5]},
    "fewer versions than tokens": {"versions": [1]},
    "negative version": {"versions": [1, -3]},
    "version from the future": {"versions": [71428570, 71428570]},  # the probe's `offset -71428569.86/1`
}


class Replica(inference_pb2_grpc.InferenceServicer):
    """Answers every Generate with n copies of one completion built from `fields` (over HONEST's)."""

    def __init__(self, **fields: Any) -> None:
        self.fields, self.calls = {**HONEST, **fields}, 0

    async def Generate(self, request: Any, context: Any) -> Any:
        self.calls += 1
        completion = inference_pb2.Completion(
            finish_reason="length", prompt_len=len(request.prompt_token_ids), **self.fields
        )
        return inference_pb2.GenerateResponse(completions=[completion] * max(request.n, 1))


@pytest.fixture
async def serve():
    servers: list[Any] = []

    async def start(replica: Replica) -> str:
        server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServicer_to_server(replica, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(None)


def completion(**fields: Any) -> Completion:
    f = {**HONEST, **fields}
    return Completion(f["token_ids"], f["logprobs"], "length", 2, f["versions"])


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_each_kind_of_garbage_is_named(kind):
    request = SamplingRequest(prompt_token_ids=[1], n=1)
    assert reply_fault(request, [completion()], vocab_size=VOCAB, max_version=2) is None
    fault = reply_fault(request, [completion(**GARBAGE[kind])], vocab_size=VOCAB, max_version=2)
    assert fault is not None and fault.startswith("completion 0: ")


def test_a_reply_with_the_wrong_number_of_completions_is_refused():
    request = SamplingRequest(prompt_token_ids=[1], n=2)
    assert reply_fault(request, [completion()]) == "1 completions for a request of n = 2"


def test_a_replica_answering_garbage_three_times_in_a_row_is_fenced_then_on_probation():
    health = ReplicaHealth(max_bad_in_a_row=3, fence_s=30, max_fence_s=100)
    assert health.bad("a", now=0) is None and health.bad("a", now=1) is None
    health.good("a")  # a good reply in between: the count starts over
    assert health.bad("a", now=2) is None and health.bad("a", now=3) is None
    assert health.bad("a", now=4) == 30 and health.fenced("a", now=33.9) and not health.fenced("a", now=34)
    assert health.bad("a", now=34) == 60  # garbage again on probation: fenced again at once, twice as long
    assert health.bad("a", now=94) == 100  # capped
    assert health.bad_replies == {"a": 7} and health.fenced_total == 3 and not health.fenced("b", now=0)
    health.good("a")
    assert not health.fenced("a", now=95) and health.bad("a", now=95) is None


@pytest.mark.parametrize("kind", sorted(GARBAGE))
async def test_garbage_goes_to_another_replica_and_is_counted_against_its_replica(serve, kind):
    garbage, honest = Replica(**GARBAGE[kind]), Replica()
    bad_address, good_address = await serve(garbage), await serve(honest)
    sampler = Sampler(vocab_size=VOCAB, backoff_s=0.001)
    sampler.set_replicas([bad_address, good_address])
    sampler.set_version(1)
    try:
        for _ in range(6):
            sampler._in_flight[good_address] += 1  # steer each call to the garbage replica first, while routable
            try:
                (c,) = await sampler.sample_with_prompt_tokens([1, 2], max_tokens=2)
            finally:
                sampler._in_flight[good_address] -= 1
            assert (c.completion_tokens, c.inference_logprobs, c.versions) == ([7, 8], [-0.5, -1.0], [1, 1])
        # Three garbage replies in a row: routed around, the later calls go straight to the honest replica.
        assert garbage.calls == 3 and honest.calls == 6 and sampler.bad_replies == {bad_address: 3}
    finally:
        await sampler.close()


async def test_a_version_newer_than_the_lease_reply_is_checked_against_the_controller(serve):
    ahead = Replica(versions=[4, 4])  # the run trained and pushed on since the gateway's last lease reply
    address = await serve(ahead)
    newest = [4]

    async def probe() -> int | None:
        return newest[0]

    sampler = Sampler(vocab_size=VOCAB, backoff_s=0.001, replica_wait_s=0.05, version_probe=probe)
    sampler.set_replicas([address])
    sampler.set_version(2)  # a replica may serve 2, or 3 being pushed
    try:
        (c,) = await sampler.sample_with_prompt_tokens([1, 2], max_tokens=2)
        assert c.versions == [4, 4] and sampler.bad_replies == {}
        sampler.max_version, newest[0] = 3, 3  # the controller says 3 is the newest trained: 4 is impossible
        with pytest.raises(NoReplicaError):
            await sampler.sample_with_prompt_tokens([1, 2], max_tokens=2)
        assert sampler.bad_replies[address] >= 1
    finally:
        await sampler.close()


class RecordingGateway(Gateway):
    """A gateway whose groups are kept instead of sent to a trainer."""

    sent: list[Any]

    async def send(self, group: Any) -> None:
        self.sent.append(group)


async def test_a_rollout_never_sees_garbage_and_is_not_blamed_for_it(serve):
    """The defect: a negative token id raised inside fleetrl, counted against the user's rollout, and a version
    from the future reached the step's figures."""
    bad_address = await serve(Replica(token_ids=[-5, 8], versions=[71428570, 71428570]))
    good_address = await serve(Replica())

    def factory(setup: Any) -> Any:
        async def rollout(row: dict) -> RolloutSample:
            (c,) = await setup.sampler.sample_with_prompt_tokens([1, 2], max_tokens=2)
            return RolloutSample(
                tokens=c.full_tokens,
                logprobs=[0.0] * c.prompt_len + c.inference_logprobs,
                loss_mask=[0] * c.prompt_len + [1] * len(c.completion_tokens),
                reward=float(row["r"]),
                versions=[0] * c.prompt_len + c.versions,
            )

        return rollout

    run = Config(base_model="unused", dataset="unused", completions_per_prompt=4, min_group_size=2)
    config = GatewayConfig(run=run, rollout="unused:unused", rollout_retries=1, breaker_min_attempts=2)
    gateway = RecordingGateway(config, rollout_factory=factory, controller=RecordingController(), vocab_size=VOCAB)
    gateway.sent = []
    await gateway.prepare_rollouts()
    sampler = gateway.sampler
    sampler.backoff_s = 0.001
    sampler.set_replicas([bad_address, good_address])
    sampler.set_version(1)
    try:
        for row_id in range(3):
            sampler._in_flight[good_address] += 1  # the garbage replica is asked first
            try:
                leased = controller_pb2.LeasedRow(row_id=row_id, submit_version=1, attempt=1, row_json='{"r": 1}')
                await gateway.process_row(leased)
            finally:
                sampler._in_flight[good_address] -= 1
        assert gateway.counters["rollouts_failed"] == 0 and gateway.counters["samples_dropped_invalid"] == 0
        assert not gateway.breaker.is_open
        assert [r.outcome for r in gateway.stub.reports] == [controller_pb2.ACCEPTED] * 3
        versions = {v for group in gateway.sent for s in group.samples for v in s.versions}
        assert versions == {0, 1} and sampler.bad_replies[bad_address] >= 1
    finally:
        await sampler.close()


async def test_the_gateway_reports_garbage_replies_per_replica_on_metrics():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from fleetrl.services.gateway.metrics import GatewayMetrics

    sampler = Sampler()
    sampler.set_replicas(["10.0.0.1:1", "10.0.0.2:1"])
    gateway = SimpleNamespace(counters={}, row_seconds_sum=0.0, breaker=SimpleNamespace(is_open=False), sampler=sampler)
    registry = CollectorRegistry()
    GatewayMetrics(registry, gateway)
    name = "fleetrl_gateway_replica_bad_replies_total"
    assert registry.get_sample_value(name, {"replica": "10.0.0.1:1"}) == 0  # every replica's series from the start
    sampler.health.bad("10.0.0.2:1", now=0)
    assert registry.get_sample_value(name, {"replica": "10.0.0.2:1"}) == 1
    await sampler.close()
