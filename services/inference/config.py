"""`InferenceConfig`: everything the inference server needs, from flags or a TOML file (pure pydantic).

cfg = InferenceConfig.from_toml("inference.toml", overrides={"engine": "hf"})
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

_VLLM_MAX_LORA_RANK = 512


class InferenceConfigError(ValueError):
    """A config that cannot run; the message names the field."""


class InferenceConfig(BaseModel):
    """The inference server's settings. Ports: 0 picks a free one; None disables that endpoint."""

    # allow_inf_nan=False: temperature = inf (or any non-finite float) fails at start, naming the field.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    model: str = Field(..., description="HF model directory (config, safetensors, tokenizer).")
    engine: Literal["vllm", "hf"] = Field(
        "vllm", description="'vllm' (production) or 'hf' (transformers, CPU development/tests)."
    )
    served_model_name: str | None = Field(
        None, description="Model id in the OpenAI API (/v1/models); None = the model dir's name."
    )
    tool_call_parser: str | None = Field(
        "hermes",
        description="engine 'vllm': vLLM tool parser turning generated text into OpenAI `tool_calls` (vllm serve's "
        "--tool-call-parser: 'hermes' for the <tool_call>{json}</tool_call> format of Qwen2.5/Qwen3 and the tiny "
        "model, 'llama3_json', 'mistral', ...); None or '' = no tool parsing.",
    )
    enable_auto_tool_choice: bool = Field(
        True,
        description="engine 'vllm': `tool_choice='auto'` requests are parsed for tool calls (vllm serve's "
        "--enable-auto-tool-choice; ignored without a tool_call_parser).",
    )
    host: str = Field("127.0.0.1", description="Address all endpoints bind to (loopback default).")
    advertise_host: str | None = Field(
        None,
        description="Host others reach this replica at, for its registration with a controller and its weight "
        "relay (a pod's stable name behind a NAT or a Service); None = the bound address, or this machine's "
        "name when bound to a wildcard.",
    )
    grpc_port: int = Field(50051, ge=0, le=65535, description="gRPC API port (0 = pick).")
    http_port: int | None = Field(
        8000, ge=0, le=65535, description="OpenAI-compatible HTTP port (0 = pick, None = off)."
    )
    metrics_port: int | None = Field(
        9400, ge=0, le=65535, description="Prometheus /metrics port (0 = pick, None = off)."
    )
    auth_token: str | None = Field(
        None,
        description="Bearer token required on gRPC and HTTP and sent to the weight stream; "
        "None = $FLEETRL_AUTH_TOKEN (unset = no auth). Prefer the env var to a file.",
    )
    max_message_mb: int = Field(256, ge=1, description="gRPC message size limit in MiB.")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="Weight/compute dtype the replica serves (and so the dtype weight versions must travel in); "
        "None = bfloat16 on a GPU (vLLM), float32 on CPU and on the hf engine (exact logprobs).",
    )
    device: str | None = Field(
        None,
        description="hf engine: torch device of the model, its KV cache and batch (cpu, cuda, cuda:1); None = cuda "
        "when a GPU is visible, else cpu. vLLM places itself.",
    )
    kv_on_swap: Literal["recompute", "keep"] = Field(
        "recompute",
        description="vLLM: what a weight swap does to the KV cache of sequences in flight. recompute: cleared, the "
        "context recomputed with the new weights (exact per-version logprobs); keep: kept (no recompute; later "
        "tokens read old-weight KV: docs/inference.md, 'The KV cache across a swap').",
    )
    seed: int = Field(0, ge=0, description="Engine seed (for requests that carry none).")
    max_num_seqs: int | None = Field(
        None, ge=1, description="Sequences decoded together at most; None = the engine's default (hf 64, vLLM's own)."
    )
    max_model_len: int | None = Field(
        None, ge=2, description="Prompt + completion length limit; None = the model's own context length."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallel GPUs.")
    kv_cache_gib: float | None = Field(
        None,
        gt=0,
        description="vLLM KV cache size per rank in GiB (kv_cache_memory_bytes), on any device; None = on GPU sized "
        "from gpu_memory_utilization, on CPU $VLLM_CPU_KVCACHE_SPACE GiB if set, else 1 GiB.",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="vLLM on GPU: the share of GPU memory the replica may use (weights, activations, then the KV "
        "cache gets the rest); None = 0.9. Ignored when kv_cache_gib is set (vLLM then reserves exactly that).",
    )
    enforce_eager: bool | None = Field(
        None,
        description="vLLM: run eagerly (no torch.compile, no CUDA graphs); None = eager on CPU (fast start), CUDA "
        "graphs on GPU (throughput).",
    )
    default_max_tokens: int = Field(
        16, ge=1, description="OpenAI /v1/completions max_tokens when the request has none."
    )
    request_timeout_s: float = Field(600.0, gt=0, description="A generate call fails after this.")
    weight_load_timeout_s: float = Field(
        300.0,
        gt=0,
        description="LoadWeights default timeout (a request may name its own): each wait for the weight stream, "
        "and the floor of the whole load (fetch + verify + swap), which gets this plus the version's bytes at "
        "100 MB/s (fleetrl/weights/timeouts.py).",
    )
    relay_port: int | None = Field(
        0,
        ge=0,
        le=65535,
        description="Port of this replica's weight relay, which serves the version it loaded through it to its "
        "peers (0 = pick, None = off: relayed loads are refused).",
    )
    relay_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A relayed load fails after this long without progress from its upstream (or waiting for a "
        "peer to start the version); the controller then loads the replica from the trainer directly.",
    )
    shutdown_grace_s: float = Field(5.0, ge=0, description="Grace for in-flight RPCs at stop.")
    log_level: str = Field("INFO", description="Python log level name.")
    ready_file: str | None = Field(None, description="Write the bound ports here as JSON once serving.")
    controller_address: str | None = Field(
        None,
        description="HOST:PORT of a run's controller to join once serving (Register, then Heartbeat); None = wait "
        "to be named by the controller's --inference.",
    )
    member_id: str | None = Field(
        None, description="Id to register under (with controller_address); None = inference-<host>-<pid>."
    )
    max_lora_rank: int = Field(
        0,
        ge=0,
        description="Largest LoRA adapter rank served (0 = LoRA off: full-weight versions only); vLLM sizes "
        "its LoRA slots for the next rank it supports (1, 8, 16, 32, 64, 128, 256, 320, 512).",
    )

    @model_validator(mode="after")
    def _check(self) -> InferenceConfig:
        if not self.model:
            raise ValueError("model: a model directory is required")
        ports = [
            (name, p)
            for name, p in (
                ("grpc_port", self.grpc_port),
                ("http_port", self.http_port),
                ("metrics_port", self.metrics_port),
                ("relay_port", self.relay_port),
            )
            if p
        ]
        values = [p for _, p in ports]
        if len(values) != len(set(values)):
            raise ValueError(f"ports must differ: {dict(ports)}")
        if self.engine == "vllm" and self.max_lora_rank > _VLLM_MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank: vLLM serves LoRA ranks up to {_VLLM_MAX_LORA_RANK}")
        if self.member_id is not None and not self.controller_address:
            raise ValueError("member_id: an id to register under needs controller_address (--controller)")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    @classmethod
    def from_toml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> InferenceConfig:
        """Load a TOML file (top-level keys or an [inference] table), then apply overrides."""
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InferenceConfigError(f"cannot read config {path}: {exc}") from exc
        data = dict(data.get("inference", data))
        data.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls.build(data)

    @classmethod
    def build(cls, data: dict[str, Any]) -> InferenceConfig:
        """Validate a dict; errors name the offending field."""
        try:
            return cls(**data)
        except ValidationError as exc:
            lines = [f"{'.'.join(str(p) for p in err['loc']) or 'config'}: {err['msg']}" for err in exc.errors()]
            raise InferenceConfigError("invalid inference config: " + "; ".join(lines)) from None
