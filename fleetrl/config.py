"""The run-level `Config`: one pydantic model, loadable from TOML, every field described.

Field names follow the Fireworks cookbook `rl_loop` / `async_rl_loop` recipes so configs port unchanged.
Cross-field rules are validators whose errors name the offending field; a bad config fails at start.

    cfg = Config.from_toml("examples/arithmetic/run.toml", overrides={"seed": 1})
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

LrSchedule = Literal["constant", "linear", "cosine"]
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "sum"]
TisLevel = Literal["token", "sequence", "off"]
StalePolicy = Literal["requeue", "train"]


class ConfigError(ValueError):
    """A config that cannot run; the message names the field."""


class Config(BaseModel):
    """Everything a training run needs. See docs/config.md for guidance on each group."""

    # allow_inf_nan=False: temperature = inf (or any non-finite float) fails at start, naming the field.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, frozen=False)

    # --- paths and model ---
    log_path: str = Field("runs/latest", description="Directory for logs and metrics.jsonl.")
    base_model: str = Field("", description="HF causal LM to train: a local path or hub id.")
    tokenizer_model: str | None = Field(None, description="Tokenizer path; None = base_model.")
    output_dir: str | None = Field(
        None, description="Where the final policy is exported in HF format; None = log_path/final."
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Trainer weight dtype.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward.")

    # --- data ---
    dataset: str | None = Field(None, description="Prompt rows: a JSONL or Parquet file (or rows via main()).")
    max_rows: int | None = Field(None, ge=1, description="Use at most this many dataset rows.")
    epochs: int = Field(1, ge=1, description="Passes over the dataset.")
    shuffle: bool = Field(True, description="Shuffle rows each epoch (seeded).")
    seed: int = Field(0, description="Seed for data order, sampling and init.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many steps (None: data).")

    # --- optimizer ---
    learning_rate: float = Field(1e-5, gt=0, description="Peak AdamW learning rate.")
    lr_schedule: LrSchedule = Field("constant", description="Decay after warmup.")
    lr_warmup_steps: int = Field(0, ge=0, description="Linear warmup steps (optimizer steps).")
    lr_min_ratio: float = Field(0.0, ge=0, le=1, description="Final LR as a fraction of the peak.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    grad_clip_norm: float | None = Field(1.0, gt=0, description="Clip grad norm; None = off.")

    # --- rollouts and sampling ---
    completions_per_prompt: int = Field(8, description="G: samples per prompt (group size), >= 2.")
    prompt_groups_per_step: int = Field(4, ge=1, description="P: groups per optimizer batch.")
    max_completion_tokens: int = Field(256, ge=1, description="max_tokens per sampler call.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling; 1.0 = full distribution.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 = off.")
    max_seq_len: int = Field(2048, ge=2, description="Longest trajectory (prompt + completion).")
    advantage_mode: Literal["standardize", "center"] = Field(
        "standardize", description="Group advantage: (r-mean)/std, or mean-centering only."
    )
    max_concurrency: int | None = Field(None, description="C: rollout samples in flight at once; None = unbounded.")
    rollout_extras: dict[str, Any] = Field(
        default_factory=dict, description="Free-form values handed to the rollout factory."
    )

    # --- loss ---
    policy_loss: str = Field("grpo", description="One of fleetrl.losses.LOSS_NAMES.")
    loss_agg_mode: LossAggMode = Field("token-mean", description="How token losses aggregate.")
    loss_agg_constant: float | None = Field(
        None, gt=0, description="Dr. GRPO normaliser for seq-mean-token-sum-norm; None = T."
    )
    eps_clip: float | None = Field(
        None, gt=0, lt=1, description="Lower clip; None = the loss's default (0.2; gspo 3e-4)."
    )
    eps_clip_high: float | None = Field(
        None, gt=0, description="Upper clip; None = the loss's default (0.2; dapo 0.28; gspo 4e-4)."
    )
    dual_clip_c: float | None = Field(None, gt=1, description="dapo dual-clip bound c > 1.")
    kl_beta: float = Field(0.001, ge=0, description="k3 KL weight vs the reference (grpo).")
    dro_beta: float = Field(0.05, ge=0, description="dro's quadratic penalty weight.")
    tis_level: TisLevel = Field("token", description="Truncated importance sampling level.")
    tis_cap: float = Field(5.0, gt=0, description="TIS weight cap.")
    icepop_threshold: float | None = Field(
        None, gt=1, description="IcePop: zero tokens whose ratio is outside [1/t, t]."
    )
    num_minibatches: int = Field(1, ge=1, description="Optimizer steps per batch (PPO inner loop).")
    max_nonfinite_steps: int = Field(
        3, ge=1, description="Steps in a row whose loss or gradient is not finite (each skipped) before the run fails."
    )

    # --- asynchrony and weight sync ---
    max_head_offpolicy_versions: int = Field(
        1, description="O: how many versions a sample may lag the trained policy; 0 = on-policy."
    )
    synchronous_training: bool = Field(
        False, description="Strict on-policy: generate step k+1 only after step k is published."
    )
    stale_policy: StalePolicy = Field(
        "requeue", description="A group older than O at train time: requeue it, or train it."
    )
    weight_sync_interval: int = Field(1, ge=0, description="Publish weights every N optimizer batches; 0 = never.")

    # --- checkpoints and evaluation ---
    dcp_save_interval: int = Field(0, ge=0, description="Checkpoint every N batches; 0 = end only.")
    evaluation_interval: int = Field(0, ge=0, description="Evaluate every N steps; 0 = start/end.")
    eval_dataset: str | None = Field(None, description="Held-out rows (JSONL or Parquet) for the evaluation hook.")

    @model_validator(mode="before")
    @classmethod
    def _synchronous_implies_on_policy(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("synchronous_training"):
            o = data.get("max_head_offpolicy_versions")
            if o is None:
                data = {**data, "max_head_offpolicy_versions": 0}
            elif o != 0:
                raise ValueError(
                    f"max_head_offpolicy_versions must be 0 (or unset) when synchronous_training is true; got {o}"
                )
        return data

    @model_validator(mode="after")
    def _check_cross_fields(self) -> Config:
        from fleetrl.losses import LOSS_NAMES

        g = self.completions_per_prompt
        if g < 2:
            raise ValueError(f"completions_per_prompt must be >= 2 for group advantages, got {g}")
        if self.max_head_offpolicy_versions < 0:
            raise ValueError(f"max_head_offpolicy_versions must be >= 0, got {self.max_head_offpolicy_versions}")
        if self.max_concurrency is not None and self.max_concurrency < g:
            raise ValueError(
                f"max_concurrency ({self.max_concurrency}) must be >= completions_per_prompt ({g}):"
                " a row of G samples could never be admitted"
            )
        if self.policy_loss not in LOSS_NAMES:
            raise ValueError(f"policy_loss {self.policy_loss!r} is not one of {list(LOSS_NAMES)}")
        if self.max_completion_tokens >= self.max_seq_len:
            raise ValueError(
                f"max_completion_tokens ({self.max_completion_tokens}) must be < max_seq_len "
                f"({self.max_seq_len}) to leave room for the prompt"
            )
        batch = self.prompt_groups_per_step * g
        if self.num_minibatches > batch:
            raise ValueError(f"num_minibatches ({self.num_minibatches}) must be <= P*G = {batch} samples per step")
        interval, o = self.weight_sync_interval, self.max_head_offpolicy_versions
        if interval > o + 1:
            raise ValueError(
                f"weight_sync_interval ({interval}) must be <= max_head_offpolicy_versions + 1 "
                f"({o + 1}): rollouts would wait for weights that are not pushed yet"
            )
        if interval == 0 and (self.synchronous_training or self.stale_policy == "requeue"):
            raise ValueError(
                "weight_sync_interval = 0 (the replicas keep the base weights) needs stale_policy = 'train' and "
                "asynchronous training: every sample would be older than the policy it trains after "
                f"{o + 1} steps (synchronous_training = {self.synchronous_training}, stale_policy = "
                f"{self.stale_policy!r})"
            )
        if self.lr_warmup_steps and self.max_steps and self.lr_warmup_steps > self.max_steps:
            raise ValueError(f"lr_warmup_steps ({self.lr_warmup_steps}) must be <= max_steps ({self.max_steps})")
        return self

    @property
    def batch_size(self) -> int:
        """B = P * G samples per optimizer batch."""
        return self.prompt_groups_per_step * self.completions_per_prompt

    @property
    def sample_kwargs(self) -> dict[str, Any]:
        """The sampling settings handed to rollouts (`RolloutSetup.sample_kwargs`)."""
        return {
            "max_tokens": self.max_completion_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }

    @classmethod
    def from_toml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
        """Load a TOML file (top-level keys, or a [run] table; a .json file works the same way);
        `overrides` win over the file."""
        tables = read_config_file(path)
        data = dict(tables.get("run", tables))
        data.update(overrides or {})
        return cls.load(data, source=str(path))

    @classmethod
    def load(cls, data: dict[str, Any], source: str = "config") -> Config:
        """Validate a dict; raise `ConfigError` with one line per bad field."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, source)) from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The tables of a TOML (or JSON) config file; `ConfigError` naming the file when it cannot be read."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def build_service_config(cls: type[BaseModel], data: dict[str, Any], label: str, error: type[Exception] = ConfigError):
    """Validate a service config dict; one `error` whose message names every bad field (`label`: which config)."""
    try:
        return cls(**data)
    except ValidationError as exc:
        lines = [f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in exc.errors()]
        raise error(f"invalid {label} config: " + "; ".join(lines)) from None


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid config"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(cross-field)"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"  {where}: {msg}")
    return "\n".join(lines)


def parse_override(item: str) -> tuple[str, Any]:
    """`key=value` from the command line; the value is parsed as a TOML value when it can be."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value")
    key, raw = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value
