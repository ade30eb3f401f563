"""`UpConfig`: how `fleetrl up` lays out the services on one machine (the `[up]` table of run.toml)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fleetrl.config import Config, ConfigError, format_validation_error, parse_override, read_config_file
from fleetrl.gpu_layout import check_disjoint_gpus, check_gpu_lists


class UpConfig(BaseModel):
    # allow_inf_nan=False: temperature = inf (or any non-finite float) fails at start, naming the field.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    rollout: str = Field(..., description="Rollout factory: 'module:make_rollout_fn' or 'path/file.py:attr'.")
    dynamic_filter: str | None = Field(None, description="'uniform' (drop equal-reward groups) or 'module:fn'.")
    evaluation: str | None = Field(
        None,
        description="Evaluation hook 'module:fn' or 'file.py:fn' (async fn(setup, rows) -> dict), run by gateway-0.",
    )
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="Inference engine of every replica; unset with inference_gpus given, 'vllm'."
    )
    replicas: int = Field(1, ge=1, description="Inference replicas.")
    gateways: int = Field(1, ge=1, description="Rollout gateways.")
    controller_address: str | None = Field(
        None, description="Attach to a controller already running there: start only gateways."
    )
    auth_token: str | None = Field(None, description="Shared token for every service; None = $FLEETRL_AUTH_TOKEN.")
    startup_timeout_s: float = Field(600.0, gt=0, description="Each service must be ready within this.")
    stop_timeout_s: float = Field(
        300.0,
        gt=0,
        description="At a stop (Ctrl-C, SIGTERM, the end, a crash): how long the controller (finishing its step in "
        "flight) and then the trainer (checkpointing it) each get before they are killed.",
    )
    inference_args: list[str] = Field(default_factory=list, description="Extra flags for each inference replica.")
    trainer_args: list[str] = Field(default_factory=list, description="Extra flags for the trainer.")
    gateway_args: list[str] = Field(default_factory=list, description="Extra flags for each gateway.")
    controller_args: list[str] = Field(default_factory=list, description="Extra flags for the controller.")
    max_gateway_restarts: int = Field(5, ge=0, description="Crashed gateways replaced at most this many times.")
    max_replica_restarts: int = Field(
        5,
        ge=0,
        description="Crashed inference replicas restarted at most this many times (in all); a restarted one rejoins "
        "the run under its old member id and serves once the controller has pushed it the current version.",
    )
    split_cpu_threads: bool = Field(
        True,
        description="Share the CPU cores between trainer, hf replicas and reference (OMP_NUM_THREADS each) unless "
        "OMP_NUM_THREADS is set; see fleetrl/up/cpu_threads.py.",
    )
    trainer_procs: int = Field(
        1,
        ge=1,
        description="Trainer ranks per node; above 1 (or with trainer_nodes > 1) it runs under torchrun (FSDP2: "
        "NCCL on GPUs, gloo on CPU).",
    )
    trainer_nodes: int = Field(
        1,
        ge=1,
        description="Trainer 'nodes': above 1, one torchrun agent per node on this machine, meeting through a c10d "
        "rendezvous on loopback; world size = trainer_nodes x trainer_procs.",
    )
    trainer_sharding: Literal["fsdp", "hsdp"] = Field(
        "fsdp",
        description="FSDP2 mesh: fsdp shards over every rank; hsdp shards within a node and replicates across nodes "
        "(needs trainer_nodes > 1 and trainer_procs > 1).",
    )
    trainer_gpus: list[int] | None = Field(
        None,
        description="GPU ids the trainer uses (CUDA_VISIBLE_DEVICES), one per rank (node 0's ranks first); implies "
        "--device cuda.",
    )
    inference_gpus: list[list[int]] | None = Field(
        None, description="GPU ids of each inference replica (CUDA_VISIBLE_DEVICES), one list per replica."
    )
    inference_tensor_parallel_size: int = Field(
        1, ge=1, description="vLLM tensor_parallel_size of each replica (GPUs per replica); above 1 needs engine vllm."
    )
    reference_placement: Literal["trainer", "service"] = Field(
        "trainer",
        description="Where the KL reference runs (kl_beta > 0, full fine-tuning): 'trainer' = a frozen copy in the "
        "trainer's ranks (--reference local: its device and compute dtype, sharded like the policy, no extra "
        "process); 'service' = a reference service process on the trainer's device and compute dtype "
        "(reference_gpus when the trainer is on GPUs).",
    )
    reference_gpus: list[int] | None = Field(
        None,
        description="The GPU id of the reference service (CUDA_VISIBLE_DEVICES; one GPU), with reference_placement "
        "= 'service'; implies --device cuda. Required there when the trainer runs on CUDA.",
    )
    judge_model: str | None = Field(
        None,
        description="A judge model (path or hub id) served by a pool of its own frozen inference replicas (never "
        "sent weights); rollouts reach it as setup.judge_sampler and setup.judge_base_url (docs/guide.md).",
    )
    judge_replicas: int = Field(1, ge=1, description="Inference replicas of the judge pool (with judge_model).")
    judge_engine: Literal["hf", "vllm"] | None = Field(
        None, description="Inference engine of the judge replicas; None = engine (with judge_model)."
    )
    judge_args: list[str] = Field(
        default_factory=list, description="Extra flags for each judge replica (with judge_model)."
    )

    @property
    def trainer_ranks(self) -> int:
        return self.trainer_nodes * self.trainer_procs

    @model_validator(mode="before")
    @classmethod
    def _vllm_on_gpus(cls, data: Any) -> Any:
        """Replicas placed on GPUs (inference_gpus) serve with vLLM unless `engine` says otherwise: the hf engine is
        the CPU development engine, and a user who lays out GPUs expects the GPU one."""
        if isinstance(data, dict) and data.get("inference_gpus") is not None and "engine" not in data:
            return {**data, "engine": "vllm"}
        return data

    @model_validator(mode="after")
    def _gpu_layout(self) -> UpConfig:
        if self.trainer_gpus is not None and len(self.trainer_gpus) != self.trainer_ranks:
            layout = "trainer_procs" if self.trainer_nodes == 1 else "trainer_nodes x trainer_procs"
            raise ValueError(
                f"trainer_gpus has {len(self.trainer_gpus)} GPUs but {layout} is {self.trainer_ranks}: "
                "one GPU per trainer rank"
            )
        if self.trainer_sharding == "hsdp" and (self.trainer_nodes < 2 or self.trainer_procs < 2):
            raise ValueError(
                f"trainer_sharding = hsdp needs trainer_nodes > 1 and trainer_procs > 1 (has {self.trainer_nodes} "
                f"x {self.trainer_procs}): it shards within a node and replicates across nodes; use fsdp"
            )
        if self.inference_gpus is not None and len(self.inference_gpus) != self.replicas:
            raise ValueError(
                f"inference_gpus has {len(self.inference_gpus)} lists but replicas is {self.replicas}: "
                "one list of GPU ids per replica"
            )
        if self.trainer_gpus is not None and len(set(self.trainer_gpus)) != len(self.trainer_gpus):
            twice = sorted({i for i in self.trainer_gpus if self.trainer_gpus.count(i) > 1})
            raise ValueError(f"trainer_gpus lists GPU {', '.join(map(str, twice))} twice: one GPU per trainer rank")
        if self.trainer_gpus is not None and self.inference_gpus is not None:
            check_disjoint_gpus(
                self.trainer_gpus, [i for ids in self.inference_gpus for i in ids], "trainer_gpus", "inference_gpus"
            )
        self._reference_layout()
        self._judge_settings()
        tp = self.inference_tensor_parallel_size
        if tp > 1 and self.engine != "vllm":
            raise ValueError(
                f"inference_tensor_parallel_size = {tp} needs engine = 'vllm' (hf replicas run on one device)"
            )
        if tp > 1 and self.inference_gpus is not None and any(len(ids) != tp for ids in self.inference_gpus):
            raise ValueError(
                f"inference_gpus: each replica needs inference_tensor_parallel_size = {tp} GPUs, has "
                f"{[len(ids) for ids in self.inference_gpus]}"
            )
        return self

    def _judge_settings(self) -> None:
        """Judge settings without a judge_model would be silently ignored: refuse them, naming the field."""
        if self.judge_model is not None:
            if not self.judge_model.strip():
                raise ValueError("judge_model: give the judge's path or hub id (or leave it unset)")
            return
        given = {
            "judge_replicas": self.judge_replicas != 1,
            "judge_engine": self.judge_engine is not None,
            "judge_args": bool(self.judge_args),
        }
        for name, is_set in given.items():
            if is_set:
                raise ValueError(f"{name} is a judge pool setting: it needs judge_model (the judge to serve)")

    def _reference_layout(self) -> None:
        if self.reference_gpus is not None and self.reference_placement != "service":
            raise ValueError(
                "reference_gpus: the reference runs in the trainer's ranks (reference_placement = 'trainer'), on "
                "the trainer's GPUs; set reference_placement = 'service' to give it GPUs of its own"
            )
        if self.reference_gpus is not None and len(self.reference_gpus) != 1:
            raise ValueError(
                f"reference_gpus has {len(self.reference_gpus)} GPUs: the reference service runs on one GPU (a "
                "model too big for one runs best with reference_placement = 'trainer', sharded like the policy)"
            )
        if self.reference_placement == "service" and self.reference_gpus is None and self.trainer_on_cuda:
            raise ValueError(
                "reference_gpus: reference_placement = 'service' with the trainer on CUDA needs a GPU of the "
                "reference service's own (reference_gpus = [id]), or reference_placement = 'trainer'"
            )
        if self.reference_gpus is not None:
            lists = {"reference_gpus": self.reference_gpus}
            if self.trainer_gpus is not None:
                lists["trainer_gpus"] = self.trainer_gpus
            if self.inference_gpus is not None:
                lists["inference_gpus"] = [i for ids in self.inference_gpus for i in ids]
            check_gpu_lists(lists)

    @property
    def trainer_device(self) -> str:
        """The trainer's torch device: its --device in trainer_args, else cuda with trainer_gpus, else cpu."""
        device = None
        for i, arg in enumerate(self.trainer_args):  # the last --device wins, as the trainer's parser takes it
            if arg == "--device" and i + 1 < len(self.trainer_args):
                device = self.trainer_args[i + 1]
            elif arg.startswith("--device="):
                device = arg.split("=", 1)[1]
        return device or ("cuda" if self.trainer_gpus is not None else "cpu")

    @property
    def trainer_on_cuda(self) -> bool:
        return self.trainer_device.startswith("cuda")

    def reference_env(self) -> dict[str, str]:
        """CUDA_VISIBLE_DEVICES of the reference service: its reference_gpus."""
        return {} if self.reference_gpus is None else {"CUDA_VISIBLE_DEVICES": _gpu_list(self.reference_gpus)}

    def trainer_env(self, node: int = 0) -> dict[str, str]:
        """CUDA_VISIBLE_DEVICES of trainer node `node`: its trainer_procs GPUs of trainer_gpus."""
        if self.trainer_gpus is None:
            return {}
        return {"CUDA_VISIBLE_DEVICES": _gpu_list(self.trainer_gpus[node * self.trainer_procs :][: self.trainer_procs])}

    def replica_env(self, index: int) -> dict[str, str]:
        return {} if self.inference_gpus is None else {"CUDA_VISIBLE_DEVICES": _gpu_list(self.inference_gpus[index])}

    @classmethod
    def from_file(
        cls, path: str | Path, overrides: dict[str, Any] | None = None, defaults: dict[str, Any] | None = None
    ) -> UpConfig:
        """The [up] table of `path` over `defaults` (what the run's cookbook tables imply, e.g. `[deployment]
        replica_count`); `overrides` (from `--set up.<key>=...`, without the prefix) win."""
        data = {**(defaults or {}), **read_config_file(path).get("up", {})}
        data.update(overrides or {})
        return cls.from_dict(data, source=str(path), override_keys=overrides or ())

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str, override_keys: Iterable[str] = ()) -> UpConfig:
        """Validate; a ConfigError names each bad `up.<field>` (the closest field for an unknown one), and blames
        --set for the keys in `override_keys`."""
        try:
            return cls(**data)
        except ValidationError as exc:
            text = format_validation_error(exc, source, cls, override_keys, prefix="up.")
            raise ConfigError(text.replace("invalid config", "invalid [up] table", 1)) from None


def load_run_and_up(path: Path, sets: list[str]) -> tuple[Config, UpConfig, list[str]]:
    """The run `Config` and `UpConfig` of a run.toml with `--set` overrides: `up.<key>=V` goes to the [up] table,
    anything else to the run. Also returns the run's own --set strings (what the services are started with)."""
    run_sets = [s for s in sets if not s.strip().startswith(UP_PREFIX)]
    up_overrides = dict(parse_override(s) for s in sets if s.strip().startswith(UP_PREFIX))
    up_overrides = {k.removeprefix(UP_PREFIX): v for k, v in up_overrides.items()}
    run = Config.from_toml(path, dict(parse_override(s) for s in run_sets))
    return run, UpConfig.from_file(path, up_overrides, run.cookbook_up_options), run_sets


UP_PREFIX = "up."


def _gpu_list(ids: list[int]) -> str:
    return ",".join(str(i) for i in ids)
