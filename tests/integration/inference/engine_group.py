"""The engine-group checks that the one-worker and the two-worker (TP = 2) vLLM replica share, and a replica that
dies mid-transfer: a real process in the gloo group (`run_doomed_peer`) that receives the first bucket through the
same receiving code as a vLLM worker (fleetrl.weights.vllm_gloo.receive_buckets) and exits before the next one.
Spawned by name (this module), so a test file's ``__main__`` is never run again."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from typing import Any

import torch

from fleetrl.clients.inference_types import SamplingRequest
from fleetrl.services.inference.vllm_transfer import LocalEngineClient
from fleetrl.weights import WeightPublisher
from fleetrl.weights.engine_sync import EngineSync, ReplicaInfo
from fleetrl.weights.gather import ShardedWeights
from fleetrl.weights.vllm_gloo import GlooEngineTransport
from tests.integration.inference import conformance

REQUEST = SamplingRequest([5, 6, 7], n=2, max_tokens=12, seed=3)
BUCKET_BYTES = 1 << 20  # the tiny model travels in several buckets
TIMEOUT_S = 30.0


def run_doomed_peer(conn: Any, buckets_before_death: int) -> None:
    """A replica's worker that joins the group, receives `buckets_before_death` buckets and dies (os._exit)."""
    from fleetrl.weights.vllm_gloo import GlooInitInfo, GlooUpdateInfo, _join, receive_buckets

    conn.send("ready")  # imported: it joins as soon as it is told where
    info = GlooInitInfo(**conn.recv())
    group, _store = _join(info, info.rank_offset)
    conn.send("joined")
    update = GlooUpdateInfo(**{k: v for k, v in conn.recv().items() if k in ("names", "dtype_names", "shapes")})
    received = []

    def load(pairs: list) -> None:
        received.append(len(pairs))
        if len(received) >= buckets_before_death:
            os._exit(3)  # gone mid-version, with no goodbye on the group

    receive_buckets(group, info, update.metas(), load)


class DoomedPeerClient:
    """The ``VLLMWeightSyncClient`` of a replica that dies mid-transfer (`run_doomed_peer`, a spawned process)."""

    def __init__(self, buckets_before_death: int = 1) -> None:
        """Starts the peer's process (a spawned interpreter importing torch and vLLM: tens of seconds on a busy
        machine) and waits until it is ready, so that its join is as quick as a live worker's."""
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=run_doomed_peer, args=(child, buckets_before_death))
        self.process.start()
        if not self._conn.poll(180.0) or self._conn.recv() != "ready":
            raise RuntimeError("the doomed peer did not start")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._conn.send(init_info)
        if not self._conn.poll(TIMEOUT_S + 10.0) or self._conn.recv() != "joined":
            raise RuntimeError("the doomed peer did not join")

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: Any) -> None:
        self._conn.send(update_info)
        self.process.join(TIMEOUT_S)
        raise RuntimeError(f"the replica died mid-transfer (exit code {self.process.exitcode})")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


def stream_loader(engines: dict[str, Any], loop: Any, publisher: WeightPublisher) -> Any:
    """The fallback: load `version` on the named replica over the weight stream (a replica not in `engines` is
    gone: RuntimeError)."""

    def load(name: str, version: int) -> None:
        if name not in engines:
            raise RuntimeError(f"replica {name} is gone")
        future = asyncio.run_coroutine_threadsafe(
            engines[name].load_weights(version, publisher.address, timeout_s=60), loop
        )
        future.result(120)

    return load


def perturb_in_place(state: dict[str, torch.Tensor], seed: int) -> None:
    """What an optimizer step does to the trainer's tensors: they change, the objects stay (the source replays)."""
    for name, value in conformance._perturbed(state, seed).items():
        state[name].copy_(value)


async def check_versions_through_the_group(engine: Any, model_dir: str, workers: int) -> None:
    """Two versions through one engine group built once: each served exactly (the reference's logprobs), every
    token labelled with it, no byte over the weight stream."""
    original = conformance.load_reference(model_dir).state_dict()
    state = {k: v.clone() for k, v in original.items()}
    loop = asyncio.get_running_loop()
    with WeightPublisher() as publisher:
        transport = GlooEngineTransport(
            {"r0": LocalEngineClient(engine, loop, timeout_s=TIMEOUT_S)},
            ShardedWeights(state),
            stream_loader({"r0": engine}, loop, publisher),
            bucket_bytes=BUCKET_BYTES,
            timeout_s=TIMEOUT_S,
        )
        sync = EngineSync(transport)
        sync.join(ReplicaInfo("r0", workers=workers))
        try:
            for seed in (41, 42):
                perturb_in_place(state, seed)
                version = engine.loaded_version + 1
                outcome = await asyncio.to_thread(sync.push, version)
                assert outcome.engine == ["r0"] and outcome.stream == [], outcome
                assert engine.loaded_version == version and sync.served_version == version
                completions = await engine.generate(REQUEST)
                assert all(c.versions == [version] * len(c.token_ids) for c in completions)
                conformance.assert_logprobs_match(conformance.load_reference(model_dir, state), REQUEST, completions)
            assert transport.groups_built == 1 and sync.builds == 1  # built once, reused for the second version
            assert transport.engine is not None and transport.engine.bytes_sent > 0
            assert publisher.snapshot_counts().get("bytes_served", 0) == 0
        finally:
            sync.close()
            await conformance._restore(engine, publisher, original)
