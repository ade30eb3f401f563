"""A gloo weight-transfer engine pair for vLLM (`BACKEND` = "fleetrl_gloo"): the CPU stand-in for vLLM's "nccl".

vLLM 0.32's own engines (`vllm/distributed/weight_transfer/`: "nccl", "nccl_m2n", "ipc") hard-wire CUDA: "nccl"
and "nccl_m2n" broadcast through `PyNcclCommunicator` on CUDA streams, "ipc" shares CUDA IPC handles. No gloo group
can go through them, so the same flow is tested on CPU through this pair, which follows their interface exactly
and is registered through the public ``register_engine`` of both factories (`register`):

- `GlooTrainerWeightTransferEngine` (trainer side, `WeightTransferTrainerFactory`): ``trainer_init`` opens the
  rendezvous store and builds the group once (rank 0, beside the client's ``init_weight_transfer_engine``, which
  the replicas' workers answer by joining at their rank offsets); ``send_weights`` drives one version:
  ``start_weight_update``, ``update_weights`` (names, dtypes, shapes; the workers receive inside it) concurrently
  with the broadcast of the packed buckets, then ``finish_weight_update(version)``.
- `GlooWeightTransferEngine` (worker side, `WeightTransferEngineFactory`): ``init_transfer_engine`` joins the group
  at ``rank_offset`` + its tensor-parallel rank (every TP worker receives, as under vLLM's "nccl");
  ``receive_weights`` receives one bucket at a time into a fresh bucket-sized buffer and hands its tensors to the
  model's ``load_weights`` (vLLM's layerwise reload between ``start_weight_update`` and ``finish_weight_update``):
  no buffer of the whole version.

Buckets and their check: fleetrl.weights.bucket_wire (each bucket's digest computed on the device at both ends,
compared as one scalar; nothing is read back to the host to verify it). The source is a
`fleetrl.weights.gather.ShardedWeights` (one full tensor at a time, cast on the device; under FSDP2 every trainer
rank iterates it in lockstep and only rank 0 sends).

A failed broadcast (a replica died mid-transfer, a digest mismatch, a receiver silent for ``timeout_s``) raises
`EngineTransferFailed` on the sender after it has shut its group down and drained the rest of the source, so the
other trainer ranks finish their gathers: the trainer neither hangs nor aborts. The group is then unusable; the
caller (fleetrl.weights.engine_sync) builds a new one and loads the version over the weight stream meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from fleetrl.weights.bucket_wire import bucket_digest, pack_bucket, plan_buckets, unpack_bucket
from fleetrl.weights.collective import _broadcast, _process_group, _shutdown, _store
from fleetrl.weights.engine_transport import EngineGroupTransport
from fleetrl.weights.gather import ShardedWeights, TensorMeta

__all__ = [
    "BACKEND",
    "EngineTransferFailed",
    "FanoutClient",
    "FanoutError",
    "GlooEngineTransport",
    "GlooInitInfo",
    "GlooTrainerInitInfo",
    "GlooTrainerWeightTransferEngine",
    "GlooUpdateInfo",
    "GlooWeightTransferEngine",
    "register",
]

logger = logging.getLogger(__name__)

BACKEND = "fleetrl_gloo"
DEFAULT_BUCKET_BYTES = 64 << 20


class EngineTransferFailed(RuntimeError):
    """A version's transfer through the engine group failed; the group is shut down and must be built again.
    `served`: the replicas that received the version whole anyway (their update was finished, labelled with it)."""

    def __init__(self, message: str, served: list[str] | None = None) -> None:
        super().__init__(message)
        self.served = served or []


class FanoutError(RuntimeError):
    """Some replicas failed a fanned-out call: `failed` (name -> reason) and `succeeded` (names)."""

    def __init__(self, failed: dict[str, str], succeeded: list[str]) -> None:
        super().__init__("; ".join(f"{name}: {reason}" for name, reason in failed.items()))
        self.failed = failed
        self.succeeded = succeeded


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """What a worker needs to join the group (sent by the trainer through ``init_weight_transfer_engine``)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "fleetrl-gloo"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 60.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One version: every tensor's name, dtype and full shape, in the order the buckets carry them."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    version: int = -1

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes differ in length: {len(self.names)}, {len(self.dtype_names)}, "
                f"{len(self.shapes)}"
            )

    def metas(self) -> list[TensorMeta]:
        rows = zip(self.names, self.dtype_names, self.shapes, strict=True)
        return [TensorMeta(n, getattr(torch, d), tuple(s)) for n, d, s in rows]


