"""A replica's weight relay (services/inference/weight_relay.py): a relayed load waits for a peer that has not
started the version yet, serves the version on to peers once loaded, and fails (never hangs) when its upstream is
gone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from fleetrl.clients.inference_types import LoadResult
from fleetrl.services.inference.engine import WeightLoadError
from fleetrl.services.inference.weight_relay import ReplicaRelay, pick_relay_port
from fleetrl.weights import WeightPublisher, WeightTransferError, fetch_weights
from tests.unit.inference.fakes import ScriptedEngine
from tests.waiting import async_wait_until

STATE = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}


class FetchingEngine(ScriptedEngine):
    """Loads a version by fetching it from the address it is given, as both real engines do."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []

    async def load_weights(
        self,
        version: int,
        source: str,
        *,
        auth_token: str | None = None,
        timeout_s: float = 300.0,
        group_replicas: int = 0,
    ) -> LoadResult:
        manifest, _ = await asyncio.to_thread(
            fetch_weights, source, version, timeout_s=timeout_s, auth_token=auth_token
        )
        self.sources.append(source)
        self.loaded_version, self.loaded_checksum = version, manifest.checksum
        return LoadResult(version, manifest.checksum, 0.0, 0.0)


def replica_relay(timeout_s: float = 10.0) -> ReplicaRelay:
    port = pick_relay_port("127.0.0.1")
    return ReplicaRelay(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port}", timeout_s=timeout_s, probe_timeout_s=0.5)


async def test_a_relayed_load_waits_for_the_upstream_to_start_the_version_then_serves_it_on():
    relay, engine = replica_relay(), FetchingEngine()
    with WeightPublisher(auth_token="tok") as upstream:
        upstream.publish(1, STATE)
        load = asyncio.create_task(relay.load(engine, 2, upstream.address, auth_token="tok", timeout_s=30))
        # The upstream (a peer still at version 1) refuses version 2 until it has it: the load asks again.
        await async_wait_until(
            lambda: upstream.snapshot_counts().get("requests_refused/unknown_version", 0) >= 2, 10, "a refusal"
        )
        assert not load.done()
        manifest = upstream.publish(2, {k: v + 1 for k, v in STATE.items()})
        result = await load
        assert (result.version, result.checksum) == (2, manifest.checksum)
        assert relay.version == 2 and engine.sources[0].startswith("tcp://127.0.0.1:")  # the relay, on loopback
        assert upstream.snapshot_counts()["bytes_served"] == sum(t.numel() * 4 for t in STATE.values())
        # A peer fetches version 2 from this replica's relay: the upstream sends nothing more.
        peer_manifest, tensors = await asyncio.to_thread(fetch_weights, relay.address, 2, auth_token="tok")
        assert peer_manifest.checksum == manifest.checksum and torch.equal(tensors["w"], STATE["w"] + 1)
        assert upstream.snapshot_counts()["bytes_served"] == sum(t.numel() * 4 for t in STATE.values())
        # The next version replaces it on the same port: one relay, one version.
        upstream.publish(3, STATE)
        await relay.load(engine, 3, upstream.address, auth_token="tok", timeout_s=30)
        assert relay.version == 3
        with pytest.raises(WeightTransferError, match="not available"):
            await asyncio.to_thread(fetch_weights, relay.address, 2, auth_token="tok", timeout_s=5)
    await relay.close()


async def test_a_relayed_load_from_an_upstream_that_is_gone_fails_within_the_relay_timeout():
    relay, engine = replica_relay(timeout_s=1.0), FetchingEngine()
    dead = f"tcp://127.0.0.1:{pick_relay_port('127.0.0.1')}"  # nothing listens there
    with pytest.raises(WeightLoadError, match=f"relaying version 1 from {dead}"):
        await relay.load(engine, 1, dead, auth_token=None, timeout_s=30)
    assert relay.version == 0 and engine.loaded_version == 0 and not engine.sources
    await relay.close()


async def test_a_version_that_is_not_newer_is_refused_before_anything_is_fetched():
    relay, engine = replica_relay(), FetchingEngine()
    engine.loaded_version = 4
    with pytest.raises(WeightLoadError, match="not newer than the loaded version 4"):
        await relay.load(engine, 4, "tcp://127.0.0.1:1", auth_token=None, timeout_s=30)
    await relay.close()
