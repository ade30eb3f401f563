"""The policy trainer service: `PolicyTrainer` behind a ZeroMQ group stream, the gRPC control service
(fleetrl.v1.Trainer), the weight stream and Prometheus /metrics.

    service = create_server(config)    # loads the model, binds every socket, starts nothing
    await service.start()
    ...                                # gateways PUSH groups; the controller calls TrainStep / Publish / Finish
    await service.stop()

`run(config)` is the process entry (the launcher calls it): standalone mode, a follower rank under
torchrun, or rank 0 serving until SIGINT/SIGTERM. Training work runs in worker threads under one lock, so
the event loop keeps answering Status and health while a step trains.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer
from prometheus_client import CollectorRegistry

from fleetrl.group_stream import GroupReceiver
from fleetrl.groups import RolloutGroup, write_groups_jsonl
from fleetrl.ready_file import write_ready_file
from fleetrl.rpc import create_grpc_server, resolve_auth_token
from fleetrl.services.trainer.config import TrainerServiceConfig
from fleetrl.services.trainer.metrics import TrainerMetrics
from fleetrl.telemetry import MetricsServer, start_metrics_server
from fleetrl.trainer import DistContext, PolicyTrainer, StepError, StepResult
from fleetrl.trainer.buffer import GroupBuffer, GroupKey, GroupRef, MissingGroupsError
from fleetrl.trainer.checkpoint import checkpoint_path, latest_checkpoint
from fleetrl.trainer.reference_source import make_reference_fn
from fleetrl.v1 import trainer_pb2, trainer_pb2_grpc
from fleetrl.weights import WeightPublisher

logger = logging.getLogger(__name__)


def build_trainer(config: TrainerServiceConfig, ctx: DistContext) -> PolicyTrainer:
    """The PolicyTrainer the config describes (reference logprobs wired on rank 0 only)."""
    ref_fn = None
    if ctx.is_main:
        ref_fn = make_reference_fn(
            # LoRA: the policy's own base weights (adapter disabled) are the reference; nothing to connect to.
            config.reference if config.run.kl_beta > 0 and not config.run.lora else None,
            config.run,
            auth_token=config.auth_token,
            timeout_s=config.reference_timeout_s,
            device=config.device,
        )
    return PolicyTrainer(
        config.run,
        device=config.device,
        dist_ctx=ctx,
        ref_logprobs_fn=ref_fn,
        checkpoint_dir=config.checkpoint_dir,
        output_dir=config.output_dir,
        micro_batch_size=config.micro_batch_size,
        total_steps=config.total_steps,
        # Without a controller (standalone replay of recorded groups, auto steps) there is no gate and no bound.
        refuse_stale=not (config.auto_steps or config.standalone),
    )


def _parse_position(text: str) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: JSON nested too deeply
        raise ValueError(f"data_position must be JSON: {exc}") from None


def advertised_endpoint(endpoint: str, host: str | None) -> str:
    """`tcp://0.0.0.0:5571` as other hosts reach it: the host replaced by `host` (a container's service name,
    since a wildcard bind address means nothing elsewhere); None keeps the bound address."""
    if not host:
        return endpoint
    scheme, _, rest = endpoint.partition("://")
    port = rest.rsplit(":", 1)[1]
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{scheme}://{host}:{port}"


def step_to_proto(result: StepResult, weights_address: str) -> trainer_pb2.TrainStepResponse:
    return trainer_pb2.TrainStepResponse(
        step=result.step,
        version=result.version,
        published=result.published,
        weights_address=weights_address,
        metrics=result.metrics,
        skipped_row_ids=result.skipped_row_ids,
        already_trained=result.already_trained,
        checkpoint_path=result.checkpoint_path or "",
        samples=[
            trainer_pb2.TrainSample(
                row_id=s.row_id,
                prompt=s.prompt,
                completion=s.completion,
                reward=s.reward,
                version_offset=s.version_offset,
                finish_reason=s.finish_reason,
            )
            for s in result.samples
        ],
    )


@dataclass
class TrainerService:
    """A created trainer service; `start()` it, `stop()` it. Rank 0 only."""

    config: TrainerServiceConfig
    trainer: PolicyTrainer
    buffer: GroupBuffer
    receiver: GroupReceiver
    publisher: WeightPublisher
    registry: CollectorRegistry
    metrics: TrainerMetrics
    health: HealthServicer
    grpc_server: grpc.aio.Server | None = None
    grpc_port: int = 0
    metrics_server: MetricsServer | None = None
    version_ready_hooks: list[Callable[[int], Any]] = field(default_factory=list)
    """Called with v each time version v is on the weight stream (the controller's seam)."""
    failed: BaseException | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _auto_thread: threading.Thread | None = None
    _record_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def metrics_port(self) -> int | None:
        return None if self.metrics_server is None else self.metrics_server.port

    @property
    def groups_address(self) -> str:
        return advertised_endpoint(self.receiver.address, self.config.advertise_host)

    @property
    def weights_address(self) -> str:
        return advertised_endpoint(self.publisher.address, self.config.advertise_host)

    # -- blocking operations (worker threads, one at a time) ---------------------------------

    def train_step(
        self,
        step: int,
        groups: list[GroupRef],
        data_position: Any = None,
        wait_timeout_s: float | None = None,
        superseded: list[GroupKey] = (),  # type: ignore[assignment]
    ) -> StepResult:
        """Train `step` from the buffered groups named (row id, attempt), waiting for late ones; first evict the
        attempts the controller superseded."""
        with self._lock:
            if superseded:
                evicted = self.buffer.evict(superseded)
                logger.info("evicted %d superseded groups of %d named", evicted, len(superseded))
            if step <= self.trainer.steps_done:
                return self.trainer.train_step([], step=step)  # a retry: the step's result again
            found = self.buffer.wait_for(groups, wait_timeout_s or self.config.group_wait_timeout_s)
            result = self.trainer.train_step(found, step=step, data_position=data_position)
            trained = {g.row_id for g in found}
            row_ids = [ref[0] for ref in groups]
            result.skipped_row_ids = sorted(set(result.skipped_row_ids) | {r for r in row_ids if r not in trained})
            self.buffer.discard(row_ids)
            self.metrics.observe_step(result.metrics)
            return result

    def publish(self) -> tuple[int, str, float]:
        with self._lock:
            info = self.trainer.publish()
            return info.version, info.checksum, info.seconds

    def save_checkpoint(self, data_position: Any = None) -> Path:
        with self._lock:
            return self.trainer.save_checkpoint(data_position)

    def finish(self, data_position: Any = None) -> tuple[Path, Path]:
        with self._lock:
            return self.trainer.finish(data_position)

    def checkpoint_on_stop(self, wait_s: float) -> Path | None:
        """At a stop by signal: wait up to `wait_s` for a step in flight, then save a checkpoint of the last
        trained version unless it is the latest already, so `--resume` loses no step. Returns its folder, or None
        (nothing trained, already saved, or the step did not end in time)."""
        self._stop.set()  # no further automatic step (--auto-steps)
        if not self._lock.acquire(timeout=wait_s):
            logger.error("a step was still training after %.0f s: stopping without a checkpoint", wait_s)
            return None
        try:
            version = self.trainer.version
            root = self.trainer.checkpoint_dir
            if version == 0 or latest_checkpoint(root) == checkpoint_path(root, version):
                return None
            path = self.trainer.save_checkpoint()
            logger.info("stopped: checkpoint of version %d saved to %s (--resume continues from it)", version, path)
            return path
        finally:
            self._lock.release()

    def _version_ready(self, version: int) -> None:
        logger.info("version %d ready on the weight stream at %s", version, self.weights_address)
        for hook in list(self.version_ready_hooks):
            hook(version)

    def _on_group(self, group: RolloutGroup) -> None:
        if not self.buffer.add(group):
            logger.warning(
                "group of row %d attempt %d refused: already buffered, row trained, attempt superseded, or buffer full",
                group.row_id,
                group.attempt,
            )
            return
        if self.config.record_groups:
            with self._record_lock:
                write_groups_jsonl(self.config.record_groups, [group], append=True)

    def _auto_loop(self) -> None:
        """Without a coordinator: a step whenever P groups are buffered, until max_steps."""
        run = self.config.run
        try:
            while not self._stop.is_set():
                if run.max_steps is not None and self.trainer.steps_done >= run.max_steps:
                    ckpt, export = self.finish()
                    logger.info("auto steps: max_steps reached; checkpoint %s, export %s", ckpt, export)
                    return
                groups = self.buffer.wait_for_count(run.prompt_groups_per_step, timeout_s=0.5)
                if len(groups) < run.prompt_groups_per_step:
                    continue
                self.train_step(self.trainer.steps_done + 1, [(*g.key, g.lease_tag) for g in groups])
        except Exception as exc:  # surfaced: health goes NOT_SERVING and serve() exits non-zero
            logger.exception("auto-step loop failed")
            self.failed = exc

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.trainer.weight_sink = self.publisher.publish
        self.trainer.on_version_ready = self._version_ready
        self.receiver.start()
        assert self.grpc_server is not None
        await self.grpc_server.start()
        if self.config.metrics_port is not None:
            self.metrics_server = start_metrics_server(
                self.config.metrics_port, host=self.config.host, registry=self.registry
            )
        if self.config.auto_steps:
            self._auto_thread = threading.Thread(target=self._auto_loop, name="fleetrl-auto-steps", daemon=True)
            self._auto_thread.start()
        del loop
        if self.config.ready_file:
            write_ready_file(self.config.ready_file, self.addresses())

    def addresses(self) -> dict[str, Any]:
        return {
            "host": self.config.host,
            "grpc_port": self.grpc_port,
            "groups_address": self.groups_address,
            "weights_address": self.weights_address,
            "metrics_port": self.metrics_port,
            "world_size": self.trainer.ctx.world_size,
        }

    def check(self) -> None:
        """Raise if a background part (group receiver, auto-step loop) has failed."""
        self.receiver.check()
        if self.failed is not None:
            raise RuntimeError(f"trainer background task failed: {self.failed!r}") from self.failed

    async def stop(self) -> None:
        self._stop.set()
        if self.grpc_server is not None:
            await self.grpc_server.stop(self.config.shutdown_grace_s)
        if self._auto_thread is not None:
            await asyncio.to_thread(self._auto_thread.join, 30.0)
        self.receiver.stop()
        self.publisher.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        with self._lock:
            self.trainer.stop_followers()
            self.trainer.close()


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    """fleetrl.v1.Trainer: thin conversions around TrainerService's blocking operations."""

    def __init__(self, service: TrainerService) -> None:
        self._service = service

    async def TrainStep(self, request, context):
        service = self._service
        try:
            position = _parse_position(request.data_position)
            groups = [(g.row_id, g.attempt, g.lease_tag) for g in request.groups] or [
                (r, 0, 0) for r in request.row_ids
            ]
            superseded = [(g.row_id, g.attempt) for g in request.superseded]
            if not (math.isfinite(request.wait_timeout_s) and request.wait_timeout_s >= 0):  # NaN would spin forever
                raise ValueError(f"wait_timeout_s must be a finite number >= 0, got {request.wait_timeout_s}")
            result = await asyncio.to_thread(
                service.train_step, request.step, groups, position, request.wait_timeout_s or None, superseded
            )
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"TrainStep: {exc}")
        except (MissingGroupsError, StepError) as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"TrainStep {request.step}: {exc}")
        except Exception as exc:  # a failed step: the caller gets why; the service keeps serving
            logger.exception("TrainStep %d failed", request.step)
            await context.abort(grpc.StatusCode.INTERNAL, f"TrainStep {request.step} failed: {exc!r}")
        return step_to_proto(result, service.weights_address)

    async def Publish(self, request, context):
        try:
            version, checksum, seconds = await asyncio.to_thread(self._service.publish)
        except Exception as exc:  # e.g. the weight publisher's loop died: say so
            await context.abort(grpc.StatusCode.INTERNAL, f"Publish failed: {exc!r}")
        return trainer_pb2.PublishResponse(
            version=version, weights_address=self._service.weights_address, checksum=checksum, publish_s=seconds
        )

    async def SaveCheckpoint(self, request, context):
        try:
            path = await asyncio.to_thread(self._service.save_checkpoint, _parse_position(request.data_position))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"SaveCheckpoint: {exc}")
        except Exception as exc:  # disk full, permissions: report it, keep serving
            await context.abort(grpc.StatusCode.INTERNAL, f"SaveCheckpoint failed: {exc!r}")
        return trainer_pb2.SaveCheckpointResponse(path=str(path), version=self._service.trainer.version)

    async def Finish(self, request, context):
        try:
            ckpt, export = await asyncio.to_thread(self._service.finish, _parse_position(request.data_position))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Finish: {exc}")
        except Exception as exc:  # report it, keep serving
            await context.abort(grpc.StatusCode.INTERNAL, f"Finish failed: {exc!r}")
        return trainer_pb2.FinishResponse(
            checkpoint_path=str(ckpt), export_path=str(export), version=self._service.trainer.version
        )

    async def Status(self, request, context):
        s = self._service
        last = s.trainer.result_of(s.trainer.steps_done)
        counts = s.receiver.snapshot_counts()
        return trainer_pb2.TrainerStatusResponse(
            model=s.config.run.base_model,
            steps_done=s.trainer.steps_done,
            version=s.trainer.version,
            published_version=s.trainer.state.published_version,
            weights_address=s.weights_address,
            groups_address=s.groups_address,
            buffered_groups=len(s.buffer),
            trained_rows=len(s.trainer.trained_row_ids),
            samples_dropped=counts.get("samples_dropped", 0),
            last_metrics=last.metrics if last else {},
            world_size=s.trainer.ctx.world_size,
        )


