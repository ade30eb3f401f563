"""The cookbook's nested config objects, so `Config(trainer=..., deployment=..., wandb=...)` ports unchanged.

    from fleetrl import Config, DeployConfig, TrainerConfig, WandBConfig
    cfg = Config(base_model=..., trainer=TrainerConfig(), deployment=DeployConfig(tokenizer_model="...",
                 replica_count=2), wandb=WandBConfig(project="my-project"))

Each maps onto fleetrl's own fields (`cookbook_tables`): `DeployConfig.tokenizer_model` -> `tokenizer_model`,
`DeployConfig.replica_count` -> the `[up]` replicas `fleetrl.main` starts (unless it is given `replicas=`),
`WandBConfig` -> `wandb_entity` / `wandb_project` / `wandb_run_name` plus "wandb" in `loggers` when a project is
set. What is Fireworks infrastructure (a training shape, a Fireworks model id) is refused with what to use instead.
The same names work as TOML tables: `[deployment]`, `[trainer]`, `[wandb]`, `[tis]`.

The current recipe's other fields (`training/recipes/async_rl_loop.py`, fw-ai/cookbook #570) are mapped or refused
by `cookbook_recipe_fields`: `tis=TISConfig(...)` -> `tis_level` / `tis_cap` / `icepop_threshold`,
`grad_accumulation_normalization` -> `loss_agg_mode`, the settings fleetrl always behaves as (`anchor_logp =
"old_policy"`, `save_final_checkpoint = True`, `cleanup_on_exit = True`, `router_replay = False`,
`pipeline_chunks_per_step`, which changes only scheduling) are accepted, and what fleetrl cannot do fails naming the
field and why. `cookbook_config(...)` (also `fleetrl.cookbook.Config`) is a `Config` with the cookbook's defaults.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from fleetrl.config import Config as FleetConfig

log = logging.getLogger(__name__)
_warned_stale_policy = False  # the admission-only warning is said once per process


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


class TISConfig(BaseModel):
    """The cookbook's train-inference importance sampling settings (`Config(tis=TISConfig(...))`): the weight
    clamp(exp(old_policy - rollout), max=cap) per token, or its geometric mean per sequence; fleetrl's TIS is the
    same (fleetrl.losses.tis)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    cap: float = Field(5.0, ge=0, description="Upper clamp of the weight (tis_cap).")
    level: Literal["token", "sequence"] = Field("token", description="Per-token or per-sequence weight (tis_level).")
    icepop_threshold: float | None = Field(
        None, ge=1, description="Zero tokens whose ratio is outside [1/t, t] (icepop_threshold)."
    )


def _table(value: Any, cls: type[BaseModel], name: str) -> BaseModel:
    if isinstance(value, cls):
        return value
    if isinstance(value, BaseModel):
        value = value.model_dump(exclude_unset=True)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):  # the cookbook's own dataclass objects
        value = dataclasses.asdict(value)
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
    data = cookbook_recipe_fields(data)
    if data.pop("output_model_id", None) is not None:
        raise ValueError(
            "output_model_id: a Fireworks model id has no meaning in fleetrl; use output_dir (the local folder the "
            "final model is written to)"
        )
    return data, up


GRAD_ACCUMULATION_LOSS_AGG: dict[str | None, tuple[str, float | None]] = {
    None: ("sum", None),
    "num_loss_tokens": ("token-mean", None),
    "num_sequences": ("seq-mean-token-sum-norm", 1.0),
}
"""`grad_accumulation_normalization` -> (`loss_agg_mode`, `loss_agg_constant`). The cookbook's GRPO loss is the sum
of the token losses of every datum; its trainer leaves the accumulated gradient as it is (None) or divides it by
the loss tokens or the sequences. fleetrl's `sum`, `token-mean` and `seq-mean-token-sum-norm` with K = 1 are the
same objectives."""

