"""`TrainerServiceConfig`: the policy trainer service's settings around the run `Config` (pure pydantic)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fleetrl.config import Config, build_service_config, check_warm_start_adapter


class TrainerConfigError(ValueError):
    """A config that cannot run; the message names the field."""


class TrainerServiceConfig(BaseModel):
    """Ports: 0 picks a free one (read them from Status or the ready file); metrics None = off."""

    # allow_inf_nan=False: temperature = inf (or any non-finite float) fails at start, naming the field.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    run: Config = Field(..., description="The run config (base_model, loss, optimizer, intervals, ...).")
    host: str = Field("127.0.0.1", description="Address every endpoint binds to (loopback default).")
    advertise_host: str | None = Field(
        None,
        description="Host other services reach the group and weight streams at (a container's service name); "
        "None = the bound address.",
    )
    grpc_port: int = Field(50071, ge=0, le=65535, description="Trainer control gRPC port (0 = pick).")
    groups_port: int = Field(5571, ge=0, le=65535, description="ZeroMQ PULL port for rollout groups (0 = pick).")
    weights_port: int = Field(5572, ge=0, le=65535, description="Weight stream (publisher) port (0 = pick).")
    metrics_port: int | None = Field(9403, ge=0, le=65535, description="/metrics port (0 = pick, None = off).")
    reference: str | None = Field(
        None,
        description="Where ref logprobs come from when kl_beta > 0: HOST:PORT of `fleetrl serve reference`, "
        "or 'local' (a frozen copy colocated in the trainer's ranks, on its device and compute dtype, sharded "
        "like the policy). Unused when kl_beta = 0 or with LoRA (the base weights "
        "with the adapter disabled are the reference).",
    )
    auth_token: str | None = Field(
        None, description="Shared token for gRPC, the group stream and the weight stream; None = $FLEETRL_AUTH_TOKEN."
    )
    device: str = Field("cpu", description="torch device: cpu or cuda (under torchrun: one GPU per rank).")
    micro_batch_size: int | None = Field(
        None, ge=1, description="Samples per forward/backward (gradient accumulation); None = a whole minibatch."
    )
    total_steps: int | None = Field(
        None, ge=1, description="Run length in batches for linear/cosine LR decay; None = run.max_steps."
    )
    resume: bool = Field(False, description="Restore the latest checkpoint in checkpoint_dir before serving.")
    checkpoint_dir: str | None = Field(None, description="DCP checkpoints; None = <log_path>/checkpoints.")
    output_dir: str | None = Field(None, description="Final HF export; None = run.output_dir or <log_path>/final.")
    standalone: str | None = Field(
        None, description="Train from this JSONL of recorded groups with no other service, then exit."
    )
    auto_steps: bool = Field(
        False, description="Without a coordinator: train a step whenever P groups have arrived (arrival order)."
    )
    record_groups: str | None = Field(None, description="Append every received group to this JSONL file.")
    group_wait_timeout_s: float = Field(300.0, gt=0, description="TrainStep waits this long for missing groups.")
    max_buffered_groups: int | None = Field(
        None, ge=1, description="Groups held at most (None: 8 x (O + 2) x P, at least 256); more are refused."
    )
    reference_timeout_s: float = Field(300.0, gt=0, description="A ComputeLogprobs call fails after this.")
    dist_timeout_s: float = Field(3600.0, gt=0, description="Collective timeout under torchrun (incl. idle waits).")
    sharding: Literal["fsdp", "hsdp"] = Field(
        "fsdp",
        description="Under torchrun: fsdp shards over every rank; hsdp shards within a node, replicates across nodes.",
    )
    max_message_mb: int = Field(256, ge=1, description="gRPC message size limit in MiB.")
    max_group_mb: int = Field(
        32,
        ge=1,
        description="Rollout group message size limit in MiB (parsing costs several times the message in memory).",
    )
    shutdown_grace_s: float = Field(5.0, ge=0, description="Grace for in-flight RPCs at stop.")
    stop_checkpoint_wait_s: float = Field(
        120.0,
        ge=0,
        description="At SIGINT/SIGTERM: wait this long for a step in flight, then checkpoint the last trained "
        "version (unless it is the latest already) before exiting.",
    )
    ready_file: str | None = Field(None, description="Write the bound addresses as JSON here once serving.")
    log_level: str = Field("INFO", description="Python log level name.")

    @model_validator(mode="after")
    def _check(self) -> TrainerServiceConfig:
        if not self.run.base_model:
            raise ValueError("run.base_model: the model to train is required (path or hub id)")
        if self.run.collective_backend == "nccl" and not self.device.startswith("cuda"):
            raise ValueError(
                f"run.collective_backend: 'nccl' broadcasts from the trainer's GPU, but device is {self.device!r}; "
                "set collective_backend 'auto' or 'gloo'"
            )
        if self.run.teacher_model is not None and self.reference is None:
            raise ValueError(
                f"reference: run.teacher_model = {self.run.teacher_model!r} needs the teacher's logprobs: pass "
                "--reference HOST:PORT (fleetrl serve reference --model TEACHER) or --reference local"
            )
        if self.run.kl_beta > 0 and self.reference is None and not self.run.lora:
            raise ValueError(
                f"reference: run.kl_beta = {self.run.kl_beta} > 0 needs reference logprobs: pass --reference "
                "HOST:PORT (fleetrl serve reference) or --reference local, or set kl_beta = 0"
            )
        check_warm_start_adapter(self.run)
        ports = [p for p in (self.grpc_port, self.groups_port, self.weights_port, self.metrics_port) if p]
        if len(ports) != len(set(ports)):
            raise ValueError(
                f"ports must differ: grpc {self.grpc_port}, groups {self.groups_port}, "
                f"weights {self.weights_port}, metrics {self.metrics_port}"
            )
        return self

    @classmethod
    def build(cls, data: dict[str, Any]) -> TrainerServiceConfig:
        """Validate a dict (with `run` a Config or a dict); errors name the offending field."""
        return build_service_config(cls, data, "trainer", TrainerConfigError)
