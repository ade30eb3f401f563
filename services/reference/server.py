"""The reference service, wired: a frozen copy of the base policy behind gRPC `ComputeLogprobs`
(services/reference/servicer.py), with request batching (services/reference/batcher.py), Prometheus /metrics, run
under the shared service shell (fleetrl.shell).

    service = create_server(config)   # loads the model, binds the gRPC port, starts nothing
    await service.start()
    ...
    await service.stop()

`serve(config)` runs it until SIGINT/SIGTERM (the launcher calls it). Logprobs come from
`fleetrl.trainer.model.sequence_logprobs`, the policy trainer's own forward, so on the base weights the two
agree. The model never steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from prometheus_client import CollectorRegistry

from fleetrl.rpc import create_grpc_server
from fleetrl.services.reference.batcher import LogprobBatcher
from fleetrl.services.reference.config import ReferenceConfig
from fleetrl.services.reference.metrics import ReferenceMetrics
from fleetrl.services.reference.servicer import ReferenceServicer
from fleetrl.shell.service import Service, ShellConfig, run_service
from fleetrl.v1 import reference_pb2_grpc

logger = logging.getLogger(__name__)


@dataclass
class ReferenceService(Service):
    """A created reference service: `start()` it, `stop()` it, or hand it to `run_service`."""

    name = "reference"

    config: ReferenceConfig
    model: torch.nn.Module
    vocab_size: int
    registry: CollectorRegistry
    metrics: ReferenceMetrics
    batcher: LogprobBatcher
    grpc_server: grpc.aio.Server | None = None
    grpc_port: int = 0
    metrics_served: bool = False
    """True once `bind_metrics` put the service's collectors on the shell's /metrics endpoint."""

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        registry.register(self.registry)  # a registry is a collector: /metrics serves the reference's own
        self.metrics_served = True

    async def start(self) -> dict[str, Any]:
        """Start the batcher and gRPC; returns what the ready file says (the shell adds `metrics_port`)."""
        self.batcher.start()
        assert self.grpc_server is not None
        await self.grpc_server.start()
        info: dict[str, Any] = {"grpc_port": self.grpc_port, "host": self.config.host}
        if not self.metrics_served:  # no /metrics endpoint: the key says so, as before the shell
            info["metrics_port"] = None
        logger.info("reference service up: model %s, grpc %s:%d", self.config.model, self.config.host, self.grpc_port)
        return info

    async def close(self, code: int) -> None:
        logger.info("shutting down")
        await self.stop()

    async def stop(self) -> None:
        if self.grpc_server is not None:
            await self.grpc_server.stop(self.config.shutdown_grace_s)
        await self.batcher.stop()


def create_server(config: ReferenceConfig) -> ReferenceService:
    """Load the frozen model and bind the gRPC port (nothing is started)."""
    from fleetrl.trainer.model import load_causal_lm, pad_token_id, sequence_logprobs
    from fleetrl.trainer.varlen_attention import use_packed_attention

    if config.student_model is not None:  # a distillation teacher scores the student's token ids: same tokenizer
        from fleetrl.tokenizer_match import check_same_tokenizer

        check_same_tokenizer(config.student_model, config.model, field="teacher_model")
    model = load_causal_lm(config.model, dtype=config.dtype, device=config.device, trainable=False)
    pad_id = pad_token_id(model)
    device = next(model.parameters()).device
    use_packed_attention(model, device)  # a batch is one packed row: each sequence attends only to itself

    def compute(sequences: list[list[int]], temperature: float) -> list[list[float]]:
        return sequence_logprobs(model, sequences, temperature=temperature, pad_id=pad_id, device=device)

    registry = CollectorRegistry()
    batcher_holder: list[LogprobBatcher] = []
    metrics = ReferenceMetrics(registry, lambda: batcher_holder[0].queue_depth() if batcher_holder else 0)
    batcher = LogprobBatcher(
        compute, max_batch_tokens=config.max_batch_tokens, batch_wait_s=config.batch_wait_ms / 1000, metrics=metrics
    )
    batcher_holder.append(batcher)
    service = ReferenceService(config, model, int(model.config.vocab_size), registry, metrics, batcher)
    servicer = ReferenceServicer(service)
    service.grpc_server, service.grpc_port = create_grpc_server(
        [lambda s: reference_pb2_grpc.add_ReferenceServicer_to_server(servicer, s)],
        host=config.host,
        port=config.grpc_port,
        auth_token=config.auth_token,
        max_message_mb=config.max_message_mb,
    )
    return service


async def serve(config: ReferenceConfig) -> int:
    """Run the reference service under the shared shell until SIGINT/SIGTERM; returns the exit code."""
    return await run_service(create_server(config), ShellConfig.of(config))
