"""The trainer's end of ``weight_transport = "engine"``: each pushed version into the vLLM replicas through one
weight-transfer engine group, kept between pushes, with the weight stream as the fallback.

The controller orders the pushes (it knows the fleet): the Trainer service's PushEngine call names the version
and the replicas it must reach (services/controller/orchestrator.py). The trainer is rank 0 of the group and the
one that sends, so the group lives here: `EnginePusher.push` brings the membership of its
`fleetrl.weights.engine_sync.EngineSync` up to the replicas named (a new one, or one at a new address, joins; one
no longer named leaves; the group is built again at that push), then lets it push the version: through the group
(`fleetrl.weights.engine_transport.EngineGroupTransport`: vLLM's public ``WeightTransferTrainerFactory.trainer_init``
over each replica's gRPC engine calls, `fleetrl.clients.inference_engine.RemoteEngineClient`), and over the weight
stream (the replica's LoadWeights from this trainer's publisher) where the group cannot be built, a transfer through it
failed, or a replica is not in it. A replica that cannot load either way is reported failed (the controller fences
it, as for a failed LoadWeights).

The bytes sent are the published version's served tensors (`WeightPublisher.version_tensors`: the served dtype,
the same bytes the stream serves), held for the transfer, so the trainer may train the next step meanwhile
(overlapped pushes). The engine is chosen from the layout (`choose_engine`): "fleetrl_gloo" with trainer and
replicas on CPU, vLLM's "nccl" with both on CUDA (each tensor copied to the trainer's GPU as it is sent,
`fleetrl.weights.engine_transport.OnDevice`); both go through the same `EngineGroupTransport` (vLLM's public
``WeightTransferTrainerFactory.trainer_init``), so the CPU runs prove everything but vLLM's NCCL code itself. Other
layouts are refused at start (fleetrl.up.start_checks.check_weight_transport) and here.

Transport only (threads, an event loop for the gRPC clients); every decision is EngineSync's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fleetrl.weights.engine_sync import EngineLayout, EngineSync, PushOutcome, ReplicaInfo, choose_engine
from fleetrl.weights.gather import ShardedWeights

__all__ = ["DRIVEN_ENGINES", "EnginePushResult", "EnginePusher", "EngineTarget"]

# The engines fleetrl up drives: rank 0 sends its published snapshot (full tensors) to every replica's workers.
# "nccl_m2n" (every trainer rank sending its own shards) and "ipc" (a colocated replica) have their init info built
# and tested (fleetrl.weights.engine_init) but are not wired into the trainer service.
DRIVEN_ENGINES = ("fleetrl_gloo", "nccl")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineTarget:
    """A replica a push must reach: its member name, gRPC address and receiving workers (0: ask the replica)."""

    name: str
    address: str
    workers: int = 0


@dataclass
class EnginePushResult:
    """One push: who loaded the version how (`outcome`), the engine, and the group's counters so far."""

    outcome: PushOutcome
    engine_name: str
    builds: int
    fallbacks: int
    push_s: float