ACCEPTED_AS_FLEETRL_BEHAVES: dict[str, tuple[Any, str]] = {
    "anchor_logp": (
        "old_policy",
        "fleetrl anchors PPO on the trainer's own logprobs before the update and weighs by TIS against the rollout's "
        "(anchor_logp = 'old_policy'); anchoring on the rollout logprobs ('rollout') is not implemented: leave "
        "anchor_logp out or set 'old_policy'",
    ),
    "save_final_checkpoint": (
        True,
        "fleetrl always writes the final checkpoint and exports the model to output_dir when the run ends; "
        "leave save_final_checkpoint out or set True",
    ),
    "cleanup_on_exit": (
        True,
        "fleetrl.main always stops the services it started when it returns; to keep replicas serving, start them "
        "yourself (fleetrl serve inference) and leave cleanup_on_exit out or set True",
    ),
    "router_replay": (
        False,
        "MoE router replay (R3) needs the serving expert routes replayed in the trainer's forward, which fleetrl "
        "cannot do; set router_replay=False (the cookbook also skips it for dense models)",
    ),
}
"""Cookbook fields accepted only with the value fleetrl always behaves as: (that value, why another is refused)."""


def cookbook_recipe_fields(data: dict[str, Any]) -> dict[str, Any]:
    """Map the current recipe's fields (fw-ai/cookbook #570) onto fleetrl's, or refuse them naming the field and
    why (`ValueError`); see docs/guide.md, "The current cookbook's Config"."""
    data = dict(data)
    if data.get("tis") is not None:
        tis = _table(data.pop("tis"), TISConfig, "tis")
        if tis.cap == 0:
            raise ValueError("tis.cap: 0 zeroes every token's weight (nothing trains); fleetrl needs cap > 0")
        if tis.icepop_threshold == 1:
            raise ValueError("tis.icepop_threshold: 1 drops every token whose ratio is not exactly 1; use > 1")
        _set(data, "tis_level", tis.level, "tis.level")
        _set(data, "tis_cap", tis.cap, "tis.cap")
        if tis.icepop_threshold is not None:
            _set(data, "icepop_threshold", tis.icepop_threshold, "tis.icepop_threshold")
    elif "tis" in data:
        data.pop("tis")
    if "pipeline_chunks_per_step" in data:
        chunks = data.pop("pipeline_chunks_per_step")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"pipeline_chunks_per_step must be an int >= 1, got {chunks!r}")
    if "grad_accumulation_normalization" in data:
        norm = data.pop("grad_accumulation_normalization")
        norm = getattr(norm, "value", norm)  # the cookbook's GradAccNormalization enum
        if norm not in GRAD_ACCUMULATION_LOSS_AGG:
            raise ValueError(
                f"grad_accumulation_normalization must be None, 'num_loss_tokens' or 'num_sequences', got {norm!r}"
            )
        mode, constant = GRAD_ACCUMULATION_LOSS_AGG[norm]
        _set(data, "loss_agg_mode", mode, "grad_accumulation_normalization")
        if constant is not None:
            _set(data, "loss_agg_constant", constant, "grad_accumulation_normalization")
    for name, (value, why) in ACCEPTED_AS_FLEETRL_BEHAVES.items():
        if name in data:
            given = data.pop(name)
            if given != value or isinstance(given, bool) != isinstance(value, bool):
                raise ValueError(f"{name}={given!r}: {why}")
    # Without router replay (refused above) it has no effect, in the cookbook as here.
    if not isinstance(data.pop("router_replay_completion_only", False), bool):
        raise ValueError("router_replay_completion_only must be a bool")
    if data.pop("init_from_checkpoint", None) is not None:
        raise ValueError(
            "init_from_checkpoint: fleetrl resumes a run from its own log_path (fleetrl.main(..., resume=True) or "
            "fleetrl up --resume); to start from another run's trained weights, set base_model to its exported "
            "model (<log_path>/final)"
        )
    if "weight_sync_timeout" in data:
        timeout = data.pop("weight_sync_timeout")
        if timeout is not None:
            raise ValueError(
                f"weight_sync_timeout={timeout!r}: fleetrl's deadline for a weight load is the controller's "
                "weight_push_timeout_s (300 s; a replica not loaded by then is fenced, not the run failed) and the "
                "replica's weight_load_timeout_s; set those in the service configs, and leave this out"
            )
    if data.get("min_group_size") == 1:
        raise ValueError(
            "min_group_size: 1 would emit groups of one sample, whose group advantage is undefined (the cookbook "
            "trains them with advantage 0, a batch slot with no gradient); fleetrl needs >= 2"
        )
    return data


