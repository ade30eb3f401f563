"""The current cookbook's sampler arguments `user=` (session affinity: a key's calls go to one replica while it is
routable) and `include_routing_matrix` (refused, naming it). The replicas are scripts (no sockets)."""

from __future__ import annotations

from typing import Any

import pytest

from fleetrl.gateway.sampler import Sampler
from fleetrl.services.inference.engine import Completion, SamplingRequest


class NamedReplica:
    """Answers every Generate with one completion whose single token is the replica's number."""

    def __init__(self, number: int) -> None:
        self.number, self.calls = number, 0

    async def generate(self, request: SamplingRequest, timeout_s: float | None = None) -> list[Completion]:
        self.calls += 1
        return [Completion([self.number], [-0.1], "length", len(request.prompt_token_ids), [0])]

    async def close(self) -> None:
        pass


def sampler_with(*replicas: NamedReplica) -> Sampler:
    sampler = Sampler()
    for replica in replicas:
        sampler._clients[str(replica.number)], sampler._in_flight[str(replica.number)] = replica, 0
    sampler.set_replicas([str(r.number) for r in replicas])
    return sampler


async def replica_of(sampler: Sampler, user: str | None) -> int:
    (c,) = await sampler.sample_with_prompt_tokens([7, 8], max_tokens=1, user=user)
    return c.completion_tokens[0]


async def test_a_sessions_calls_go_to_one_replica_even_when_it_is_the_busier():
    sampler = sampler_with(NamedReplica(1), NamedReplica(2), NamedReplica(3))
    pinned = await replica_of(sampler, "session-a")
    sampler._in_flight[str(pinned)] += 5  # other work on it: least-busy routing would go elsewhere
    assert {await replica_of(sampler, "session-a") for _ in range(20)} == {pinned}
    others = {await replica_of(sampler, None) for _ in range(20)}
    assert pinned not in others  # calls without a session still go to the least busy


async def test_a_session_moves_only_when_its_replica_is_fenced():
    sampler = sampler_with(NamedReplica(1), NamedReplica(2))
    pinned = await replica_of(sampler, "session-a")
    other = 3 - pinned
    sampler.set_replicas([str(other)])  # the controller fenced the pinned replica
    assert await replica_of(sampler, "session-a") == other
    sampler.set_replicas(["1", "2"])  # it is back: the session stays where it moved
    assert {await replica_of(sampler, "session-a") for _ in range(10)} == {other}


async def test_user_must_be_a_string():
    with pytest.raises(TypeError, match="user must be a string"):
        await replica_of(sampler_with(NamedReplica(1)), 5)  # type: ignore[arg-type]


async def test_include_routing_matrix_is_refused_naming_it():
    sampler = sampler_with(NamedReplica(1))
    with pytest.raises(TypeError, match="include_routing_matrix=True is not supported"):
        await sampler.sample_with_prompt_tokens([7, 8], include_routing_matrix=True)
    kwargs: dict[str, Any] = {"include_routing_matrix": False}
    (c,) = await sampler.sample_with_prompt_tokens([7, 8], **kwargs)
    assert c.completion_tokens == [1]
