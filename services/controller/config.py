"""`ControllerConfig`: the version controller's settings around the run `Config` (pure pydantic)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fleetrl.config import Config, ConfigError, build_service_config


class ControllerConfig(BaseModel):
    """Ports: 0 picks a free one (the ready file says which)."""

    # allow_inf_nan=False: temperature = inf (or any non-finite float) fails at start, naming the field.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    run: Config = Field(..., description="The run config (dataset, P, G, O, intervals, ...).")
    rows_path: str | None = Field(None, description="JSONL of rows; None = run.dataset.")
    host: str = Field("127.0.0.1", description="Address the gRPC server binds to.")
    grpc_port: int = Field(50050, ge=0, le=65535, description="Controller gRPC port (0 = pick).")
    metrics_port: int | None = Field(9401, ge=0, le=65535, description="/metrics port (0 = pick, None = off).")
    trainer_address: str = Field("", description="HOST:PORT of the trainer's control gRPC (or it registers).")
    inference_addresses: list[str] = Field(
        default_factory=list, description="HOST:PORT of inference replicas known at start (more may register)."
    )
    journal_path: str | None = Field(None, description="SQLite journal; None = <log_path>/controller.sqlite.")
    resume: bool = Field(False, description="Resume version, cursor and ledger from the journal.")
    restart_weights: bool = Field(
        False,
        description="With resume: when the trainer has no checkpoint (version 0) but the journal has trained steps, "
        "train them again from the base model instead of failing.",
    )
    lease_timeout_s: float = Field(600.0, gt=0, description="A leased row not reported by then is requeued.")
    max_row_attempts: int = Field(3, ge=1, description="Failed rows are retried this many times in all.")
    max_stale_attempts: int = Field(
        3,
        ge=1,
        description="A row whose group comes back stale (slower than max_head_offpolicy_versions allows) this many "
        "times is dropped as too slow (counted in rows_failed_stale, reported at the end); lost or failed attempts "
        "do not count.",
    )
    heartbeat_interval_s: float = Field(2.0, gt=0, description="How often members heartbeat / are polled.")
    heartbeat_timeout_s: float = Field(30.0, gt=0, description="A member silent this long is dead.")
    train_step_timeout_s: float = Field(1800.0, gt=0, description="One TrainStep call fails after this.")
    trainer_patience_s: float = Field(
        600.0,
        gt=0,
        description="A trainer that stops answering (a long garbage-collection pause, a slow checkpoint write, a busy "
        "host) is waited for this long, with a warning while waiting, before the run fails; one that is gone "
        "(nothing listens at its address for heartbeat_timeout_s) fails it at once.",
    )
    weight_push_timeout_s: float = Field(300.0, gt=0, description="A replica not loaded by then is fenced.")
    start_timeout_s: float = Field(600.0, gt=0, description="Wait this long for the trainer and a replica.")
    evaluation: bool = Field(
        False, description="An evaluator gateway runs: evaluate at start, every run.evaluation_interval steps, at end."
    )
    eval_timeout_s: float = Field(600.0, gt=0, description="Wait this long for the start and final evaluations.")
    metrics_linger_s: float = Field(
        0.0, ge=0, description="Keep /metrics up this long after the run so Prometheus scrapes the final values."
    )
    stall_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Fail the run when no row is reported and no step trained for this long (a hang), or when "
        "another process holds the journal's lock this long.",
    )
    auth_token: str | None = Field(None, description="Shared token; None = $FLEETRL_AUTH_TOKEN.")
    ready_file: str | None = Field(None, description="Write the bound addresses as JSON here once serving.")
    metrics_jsonl: str | None = Field(None, description="Per-step metrics; None = <log_path>/metrics.jsonl.")
    log_level: str = Field("INFO", description="Python log level name.")

    @model_validator(mode="after")
    def _check(self) -> ControllerConfig:
        if not self.rows_path and not self.run.dataset and not self.run.datasets:
            raise ValueError("rows_path: no rows: set run.dataset (a JSONL path) or run.datasets, or pass --rows")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s})"
            )
        return self

    @classmethod
    def build(cls, data: dict[str, Any]) -> ControllerConfig:
        return build_service_config(cls, data, "controller", ConfigError)