COOKBOOK_DEFAULTS: dict[str, Any] = {
    "completions_per_prompt": 4,
    "max_completion_tokens": 1024,
    "max_rows": 100,
    "prompt_groups_per_step": 1,
    "grad_clip_norm": 0.0,
    "adam_beta2": 0.95,
    "adam_eps": 1e-12,
    "weight_decay": 0.01,
    "grad_accumulation_normalization": None,
    "stale_policy": "train",
}
"""The cookbook's defaults (`async_rl_loop.Config`, `DEFAULT_ADAM`) where they differ from fleetrl's; the
differences that remain are listed in docs/guide.md. `lora_alpha` 32 is added for LoRA runs. `stale_policy =
"train"`: the cookbook bounds staleness at admission only and trains every group it admitted."""


def cookbook_config(**fields: Any) -> FleetConfig:
    """A fleetrl `Config` from the cookbook recipe's keyword arguments, with the cookbook's defaults for what they
    leave out (`COOKBOOK_DEFAULTS`; `lora_alpha` 32 when `lora_rank` > 0; `eps_clip_high` = `eps_clip` when only
    `eps_clip` is given, as the cookbook's symmetric clip). The port of a cookbook recipe writes
    `from fleetrl.cookbook import Config, main` and keeps its `Config(...)` call."""
    from fleetrl.config import Config as FleetConfig

    data = {**COOKBOOK_DEFAULTS, **fields}
    own_spelling = "loss_agg_mode" in fields or "loss_agg_constant" in fields
    if own_spelling and "grad_accumulation_normalization" not in fields:
        data.pop("grad_accumulation_normalization")  # fleetrl's own spelling given: it alone says
    if data.get("lora_rank") and "lora_alpha" not in fields:
        data["lora_alpha"] = 32
    if data.get("eps_clip") is not None and "eps_clip_high" not in fields:
        data["eps_clip_high"] = data["eps_clip"]  # the cookbook's None upper clip is eps_clip (fleetrl's: the loss's)
    cfg = FleetConfig(**data)
    if "stale_policy" not in fields and cfg.stale_policy == "train":
        _warn_admission_only(cfg.max_head_offpolicy_versions)
    return cfg


def _warn_admission_only(max_offpolicy: int) -> None:
    """Said once per process: the cookbook's default turns off fleetrl's per-sample staleness bound."""
    global _warned_stale_policy
    if _warned_stale_policy:
        return
    _warned_stale_policy = True
    log.warning(
        "fleetrl.cookbook.Config: stale_policy = 'train' (the cookbook's default) bounds staleness only when a row "
        "is admitted, so a group that waits can train more than max_head_offpolicy_versions (%d) versions behind "
        "the policy. stale_policy = 'requeue' (fleetrl's default) bounds every trained sample to that many versions "
        "(a group that got older is sampled again); pass stale_policy='train' to keep the cookbook's behaviour "
        "without this warning",
        max_offpolicy,
    )


Config = cookbook_config
"""`from fleetrl.cookbook import Config`: the cookbook's `Config(...)` call, with its defaults."""


def main(cfg: FleetConfig, rollout_fn_factory: Any, rows: Any = None, **options: Any) -> dict[str, Any]:
    """`fleetrl.main` as the cookbook's `main`: `from fleetrl.cookbook import Config, main` is the recipe's import.
    As in the cookbook, `max_rows` caps the rows read from `dataset`, not the `rows=` handed in (fleetrl.main caps
    both), and an `evaluation_fn=` runs every step (its `evaluation_interval = 1`) unless the call or the config
    sets `evaluation_interval`."""
    import fleetrl

    if rows is not None:
        options.setdefault("max_rows", None)
    if options.get("evaluation_fn") is not None and "evaluation_interval" not in cfg.model_fields_set:
        options.setdefault("evaluation_interval", 1)
    return fleetrl.main(cfg, rollout_fn_factory, rows, **options)