class EnginePusher:
    """See the module docstring. `tensors_of(version)`: the published version's served tensors;
    `weights_address`: this trainer's weight stream (the fallback's source); `timeout_s`: each engine call and
    broadcast; `load_timeout_s`: a stream load."""

    def __init__(
        self,
        tensors_of: Callable[[int], Mapping[str, torch.Tensor]],
        weights_address: str,
        *,
        auth_token: str | None = None,
        host: str = "127.0.0.1",
        trainer_device: str = "cpu",
        replica_device: str | None = None,
        timeout_s: float = 60.0,
        load_timeout_s: float = 300.0,
        bucket_bytes: int | None = None,
    ) -> None:
        self.engine_name = choose_engine(EngineLayout(trainer_device, replica_device or trainer_device))
        if self.engine_name not in DRIVEN_ENGINES:
            raise ValueError(
                f"weight_transport 'engine': the {self.engine_name!r} engine is not driven by fleetrl up (only "
                f"{', '.join(DRIVEN_ENGINES)}: trainer and replicas both on CPU, or both on CUDA)"
            )
        from fleetrl.weights.engine_transport import EngineGroupTransport
        from fleetrl.weights.vllm_gloo import DEFAULT_BUCKET_BYTES

        self.trainer_device = trainer_device
        self.tensors_of = tensors_of
        self.weights_address = weights_address
        self.auth_token = auth_token
        self.timeout_s = timeout_s
        self.load_timeout_s = load_timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fleetrl-engine-push", daemon=True)
        self._thread.start()
        self._clients: dict[str, Any] = {}  # name -> InferenceClient (gRPC, on self._loop)
        self._engine_clients: dict[str, Any] = {}  # name -> RemoteEngineClient (the transport reads this dict)
        self._addresses: dict[str, str] = {}
        self.transport = EngineGroupTransport(
            self._engine_clients,
            ShardedWeights({}),
            self._stream_load,
            engine=self.engine_name,
            host=host,
            bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES,
            timeout_s=timeout_s,
        )
        self.sync = EngineSync(self.transport)
        self._lock = threading.Lock()  # one push at a time

    def push(self, version: int, targets: Sequence[EngineTarget]) -> EnginePushResult:
        """Bring every replica in `targets` to `version` (see the module docstring); blocks until each loaded it
        or failed."""
        with self._lock:
            started = time.perf_counter()
            self._follow_fleet(targets)
            tensors = self.tensors_of(version)
            self.transport.source = self._source(tensors)
            try:
                outcome = self.sync.push(version)
            finally:
                self.transport.source = ShardedWeights({})  # the version's buffers may be reused once sent
                del tensors
            result = EnginePushResult(
                outcome, self.engine_name, self.sync.builds, self.sync.fallbacks, time.perf_counter() - started
            )
            logger.info(
                "weights version %d: %d replicas through the %s group, %d over the stream, %d failed in %.2fs "
                "(groups built %d, fallbacks %d)%s",
                version,
                len(outcome.engine),
                self.engine_name,
                len(outcome.stream),
                len(outcome.failed),
                result.push_s,
                result.builds,
                result.fallbacks,
                f": {outcome.error}" if outcome.error else "",
            )
            return result

    def close(self) -> None:
        with self._lock:
            self.sync.close()
            for name in list(self._clients):
                self._drop_client(name)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10.0)

    # -- internals -----------------------------------------------------------------------------

    def _source(self, tensors: Mapping[str, torch.Tensor]) -> Any:
        """The version as the engine sends it: under NCCL each tensor goes to the trainer's GPU as it is sent."""
        source = ShardedWeights(tensors)
        if self.engine_name == "nccl":
            from fleetrl.weights.engine_transport import OnDevice

            return OnDevice(source, self.trainer_device)
        return source

    def _follow_fleet(self, targets: Sequence[EngineTarget]) -> None:
        """The group's membership follows the replicas named: a new one (or one at a new address: restarted)
        joins, one not named leaves; either way the group is built again at this push. One the sync put on
        probation (failed both ways at this address) stays there: the stream decides when it rejoins."""
        named = {t.name for t in targets}
        for name in [n for n in self._addresses if n not in named]:
            self.sync.leave(name)
            self._drop_client(name)
        for target in targets:
            known = target.name in self.sync.replicas or target.name in self.sync.probation
            if self._addresses.get(target.name) == target.address and known:
                continue
            if target.name in self._addresses:
                self.sync.leave(target.name)
                self._drop_client(target.name)
            workers, engine_group = self._add_client(target)
            self.sync.join(ReplicaInfo(target.name, workers, engine_group))
            if engine_group:
                logger.info(
                    "replica %s at %s enters the engine group with %d workers", target.name, target.address, workers
                )
            else:
                logger.info("replica %s at %s has no engine groups (hf): over the stream", target.name, target.address)

    def _add_client(self, target: EngineTarget) -> tuple[int, bool]:
        """Open the replica's client; returns its receiving workers (given, or asked of the replica: each TP worker
        is a rank of the group, so the rank offsets depend on it) and whether its engine joins groups (vLLM does; an
        hf replica, started by hand into a run, loads over the stream)."""
        from fleetrl.clients.inference import InferenceClient
        from fleetrl.clients.inference_engine import RemoteEngineClient

        async def open_client() -> InferenceClient:  # a grpc.aio channel belongs to the loop that opens it
            return InferenceClient(target.address, auth_token=self.auth_token)

        client = asyncio.run_coroutine_threadsafe(open_client(), self._loop).result(timeout=30.0)
        self._clients[target.name] = client
        self._engine_clients[target.name] = RemoteEngineClient(client, self._loop, self.engine_name, self.timeout_s)
        self._addresses[target.name] = target.address
        status = asyncio.run_coroutine_threadsafe(client.status(timeout_s=self.timeout_s), self._loop)
        try:
            reply = status.result(timeout=self.timeout_s + 5.0)
        except Exception as exc:  # not answering: the build will fail on it and put it on probation
            logger.warning("replica %s did not answer Status (%s): counted as a vLLM replica", target.name, exc)
            return max(target.workers, 1), True
        return target.workers or max(int(reply.workers), 1), reply.engine == "vllm"

    def _drop_client(self, name: str) -> None:
        self._addresses.pop(name, None)
        self._engine_clients.pop(name, None)
        client = self._clients.pop(name, None)
        if client is not None:
            future = asyncio.run_coroutine_threadsafe(client.close(), self._loop)
            try:
                future.result(timeout=10.0)
            except Exception:  # a channel that cannot close cleanly is dropped anyway
                logger.debug("closing the channel to replica %s failed", name, exc_info=True)

    def _serves(self, name: str) -> int | None:
        """The version replica `name` reports it serves, or None when it does not answer."""
        status = asyncio.run_coroutine_threadsafe(self._clients[name].status(timeout_s=self.timeout_s), self._loop)
        try:
            return int(status.result(timeout=self.timeout_s + 5.0).loaded_version)
        except Exception:  # not answering: the caller's failure stands
            return None

    def _stream_load(self, name: str, version: int) -> None:
        """The fallback: the replica loads `version` over the weight stream from this trainer (raises on failure)."""
        client = self._clients[name]
        coroutine = client.load_weights(version, self.weights_address, timeout_s=self.load_timeout_s)
        try:
            result = asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=self.load_timeout_s + 30.0)
        except Exception:
            # Refused because the replica already serves it (its engine update finished before the broadcast
            # failed elsewhere, and the failure could not say so): served, not a replica to drop.
            if self._serves(name) == version:
                logger.info("replica %s already serves version %d: counted as served", name, version)
                return
            raise
        if result.version != version:
            raise RuntimeError(f"replica {name} reports version {result.version} after loading {version}")