def _join(info: GlooInitInfo, rank: int) -> Any:
    """A worker's place in the group: the trainer's store (as a client) and the gloo group at `rank`."""
    store = dist.PrefixStore(
        f"{info.group_name}/", _store(info.master_address, info.master_port, master=False, timeout_s=info.timeout_s)
    )
    return _process_group(store, rank, info.world_size, "gloo", info.timeout_s), store


class LayerwiseReceiver:
    """What fleetrl's receiving engines (this file's gloo engine, services/inference/vllm_transfer.py's stream) share:
    a version arrives between vLLM's layer-wise reload calls, and `update_weights` hands the parsed info to the
    engine's own `receive_weights`. Put it before `WeightTransferEngine` in the bases."""

    model: Any
    model_config: Any
    receive_weights: Any  # the engine's own
    parse_update_info: Any  # vLLM's WeightTransferEngine's

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # the base class syncs unconditionally, which raises on CPU
            torch.accelerator.synchronize()


class GlooWeightTransferEngine(LayerwiseReceiver, WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """The worker side (see the module docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None
        self._store: Any = None
        self.info: GlooInitInfo | None = None
        self.peak_bucket_bytes = 0  # the largest receive buffer held (tests and benchmarks)

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()  # a rebuilt group replaces the old one
        rank = init_info.rank_offset + int(self.parallel_config.rank)
        self.group, self._store = _join(init_info, rank)
        self.info = init_info
        logger.info(
            "joined weight-transfer group %s as rank %d of %d", init_info.group_name, rank, init_info.world_size
        )

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None or self.info is None:
            raise RuntimeError("the fleetrl_gloo weight transfer is not initialized: call init_transfer_engine first")
        receive_buckets(self.group, self.info, update_info.metas(), self.model.load_weights, self)

    def shutdown(self) -> None:
        if self.group is not None:
            _shutdown(self.group)
        self.group = self._store = None


def receive_buckets(group: Any, info: GlooInitInfo, metas: list[TensorMeta], load: Any, stats: Any = None) -> None:
    """Receive a version's buckets from rank 0 and `load` each bucket's (name, tensor) pairs before the next one
    arrives; ValueError naming the bucket's first tensor when its digest does not match the sender's."""
    for bucket in plan_buckets(metas, info.bucket_bytes):
        packed = torch.empty(bucket.nbytes, dtype=torch.uint8)  # fresh: a layerwise reload may keep the views
        if stats is not None:
            stats.peak_bucket_bytes = max(stats.peak_bucket_bytes, bucket.nbytes)
        _broadcast(group, packed, info.timeout_s)
        sent = torch.zeros(1, dtype=torch.int64)
        _broadcast(group, sent, info.timeout_s)
        if int(bucket_digest(packed).item()) != int(sent.item()):
            first = metas[bucket.indices[0]].name
            raise ValueError(f"the bucket starting at {first!r} arrived damaged (its digest differs from the sender's)")
        load(unpack_bucket(bucket, metas, packed))
        del packed


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's side of the group: rank 0 opens the store; the workers join at rank offsets from 1."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    group_name: str = "fleetrl-gloo"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 60.0


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer side (see the module docstring). `version` is set by the caller before each ``send_weights``."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: Any, is_sender: bool, info: GlooTrainerInitInfo):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.group: Any = None
        self._store: Any = None
        self.version = -1
        self.bytes_sent = 0

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient, source: Any = None
    ) -> GlooTrainerWeightTransferEngine:
        if not isinstance(source, ShardedWeights):
            raise ValueError("the fleetrl_gloo trainer engine needs a fleetrl.weights.gather.ShardedWeights source")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if not engine.is_sender:
            return engine  # other trainer ranks only take part in the gathers
        # The store first (master_port 0: a free port), so the workers are told the port it got.
        store = _store(init_info.master_address, init_info.master_port, master=True, timeout_s=init_info.timeout_s)
        worker = GlooInitInfo(
            init_info.master_address,
            store.port,
            rank_offset=1,
            world_size=init_info.world_size,
            group_name=init_info.group_name,
            bucket_bytes=init_info.bucket_bytes,
            timeout_s=init_info.timeout_s,
        )
        engine._store = store
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleetrl-engine-init")
        future = pool.submit(client.init_weight_transfer_engine, asdict(worker))
        try:
            prefix = dist.PrefixStore(f"{worker.group_name}/", store)
            engine.group = _process_group(prefix, 0, worker.world_size, "gloo", worker.timeout_s)
            future.result(timeout=init_info.timeout_s + 5.0)
        except (RuntimeError, ValueError, OSError, FutureTimeoutError) as exc:
            engine.shutdown()
            raise EngineTransferFailed(f"building the weight-transfer group failed: {exc!r}") from exc
        finally:
            pool.shutdown(wait=False)  # never wait for a replica's init rpc that failed to meet us
        return engine

    def send_weights(self) -> None:
        source: ShardedWeights = self.source
        metas = source.metadata()
        if not self.is_sender:
            for _, full in source:  # the gathers, in lockstep with rank 0
                del full
            return
        if self.group is None:
            raise EngineTransferFailed("the weight-transfer group is shut down: build it again")
        update = GlooUpdateInfo(
            [m.name for m in metas],
            [str(m.dtype).removeprefix("torch.") for m in metas],
            [list(m.shape) for m in metas],
            self.version,
        )
        started = time.perf_counter()
        tensors = iter(source)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleetrl-engine-update")
        future: Any = None
        started_on: list[str] = []  # the replicas whose update started, when starting it failed on others
        try:
            try:
                self.client.start_weight_update()
            except FanoutError as exc:
                started_on = exc.succeeded
                raise
            future = pool.submit(self.client.update_weights, asdict(update))
            for bucket in plan_buckets(metas, self.info.bucket_bytes):
                fulls = [next(tensors)[1] for _ in bucket.indices]
                packed = pack_bucket(bucket, fulls, "cpu")  # gloo moves host memory; NCCL would send the device's
                del fulls
                _broadcast(self.group, packed, self.info.timeout_s)
                _broadcast(self.group, bucket_digest(packed), self.info.timeout_s)
                self.bytes_sent += bucket.nbytes
                del packed
            future.result(timeout=self.info.timeout_s + 5.0)
            self.client.finish_weight_update(str(self.version))
        except (RuntimeError, ValueError, OSError, FutureTimeoutError) as exc:
            # Shut the group first (receivers still inside a broadcast fail now), then finish the source so the
            # other trainer ranks' gathers complete; the replicas whose update went through hold the version whole:
            # their update is finished (else they would wait for it, paused); the others load it another way.
            self.shutdown()
            for _, full in tensors:
                del full
            served = self._finish_where_received(future)
            if future is None and started_on:
                self._abort_where_started(started_on)
            message = f"weights version {self.version} through the engine group: {exc}"
            raise EngineTransferFailed(message, served) from exc
        finally:
            pool.shutdown(wait=False)
        logger.info(
            "sent weights version %d through %s: %.1f MB in %.2fs",
            self.version,
            BACKEND,
            source.total_bytes / 1e6,
            time.perf_counter() - started,
        )

    def _abort_where_started(self, started: list[str]) -> None:
        """Starting the update failed on some replicas: those where it started are paused and hold their load lock
        with nothing sent; ending it there at once frees them for the stream load (else they would wait out their
        engine_update_lease_s)."""
        if not isinstance(self.client, FanoutClient):
            return
        try:
            self.client.only(started).abort_weight_update()
        except FanoutError as exc:  # they end it themselves after their lease
            logger.warning("ending the started update failed on %s", ", ".join(exc.failed))

    def _finish_where_received(self, update: Any) -> list[str]:
        """After a failed transfer: the replicas whose ``update_weights`` succeeded (a `FanoutClient` says which),
        their update finished with this version; [] when that cannot be told (then none counts)."""
        if update is None or not isinstance(self.client, FanoutClient):
            return []
        try:
            update.result(timeout=self.info.timeout_s + 5.0)  # the group is shut: every receiver returns by now
            succeeded = list(self.client.clients)
        except FanoutError as exc:
            succeeded = exc.succeeded
        except (RuntimeError, FutureTimeoutError):
            return []
        if not succeeded:
            return []
        try:
            self.client.only(succeeded).finish_weight_update(str(self.version))
        except FanoutError as exc:
            return exc.succeeded
        return succeeded

    def shutdown(self) -> None:
        if self.group is not None:
            _shutdown(self.group)
        self.group = self._store = None


class FanoutClient:
    """One ``VLLMWeightSyncClient`` over several replicas: every call goes to all of them at once (a group's
    rendezvous and its broadcast need every member inside the call together), the init giving each replica its own
    ``rank_offset`` (where the engine's init info has one: "ipc" has none); the first failure is raised once every
    call has returned or `timeout_s` has passed. `version`: the version being sent, for vLLM's engines, which call
    ``update_weights`` and ``finish_weight_update`` without one (fleetrl's replicas label what they serve with it)."""

    def __init__(self, clients: Mapping[str, Any], rank_offsets: Mapping[str, int], timeout_s: float) -> None:
        self.clients = dict(clients)
        self.rank_offsets = dict(rank_offsets)
        self.timeout_s = timeout_s
        self.version: int | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        def init(name: str, client: Any) -> None:
            if "rank_offset" in init_info:
                client.init_weight_transfer_engine({**init_info, "rank_offset": self.rank_offsets[name]})
            else:
                client.init_weight_transfer_engine(dict(init_info))

        self._all(init)

    def start_weight_update(self) -> None:
        self._all(lambda name, c: c.start_weight_update())

    def update_weights(self, update_info: Any) -> None:
        if isinstance(update_info, dict) and "version" not in update_info and self.version is not None:
            update_info = {**update_info, "version": self.version}
        self._all(lambda name, c: c.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None and self.version is not None:
            weight_version = str(self.version)
        self._all(lambda name, c: c.finish_weight_update(weight_version))

    def abort_weight_update(self) -> None:
        """End the update on every replica, nothing having been sent (fleetrl's addition to vLLM's calls)."""
        self._all(lambda name, c: c.abort_weight_update())

    def only(self, names: list[str]) -> FanoutClient:
        """The same client over `names` alone."""
        client = FanoutClient({n: self.clients[n] for n in names}, self.rank_offsets, self.timeout_s)
        client.version = self.version
        return client

    def _all(self, call: Any) -> None:
        """`call` on every replica at once; FanoutError (who failed, who succeeded) when any failed."""
        pool = ThreadPoolExecutor(max_workers=max(len(self.clients), 1), thread_name_prefix="fleetrl-engine-rpc")
        try:
            futures = {name: pool.submit(call, name, client) for name, client in self.clients.items()}
            deadline = time.monotonic() + self.timeout_s
            failed: dict[str, str] = {}
            for name, future in futures.items():
                try:
                    future.result(timeout=max(deadline - time.monotonic(), 0.0))
                except FutureTimeoutError:
                    failed[name] = f"no answer in {self.timeout_s:.0f} s"
                except Exception as exc:  # every replica's failure is reported
                    failed[name] = str(exc) or type(exc).__name__
            if failed:
                raise FanoutError(failed, [n for n in futures if n not in failed])
        finally:
            pool.shutdown(wait=False)  # never wait for a replica that did not answer


class GlooEngineTransport(EngineGroupTransport):
    """`fleetrl.weights.engine_transport.EngineGroupTransport` with the "fleetrl_gloo" engine (the CPU flow): the
    same build, send, abort and stream fallback as vLLM's GPU engines."""

    def __init__(
        self,
        clients: Mapping[str, Any],
        source: ShardedWeights,
        stream_load: Any,
        *,
        host: str = "127.0.0.1",
        rank: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 60.0,
    ) -> None:
        super().__init__(
            clients,
            source,
            stream_load,
            engine=BACKEND,
            host=host,
            rank=rank,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
        )


def register() -> None:
    """Register both sides in this process's factories through their public ``register_engine`` (idempotent)."""
    for factory, engine in (
        (WeightTransferEngineFactory, GlooWeightTransferEngine),
        (WeightTransferTrainerFactory, GlooTrainerWeightTransferEngine),
    ):
        with contextlib.suppress(ValueError):  # registered already (imported under two names)
            factory.register_engine(BACKEND, engine)


register()