def create_server(config: TrainerServiceConfig, trainer: PolicyTrainer | None = None) -> TrainerService:
    """Build (or take) the trainer and bind the group stream, weight stream and gRPC (nothing started)."""
    if trainer is None:
        trainer = build_trainer(config, DistContext())
    token = resolve_auth_token(config.auth_token)
    run = config.run
    capacity = config.max_buffered_groups or max(
        256, 8 * (run.max_head_offpolicy_versions + 2) * run.prompt_groups_per_step
    )
    buffer = GroupBuffer(is_trained=trainer.is_trained, capacity=capacity)
    holder: list[TrainerService] = []
    receiver = GroupReceiver(
        lambda group: holder[0]._on_group(group),
        bind=f"tcp://{config.host}:{config.groups_port}",
        auth_token=token,
        max_message_bytes=config.max_group_mb << 20,
    )
    try:
        publisher = WeightPublisher(f"tcp://{config.host}:{config.weights_port}", auth_token=token)
    except Exception:
        receiver.stop()
        raise
    registry = CollectorRegistry()
    metrics = TrainerMetrics(
        registry,
        version=lambda: trainer.version,
        published_version=lambda: trainer.state.published_version,
        buffered_groups=lambda: len(buffer),
        stream_counts=receiver.snapshot_counts,
        duplicates=lambda: buffer.duplicates,
        superseded=lambda: buffer.superseded,
        refused_full=lambda: buffer.refused_full,
    )
    health = HealthServicer()
    service = TrainerService(config, trainer, buffer, receiver, publisher, registry, metrics, health)
    holder.append(service)
    servicer = TrainerServicer(service)
    service.grpc_server, service.grpc_port = create_grpc_server(
        [lambda s: trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, s)],
        host=config.host,
        port=config.grpc_port,
        auth_token=token,
        max_message_mb=config.max_message_mb,
        health=health,
    )
    return service


