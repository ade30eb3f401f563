"""The policy trainer service, wired: `PolicyTrainer` behind a ZeroMQ group stream, the gRPC control service
(fleetrl.v1.Trainer, services/trainer/servicer.py), the weight stream and Prometheus /metrics, run under the shared
service shell (fleetrl.shell).

    service = create_server(config)    # loads the model, binds every socket, starts nothing
    await service.start()              # -> the ready file's content
    ...                                # gateways PUSH groups; the controller calls TrainStep / Publish / Finish
    await service.stop()

`run(config)` is the process entry (the launcher calls it): standalone mode, a follower rank under
torchrun, or rank 0 serving under `run_service` until SIGINT/SIGTERM. Training work runs in worker threads under
one lock, so the event loop keeps answering Status and health while a step trains.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
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

from fleetrl.config import wants_reference_logprobs
from fleetrl.group_stream import GroupReceiver
from fleetrl.rollout_group import RolloutGroup, write_groups_jsonl
from fleetrl.rpc import create_grpc_server, resolve_auth_token
from fleetrl.services.trainer.auto_steps import AutoSteps
from fleetrl.services.trainer.config import TrainerServiceConfig
from fleetrl.services.trainer.metrics import TrainerMetrics
from fleetrl.services.trainer.servicer import TrainerServicer
from fleetrl.shell.service import EXIT_FAILED, EXIT_OK, Service, ShellConfig, run_service
from fleetrl.trainer import DistContext, PolicyTrainer, StepResult
from fleetrl.trainer.buffer import GroupBuffer, GroupKey, GroupRef
from fleetrl.trainer.checkpoint import checkpoint_path, latest_checkpoint
from fleetrl.trainer.reference_source import make_reference_fn
from fleetrl.v1 import trainer_pb2_grpc
from fleetrl.weights import WeightPublisher

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0
"""How often the serving loop looks for a failed background part (group receiver, auto steps)."""


def build_trainer(config: TrainerServiceConfig, ctx: DistContext) -> PolicyTrainer:
    """The PolicyTrainer the config describes (reference logprobs wired on rank 0 only)."""
    ref_fn = None
    # LoRA: the policy's own base weights (adapter disabled) are the reference; nothing to connect to.
    # A distillation teacher (teacher_model) is the reference too, its logprobs wanted even with kl_beta = 0.
    wants_ref = wants_reference_logprobs(config.run) and not config.run.lora
    colocated = wants_ref and config.reference == "local"  # a frozen copy in every rank, sharded like the policy
    if ctx.is_main and not colocated:
        ref_fn = make_reference_fn(
            config.reference if wants_ref else None,
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
        colocated_reference=colocated,
    )


def advertised_endpoint(endpoint: str, host: str | None) -> str:
    """`tcp://0.0.0.0:5571` as other hosts reach it: the host replaced by `host` (a container's service name,
    since a wildcard bind address means nothing elsewhere); None keeps the bound address."""
    if not host:
        return endpoint
    scheme, _, rest = endpoint.partition("://")
    port = rest.rsplit(":", 1)[1]
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{scheme}://{host}:{port}"


@dataclass
class TrainerService(Service):
    """A created trainer service (rank 0 only): `start()` it, `stop()` it, or hand it to `run_service`."""

    name = "trainer"

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
    metrics_served: bool = False
    """True once `bind_metrics` put the service's collectors on the shell's /metrics endpoint."""
    version_ready_hooks: list[Callable[[int], Any]] = field(default_factory=list)
    """Called with v each time version v is on the weight stream (the controller's seam)."""
    auto_steps: AutoSteps | None = None
    """The step coordinator of --auto-steps, once started."""
    engine_pusher: Any = None
    """run.weight_transport "engine": the trainer's end of the engine group (fleetrl.weights.engine_push), made at
    the first PushEngine call."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _engine_lock: threading.Lock = field(default_factory=threading.Lock)
    _record_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def groups_address(self) -> str:
        return advertised_endpoint(self.receiver.address, self.config.advertise_host)

    @property
    def weights_address(self) -> str:
        return advertised_endpoint(self.publisher.address, self.config.advertise_host)

    # -- blocking operations (worker threads, one at a time) ---------------------------------

    def push_engine(self, version: int, targets: list[Any]) -> Any:
        """PushEngine: `version` (published) to `targets` through the engine group (an EnginePushResult).
        RuntimeError when this run's weight_transport is not "engine"; KeyError for a version not published."""
        if self.config.run.weight_transport != "engine":
            raise RuntimeError(f"run.weight_transport is {self.config.run.weight_transport!r}, not 'engine'")
        with self._engine_lock:
            if self.engine_pusher is None:
                from fleetrl.weights.engine_push import EnginePusher

                self.engine_pusher = EnginePusher(
                    self.publisher.version_tensors,
                    self.weights_address,
                    auth_token=resolve_auth_token(self.config.auth_token),
                    host=self.config.advertise_host or self.config.host,
                    trainer_device="cuda" if self.config.device.startswith("cuda") else "cpu",
                )
        return self.engine_pusher.push(version, targets)

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
            self.buffer.end_step(self.max_group_age_steps)
            self.metrics.observe_step(result.metrics)
            return result

    @property
    def max_group_age_steps(self) -> int:
        """Steps a buffered group may wait unnamed: a real one is named within about O + 1 steps of arriving."""
        return 4 * (self.config.run.max_head_offpolicy_versions + 2)

    def publish(self) -> tuple[int, str, float]:
        with self._lock:
            info = self.trainer.publish()
            if not info.checksum:  # just staged in the background: asking again waits for its checksum
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

    # -- lifecycle (the shell's Service) -----------------------------------------------------

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        registry.register(self.registry)  # a registry is a collector: /metrics serves the trainer's own
        self.metrics_served = True

    async def start(self) -> dict[str, Any]:
        """Start the group stream, gRPC and (with --auto-steps) the step coordinator; returns the addresses."""
        # The step waits only for the snapshot into the publisher's reused buffers; the cast, the checksums and
        # serving run beside the next step (fetches of the version wait for them: docs/weights.md).
        self.trainer.weight_sink = functools.partial(self.publisher.publish, background=True)
        self.trainer.on_version_ready = self._version_ready
        self.receiver.start()
        assert self.grpc_server is not None
        await self.grpc_server.start()
        if self.config.auto_steps:
            run = self.config.run
            self.auto_steps = AutoSteps(
                self.buffer,
                groups_per_step=run.prompt_groups_per_step,
                max_steps=run.max_steps,
                steps_done=lambda: self.trainer.steps_done,
                train_step=self.train_step,
                finish=self.finish,
                stop=self._stop,
            )
            self.auto_steps.start()
        return self.addresses()

    def addresses(self) -> dict[str, Any]:
        """What the ready file says (the shell adds `metrics_port` when it serves /metrics)."""
        info: dict[str, Any] = {
            "host": self.config.host,
            "grpc_port": self.grpc_port,
            "groups_address": self.groups_address,
            "weights_address": self.weights_address,
            "world_size": self.trainer.ctx.world_size,
        }
        if not self.metrics_served:  # no /metrics endpoint: the key says so, as before the shell
            info["metrics_port"] = None
        return info

    def check(self) -> None:
        """Raise if a background part (group receiver, auto-step loop) has failed."""
        self.receiver.check()
        failed = self.auto_steps.failed if self.auto_steps is not None else None
        if failed is not None:
            raise RuntimeError(f"trainer background task failed: {failed!r}") from failed

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until a signal (then checkpoint the last trained step; 0) or a background failure (health
        NOT_SERVING; 1).

        The checkpoint at a stop is the trainer's own doing, not a SaveCheckpoint call from the controller: it holds
        whenever the trainer is stopped (Ctrl-C on `fleetrl up`, which stops the controller first and then the
        trainer; a SIGTERM from docker or Kubernetes; a controller that is already gone), and it waits for a step
        in flight under the same lock, so the weights saved are those of a complete step."""
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), CHECK_INTERVAL_S)
            try:
                self.check()
            except RuntimeError as exc:
                logger.error("stopping: %s", exc)
                await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                return EXIT_FAILED
        logger.info("shutting down")
        await asyncio.to_thread(self.checkpoint_on_stop, self.config.stop_checkpoint_wait_s)
        return EXIT_OK

    async def close(self, code: int) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Stop and release everything (any task, the trainer included)."""
        self._stop.set()
        if self.grpc_server is not None:
            await self.grpc_server.stop(self.config.shutdown_grace_s)
        if self.auto_steps is not None:
            await asyncio.to_thread(self.auto_steps.join, 30.0)
        self.receiver.stop()
        if self.engine_pusher is not None:
            await asyncio.to_thread(self.engine_pusher.close)
        self.publisher.close()
        with self._lock:
            self.trainer.stop_followers()
            self.trainer.close()


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
        # A collective push's backend is chosen per push from run.collective_backend, this device and the
        # replica's (fleetrl.weights.collective_plan.choose_backend): NCCL from this GPU where both are on CUDA.
        # Overlapped pushes (fleetrl.controller.push_queue): the version in flight, one waiting and the newest.
        overlapped = run.overlap_weight_push and run.max_head_offpolicy_versions >= 1
        publisher = WeightPublisher(
            f"tcp://{config.host}:{config.weights_port}",
            auth_token=token,
            keep_versions=3 if overlapped else 2,
            collective_backend=run.collective_backend,
            collective_device=config.device if config.device.startswith("cuda") else "cpu",
        )
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
        evicted_unclaimed=lambda: buffer.evicted_unclaimed,
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
    """Run rank 0's service under the shared shell until SIGINT/SIGTERM (0, after checkpointing the last trained
    step) or a background failure (1); see `TrainerService.run`."""
    return await run_service(create_server(config, trainer), ShellConfig.of(config))


def run(config: TrainerServiceConfig) -> int:
    """The trainer process: standalone, a follower rank, or rank 0 serving."""
    ctx = DistContext.from_env(device=config.device, timeout_s=config.dist_timeout_s, sharding=config.sharding)
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
