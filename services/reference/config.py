"""`ReferenceConfig`: the reference service's settings, from flags (pure pydantic)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ReferenceConfigError(ValueError):
    """A config that cannot run; the message names the field."""


class ReferenceConfig(BaseModel):
    """Ports: 0 picks a free one; a metrics port of None disables /metrics."""

    # allow_inf_nan=False: temperature = inf (or any non-finite float) fails at start, naming the field.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    model: str = Field(
        ..., description="HF causal LM (path or hub id): the base policy, frozen, or a distillation teacher."
    )
    student_model: str | None = Field(
        None,
        description="The run's model (or tokenizer) when `model` is a distillation teacher: its tokenizer must read "
        "ids as the teacher's does, checked at start (fleetrl.tokenizer_match); None = no check.",
    )
    host: str = Field("127.0.0.1", description="Address the endpoints bind to (loopback default).")
    grpc_port: int = Field(50061, ge=0, le=65535, description="gRPC port (0 = pick).")
    metrics_port: int | None = Field(9402, ge=0, le=65535, description="/metrics port (0 = pick, None = off).")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Weight dtype; use the policy trainer's so the KL is of like with like."
    )
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:1, ...")
    max_batch_tokens: int = Field(16384, ge=1, description="Padded tokens (sequences x longest) per forward at most.")
    batch_wait_ms: float = Field(2.0, ge=0, description="How long a forward waits for more requests to batch with.")
    auth_token: str | None = Field(None, description="Bearer token; None = $FLEETRL_AUTH_TOKEN (unset = off).")
    max_message_mb: int = Field(256, ge=1, description="gRPC message size limit in MiB.")
    request_timeout_s: float = Field(600.0, gt=0, description="A request fails after waiting this long.")
    shutdown_grace_s: float = Field(5.0, ge=0, description="Grace for in-flight RPCs at stop.")
    ready_file: str | None = Field(
        None, description="Write {grpc_port, metrics_port} as JSON here once serving (for launchers)."
    )
    log_level: str = Field("INFO", description="Python log level name.")

    @classmethod
    def build(cls, data: dict[str, Any]) -> ReferenceConfig:
        """Validate a dict; errors name the offending field."""
        try:
            return cls(**data)
        except ValidationError as exc:
            lines = [f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in exc.errors()]
            raise ReferenceConfigError("invalid reference config: " + "; ".join(lines)) from None