async def serve(config: TrainerServiceConfig, trainer: PolicyTrainer) -> int:
    """Run rank 0's service until SIGINT/SIGTERM (0, after checkpointing the last trained step) or a background
    failure (1).

    The checkpoint at a stop is the trainer's own doing, not a SaveCheckpoint call from the controller: it holds
    whenever the trainer is stopped (Ctrl-C on `fleetrl up`, which stops the controller first and then the
    trainer; a SIGTERM from docker or Kubernetes; a controller that is already gone), and it waits for a step in
    flight under the same lock, so the weights saved are those of a complete step."""
    service = create_server(config, trainer)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    try:
        await service.start()
        await service.health.set("", health_pb2.HealthCheckResponse.SERVING)
        logger.info("trainer up: %s", json.dumps(service.addresses()))
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            try:
                service.check()
            except RuntimeError as exc:
                logger.error("stopping: %s", exc)
                await service.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                code = 1
                break
        logger.info("shutting down")
        if code == 0:
            await asyncio.to_thread(service.checkpoint_on_stop, config.stop_checkpoint_wait_s)
    finally:
        await service.stop()
    return code


def run(config: TrainerServiceConfig) -> int:
    """The trainer process: standalone, a follower rank, or rank 0 serving."""
    ctx = DistContext.from_env(device=config.device, timeout_s=config.dist_timeout_s)
    try:
        if config.standalone:
            from fleetrl.services.trainer.standalone import run_standalone

            return run_standalone(config, build_trainer(config, ctx))
        trainer = build_trainer(config, ctx)
        if config.resume and ctx.is_main:
            trainer.resume()
        if not ctx.is_main:
            # Rank 0 decides when this rank stops (its checkpoint at a stop is collective): a signal that reaches
            # every rank must not end this one in the middle of the save.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
            trainer.follow()
            return 0
        return asyncio.run(serve(config, trainer))
    finally:
        from fleetrl.trainer.distributed import destroy

        destroy(ctx)
