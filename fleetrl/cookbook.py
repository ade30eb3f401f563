"""The cookbook's nested config objects, so `Config(trainer=..., deployment=..., wandb=...)` ports unchanged.

    from fleetrl import Config, DeployConfig, TrainerConfig, WandBConfig
    cfg = Config(base_model=..., trainer=TrainerConfig(), deployment=DeployConfig(tokenizer_model="...",
                 replica_count=2), wandb=WandBConfig(project="my-project"))

Each maps onto fleetrl's own fields (`cookbook_tables`): `DeployConfig.tokenizer_model` -> `tokenizer_model`,
`DeployConfig.replica_count` -> the `[up]` replicas `fleetrl.main` starts (unless it is given `replicas=`),
`WandBConfig` -> `wandb_entity` / `wandb_project` / `wandb_run_name` plus "wandb" in `loggers` when a project is
set. What is Fireworks infrastructure (a training shape, a Fireworks model id) is refused with what to use instead.
The same names work as TOML tables: `[deployment]`, `[trainer]`, `[wandb]`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class DeployConfig(BaseModel):
    """The cookbook's inference deployment: which tokenizer, how many replicas."""

    model_config = ConfigDict(extra="forbid")
    tokenizer_model: str | None = Field(None, description="Tokenizer path or hub id; None = base_model.")
    replica_count: int | None = Field(None, ge=1, description="Inference replicas ([up] replicas); None = 1.")


class TrainerConfig(BaseModel):
    """The cookbook's trainer: fleetrl sizes it with [up] trainer_procs / trainer_gpus instead of a shape id."""

    model_config = ConfigDict(extra="forbid")
    training_shape_id: str | None = Field(None, description="Fireworks training shape; only None works in fleetrl.")


class WandBConfig(BaseModel):
    """The cookbook's W&B settings."""

    model_config = ConfigDict(extra="forbid")
    entity: str | None = Field(None, description="W&B entity; None or '' = your default.")
    project: str | None = Field(None, description="W&B project; set = log to W&B.")
    run_name: str | None = Field(None, description="W&B run name; None = the log folder's name.")


def _table(value: Any, cls: type[BaseModel], name: str) -> BaseModel:
    if isinstance(value, cls):
        return value
    if isinstance(value, BaseModel):
        value = value.model_dump(exclude_unset=True)
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a {cls.__name__} or a table, got {type(value).__name__}")
    unknown = sorted(set(value) - set(cls.model_fields))
    if unknown:
        raise ValueError(
            f"{name}.{unknown[0]}: not a field fleetrl's {cls.__name__} knows (it has {', '.join(cls.model_fields)})"
        )
    return cls.model_validate(value)


def _set(data: dict[str, Any], field: str, value: Any, source: str) -> None:
    if field in data and data[field] is not None and data[field] != value:
        raise ValueError(f"{source} and {field} disagree ({value!r} vs {data[field]!r}): set one of them")
    data[field] = value


def cookbook_tables(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Map `deployment` / `trainer` / `wandb` (objects or tables) and `output_model_id` onto fleetrl's fields.
    Returns the new data and the `[up]` settings they imply (`replicas`); `ValueError` naming the field."""
    data, up = dict(data), {}
    deployment_key = "deployment" if "deployment" in data else "deploy_config"
    if data.get(deployment_key) is not None:
        deploy = _table(data.pop(deployment_key), DeployConfig, deployment_key)
        if deploy.tokenizer_model is not None:
            _set(data, "tokenizer_model", deploy.tokenizer_model, f"{deployment_key}.tokenizer_model")
        if deploy.replica_count is not None:
            up["replicas"] = deploy.replica_count
    if data.get("trainer") is not None:
        trainer = _table(data.pop("trainer"), TrainerConfig, "trainer")
        if trainer.training_shape_id is not None:
            raise ValueError(
                "trainer.training_shape_id: Fireworks training shapes do not exist in fleetrl; it sizes the trainer "
                "with [up] trainer_procs / trainer_gpus (fleetrl.main(..., trainer_procs=N, trainer_gpus=[...]))"
            )
    elif "trainer" in data:
        data.pop("trainer")
    if data.get("wandb") is not None:
        wandb = _table(data.pop("wandb"), WandBConfig, "wandb")
        if wandb.entity:
            _set(data, "wandb_entity", wandb.entity, "wandb.entity")
        if wandb.run_name is not None:
            _set(data, "wandb_run_name", wandb.run_name, "wandb.run_name")
        if wandb.project:
            _set(data, "wandb_project", wandb.project, "wandb.project")
            loggers = list(data.get("loggers") or ["jsonl"])
            data["loggers"] = loggers if "wandb" in loggers else [*loggers, "wandb"]
    for key in ("deployment", "deploy_config", "wandb"):
        if key in data and data[key] is None:
            data.pop(key)
    if data.pop("output_model_id", None) is not None:
        raise ValueError(
            "output_model_id: a Fireworks model id has no meaning in fleetrl; use output_dir (the local folder the "
            "final model is written to)"
        )
    return data, up
