"""`TrainerServicer`: fleetrl.v1.Trainer over gRPC, thin conversions around the `TrainerService`'s blocking
operations (run in worker threads, so the event loop keeps answering Status and health while a step trains)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import TYPE_CHECKING, Any

import grpc

from fleetrl.trainer import StepError, StepResult
from fleetrl.trainer.buffer import MissingGroupsError
from fleetrl.v1 import trainer_pb2, trainer_pb2_grpc

if TYPE_CHECKING:
    from fleetrl.services.trainer.server import TrainerService

logger = logging.getLogger(__name__)


def parse_position(text: str) -> Any:
    """A request's `data_position` (JSON text; empty = None); ValueError when it is not JSON."""
    if not text:
        return None
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: JSON nested too deeply
        raise ValueError(f"data_position must be JSON: {exc}") from None


def step_to_proto(result: StepResult, weights_address: str, weights_bytes: int = 0) -> trainer_pb2.TrainStepResponse:
    return trainer_pb2.TrainStepResponse(
        step=result.step,
        version=result.version,
        published=result.published,
        weights_address=weights_address,
        weights_bytes=weights_bytes if result.published else 0,
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
                prompt_token_ids=s.prompt_token_ids or (),
                completion_token_ids=s.completion_token_ids or (),
            )
            for s in result.samples
        ],
    )


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    """fleetrl.v1.Trainer: thin conversions around TrainerService's blocking operations."""

    def __init__(self, service: TrainerService) -> None:
        self._service = service

    async def TrainStep(
        self, request: trainer_pb2.TrainStepRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainStepResponse:
        service = self._service
        try:
            position = parse_position(request.data_position)
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
        return step_to_proto(result, service.weights_address, service.publisher.version_bytes(result.version))

    async def Publish(
        self, request: trainer_pb2.PublishRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.PublishResponse:
        try:
            version, checksum, seconds = await asyncio.to_thread(self._service.publish)
        except Exception as exc:  # e.g. the weight publisher's loop died: say so
            await context.abort(grpc.StatusCode.INTERNAL, f"Publish failed: {exc!r}")
        return trainer_pb2.PublishResponse(
            version=version,
            weights_address=self._service.weights_address,
            checksum=checksum,
            publish_s=seconds,
            weights_bytes=self._service.publisher.version_bytes(version),
        )

    async def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.SaveCheckpointResponse:
        try:
            path = await asyncio.to_thread(self._service.save_checkpoint, parse_position(request.data_position))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"SaveCheckpoint: {exc}")
        except Exception as exc:  # disk full, permissions: report it, keep serving
            await context.abort(grpc.StatusCode.INTERNAL, f"SaveCheckpoint failed: {exc!r}")
        return trainer_pb2.SaveCheckpointResponse(path=str(path), version=self._service.trainer.version)

    async def Finish(
        self, request: trainer_pb2.FinishRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.FinishResponse:
        try:
            ckpt, export = await asyncio.to_thread(self._service.finish, parse_position(request.data_position))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Finish: {exc}")
        except Exception as exc:  # report it, keep serving
            await context.abort(grpc.StatusCode.INTERNAL, f"Finish failed: {exc!r}")
        return trainer_pb2.FinishResponse(
            checkpoint_path=str(ckpt), export_path=str(export), version=self._service.trainer.version
        )

    async def PushEngine(
        self, request: trainer_pb2.PushEngineRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.PushEngineResponse:
        from fleetrl.weights.engine_push import EngineTarget

        targets = [EngineTarget(r.name, r.address, r.workers) for r in request.replicas]
        if not targets or any(not t.name or not t.address or t.workers < 0 for t in targets):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "PushEngine: every replica needs a name, an address")
        try:
            result = await asyncio.to_thread(self._service.push_engine, request.version, targets)
        except (RuntimeError, KeyError) as exc:  # not this run's transport; a version not published
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"PushEngine({request.version}): {exc}")
        except Exception as exc:  # report it; the controller loads the version over the stream instead
            logger.exception("PushEngine(%d) failed", request.version)
            await context.abort(grpc.StatusCode.INTERNAL, f"PushEngine({request.version}) failed: {exc!r}")
        outcome = result.outcome
        return trainer_pb2.PushEngineResponse(
            version=outcome.version,
            engine=outcome.engine,
            stream=outcome.stream,
            failed=outcome.failed,
            error=outcome.error,
            builds=result.builds,
            fallbacks=result.fallbacks,
            engine_name=result.engine_name,
            push_s=result.push_s,
        )

    async def Status(
        self, request: trainer_pb2.TrainerStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainerStatusResponse:
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
            trained_rows=s.trainer.trained_row_count,
            samples_dropped=counts.get("samples_dropped", 0),
            last_metrics=last.metrics if last else {},
            world_size=s.trainer.ctx.world_size,
        )
