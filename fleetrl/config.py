"""The run-level `Config`: one pydantic model, loadable from TOML, every field described.

Field names follow the Fireworks cookbook `rl_loop` / `async_rl_loop` recipes so configs port unchanged.
Cross-field rules are validators whose errors name the offending field; a bad config fails at start.

    cfg = Config.from_toml("examples/arithmetic/run.toml", overrides={"seed": 1})
"""

from __future__ import annotations

import difflib
import json
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from fleetrl.cookbook import cookbook_tables
from fleetrl.dataset_sources import DatasetSource, check_sources

LrSchedule = Literal["constant", "linear", "cosine"]
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "sum"]
TisLevel = Literal["token", "sequence", "off"]
StalePolicy = Literal["requeue", "train"]


# Built-in advantage estimators (fleetrl.trainer.advantage_estimators), by name.
ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "reinforce_pp", "turn_discounted")


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
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Trainer weight (master) dtype, also that of the gradients and AdamW state. bfloat16 is pure "
        "bf16: updates smaller than a weight's rounding step (lr ~1e-6) are lost (docs/trainer.md).",
    )
    export_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Dtype of the final HF export: auto = inference_dtype if set, else dtype. At world size > 1 "
        "every rank writes its own shards (torch.distributed.checkpoint's HF writer); no rank gathers the model.",
    )
    optimizer_state_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Dtype of the AdamW moments: bfloat16 over float32 master weights stores 12 bytes a parameter "
        "with its gradient instead of 16 (a 70B model's state on 32 GPUs; docs/trainer.md), the update computed in "
        "float32.",
    )
    fsdp_cpu_offload: bool = Field(
        False,
        description="FSDP2's CPUOffloadPolicy: parameter shards, gradients and the optimizer step live in host "
        "memory, copied to the GPU a layer at a time (world size > 1 only; memory for speed).",
    )
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Dtype of the trainer's forward and backward: bfloat16 with float32 weights is mixed precision "
        "(FSDP2 MixedPrecisionPolicy, or autocast on one process); auto = bfloat16 on CUDA, dtype on CPU.",
    )
    inference_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="The dtype the inference replicas serve, and so the dtype weights travel in (the trainer casts "
        "floating tensors when it publishes: bfloat16 halves the bytes of a float32 trainer's push); None = dtype. "
        "`fleetrl up` starts its replicas with it.",
    )
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto",
        description="Recompute the decoder layers' activations in backward; auto = for micro-batches of at least "
        "4096 tokens (long rows), off for shorter ones.",
    )
    gradient_checkpointing_every: int = Field(
        1,
        ge=1,
        description="Checkpoint every k-th decoder layer only (layers 0, k, 2k, ...; the others keep their "
        "activations): less recomputation for more memory; 1 = every layer.",
    )
    gradient_checkpointing_scope: Literal["layer", "attention", "mlp"] = Field(
        "layer",
        description="What a checkpointed layer recomputes: the whole layer, only its attention (projections, RoPE, "
        "attention) or only its MLP (docs/trainer.md, 'Activation checkpointing').",
    )
    liger_kernels: bool | Literal["auto"] = Field(
        "auto",
        description="Liger's fused RMSNorm, SwiGLU, RoPE and linear cross-entropy logprob head (the `liger` extra): "
        "auto = on CUDA when installed; true requires them (fails at start without CUDA or the package).",
    )
    compile_layers: bool = Field(
        False,
        description="torch.compile each decoder layer on its own (one graph reused by every layer); the first "
        "steps pay the compile time.",
    )
    packing: bool = Field(
        True,
        description="Concatenate a micro-batch's samples into one row with per-sample positions (no compute on "
        "padding); False = right-padded rows.",
    )
    micro_batch_tokens: int | None = Field(
        16384,
        ge=1,
        description="Token budget of one forward/backward (gradient accumulation); a longer sample goes alone. "
        "None = a rank's whole minibatch share in one pass.",
    )
    logprob_chunk_tokens: int = Field(
        1024,
        ge=0,
        description="Positions projected onto the vocabulary at a time for logprobs and entropy (the [tokens, vocab] "
        "logits never exist whole); 0 = full logits.",
    )

    # --- LoRA (docs/guide.md "LoRA"; needs the `lora` extra: peft) ---
    lora_rank: int = Field(0, ge=0, description="LoRA rank r; 0 = full fine-tuning.")
    lora_alpha: float | None = Field(
        None, gt=0, description="LoRA scale numerator (update = alpha/r * BA); None = 2 * lora_rank."
    )
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input (training only).")
    lora_target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Modules that get adapters: names (q_proj, v_proj, ...) or every decoder linear."
    )
    warm_start_from_adapter: str | None = Field(
        None, description="A PEFT adapter folder (adapter_config.json) to start from; its rank must equal lora_rank."
    )
    export_merged: bool = Field(
        False, description="LoRA: also write the merged model in HF format to output_dir/merged."
    )

    # --- data ---
    dataset: str | None = Field(
        None,
        description="Prompt rows: a JSONL or Parquet file, a save_to_disk folder or a cached hub id, memory-mapped "
        "through HF datasets (a JSONL of at most 8 MiB is read into memory) (or rows via main()).",
    )
    datasets: list[DatasetSource] | None = Field(
        None,
        description="A mixture instead of one dataset: [[run.datasets]] tables (path, name, weight, weight_schedule, "
        "difficulty_field, min/max_difficulty), drawn by weight; each source's cursor is journaled (docs/guide.md, "
        "'Dataset mixtures and curricula').",
    )
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
    grad_clip_norm: float | None = Field(1.0, gt=0, description="Clip grad norm; None (or 0.0) = off.")

    # --- rollouts and sampling ---
    completions_per_prompt: int = Field(8, description="G: samples per prompt (group size), >= 2.")
    prompt_groups_per_step: int = Field(4, ge=1, description="P: groups per optimizer batch.")
    max_completion_tokens: int = Field(256, ge=1, description="max_tokens per sampler call.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling; 1.0 = full distribution.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 = off.")
    max_seq_len: Annotated[int, Field(ge=2)] | Literal["model"] | None = Field(
        "model",
        description="Longest trajectory (prompt + completion); longer ones are dropped. 'model' = the model's context "
        "length (max_position_embeddings in its config.json); None = no cap.",
    )
    advantage_mode: Literal["standardize", "center"] = Field(
        "standardize", description="Group advantage: (r-mean)/std, or mean-centering only."
    )
    advantage_estimator: str = Field(
        "grpo",
        description="How a step's rewards become advantages: 'grpo' (group normalisation, advantage_mode), 'rloo' "
        "(leave-one-out baseline), 'reinforce_pp' (group-centred, batch-normalised), 'turn_discounted' (per turn: "
        "discounted return-to-go against the group at that turn, from samples' turn_rewards) or an import path "
        "'pkg.module:fn' / 'path/to/file.py:fn' (docs/losses.md, 'Advantage estimators'), tried at start.",
    )
    turn_discount: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="gamma of advantage_estimator 'turn_discounted': a turn's return is its reward plus gamma times "
        "the next turn's return.",
    )
    max_concurrency: int | None = Field(None, description="C: rollout samples in flight at once; None = unbounded.")
    rollout_extras: dict[str, Any] = Field(
        default_factory=dict, description="Free-form values handed to the rollout factory."
    )
    session_idle_timeout_s: float = Field(
        600.0,
        ge=0,
        description="An agent session no call has reached for this long expires: its endpoint answers 404 and the "
        "gateway keeps nothing of it (the rollout keeps what it recorded); 0 = never.",
    )
    session_max_body_bytes: int = Field(
        4 * 2**20, ge=1024, description="An agent session request with a larger body is refused (413), unread."
    )
    session_max_connections: int = Field(
        1024,
        ge=1,
        description="Open connections to a gateway's agent session server at most; one more is closed as it is "
        "accepted.",
    )
    min_group_size: int = Field(
        2, ge=2, description="A row with fewer valid samples is rejected (the gateway's min_samples wins when set)."
    )
    max_incomplete_group_retries: int = Field(
        0, ge=0, description="Times a row short of min_group_size runs its failed members again before rejection."
    )

    # --- loss ---
    policy_loss: str = Field(
        "grpo",
        description="One of fleetrl.losses.LOSS_NAMES, or a custom loss: an import path ('pkg.module:fn', "
        "'pkg.module.fn', 'file.py:fn') or, in Python, a module-level function (docs/losses.md).",
    )
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
    teacher_model: str | None = Field(
        None,
        description="On-policy distillation: a teacher HF causal LM (path or hub id, the run's tokenizer) that the "
        "reference holds instead of base_model; it scores every sampled token (docs/losses.md).",
    )
    distill_weight: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Weight w of the teacher's signal: per-token advantage (1 - w) * A + w * (teacher - old); "
        "None = 1.0 with teacher_model (pure distillation), 0 without.",
    )
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
        0, description="O: how many versions a sample may lag the trained policy; 0 = on-policy (the default)."
    )
    synchronous_training: bool = Field(
        False, description="Strict on-policy: generate step k+1 only after step k is published."
    )
    stale_policy: StalePolicy = Field(
        "requeue", description="A group older than O at train time: requeue it, or train it."
    )
    weight_sync_interval: int = Field(1, ge=0, description="Publish weights every N optimizer batches; 0 = never.")
    overlap_weight_push: bool = Field(
        True,
        description="With O >= 1, train the next step while the last version travels to the replicas (one push in "
        "flight, a newer version supersedes one waiting); false, or O = 0, awaits every push before the next step.",
    )
    weight_fanout: Literal["direct", "chain", "tree"] = Field(
        "direct",
        description="How a version reaches the replicas: 'direct' (each fetches from the trainer), 'chain' (the "
        "trainer sends one copy, each replica relays it to the next) or 'tree' (relayed, each to two).",
    )
    weight_transport: Literal["zmq", "collective", "engine"] = Field(
        "zmq",
        description="How a pushed version's bytes move: 'zmq' (each replica fetches over the weight stream), "
        "'collective' (the trainer broadcasts it to the replicas in one torch.distributed group per push; gloo on "
        "CPU; a replica that cannot join fetches it over ZeroMQ) or 'engine' (the trainer sends it through vLLM's "
        "weight-transfer engine API into one group built once and rebuilt when a replica joins, leaves or fails; "
        "the weight stream as fallback; vllm replicas only, full fine-tuning). Needs weight_fanout 'direct'.",
    )
    collective_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="The torch.distributed backend of a collective push, chosen per push: 'auto' (NCCL when the "
        "trainer and the replica both run on CUDA, straight from the trainer's GPU into the replica's; else gloo "
        "through host memory), 'gloo', or 'nccl' (needs the trainer on CUDA; a replica off CUDA loads over ZeroMQ).",
    )

    # --- checkpoints and evaluation ---
    dcp_save_interval: int = Field(0, ge=0, description="Checkpoint every N batches; 0 = end only.")
    evaluation_interval: int = Field(0, ge=0, description="Evaluate every N steps; 0 = start/end.")
    eval_dataset: str | None = Field(
        None, description="Held-out rows for the evaluation hook (the same sources as dataset)."
    )

    # --- experiment trackers and sample logging (docs/trackers.md; wandb/tensorboard/mlflow need the `trackers` extra)
    loggers: list[str] = Field(
        default_factory=lambda: ["jsonl"],
        description="Where per-step metrics go: jsonl (always on), wandb, tensorboard, mlflow.",
    )
    wandb_project: str = Field("fleetrl", description="W&B project.")
    wandb_entity: str | None = Field(None, description="W&B entity (team or user); None = your default.")
    wandb_run_name: str | None = Field(None, description="W&B run name; None = the log folder's name.")
    wandb_tags: list[str] = Field(default_factory=list, description="W&B tags of the run.")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; None = a local file store in <log_path>/mlruns."
    )
    mlflow_experiment: str = Field("fleetrl", description="MLflow experiment name (created if missing).")
    log_samples_interval: int = Field(
        10, ge=0, description="Log a few decoded samples every N steps (samples.jsonl and trackers); 0 = off."
    )
    log_samples_count: int = Field(4, ge=1, description="Samples logged per logging step.")
    log_samples_token_ids: bool = Field(
        False,
        description="Each logged sample also carries its prompt and completion token ids as trained (samples.jsonl "
        "only), to audit what was trained without a side log.",
    )

    @field_validator("policy_loss", mode="before")
    @classmethod
    def _loss_name_or_path(cls, value: Any) -> Any:
        """A function becomes its import path (the trainer, another process, imports it by name); a string must be
        a built-in loss or read as an import path (it is imported and tried when the trainer starts)."""
        from fleetrl.losses.custom import check_loss_path, loss_import_path

        if callable(value) and not isinstance(value, str):
            return loss_import_path(value)
        if isinstance(value, str):
            check_loss_path(value)
        return value

    @field_validator("advantage_estimator")
    @classmethod
    def _estimator_name_or_path(cls, value: str) -> str:
        if value not in ADVANTAGE_ESTIMATORS and ":" not in value:
            raise ValueError(
                f"{value!r} is not one of {list(ADVANTAGE_ESTIMATORS)} nor an import path ('package.module:function' "
                "or 'path/to/file.py:function')"
            )
        return value

    @field_validator("loggers")
    @classmethod
    def _known_loggers(cls, value: list[str]) -> list[str]:
        from fleetrl.trackers.names import check_logger_names

        return check_logger_names(value)

    _cookbook_up: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _cookbook_objects(cls, data: Any, handler: Any) -> Any:
        """The cookbook's `deployment=DeployConfig(...)`, `trainer=`, `wandb=` and `output_model_id` mapped onto
        fleetrl's fields (`fleetrl.cookbook`); the [up] settings they imply are kept for `fleetrl.main`."""
        up: dict[str, Any] = {}
        if isinstance(data, dict):
            data, up = cookbook_tables(data)
        cfg = handler(data)
        if up and isinstance(cfg, Config):
            cfg._cookbook_up = up
        return cfg

    @property
    def cookbook_up_options(self) -> dict[str, Any]:
        """[up] settings given through the cookbook's objects (`DeployConfig.replica_count` -> `replicas`);
        `fleetrl.main` uses them unless its own keyword arguments set them."""
        return dict(self._cookbook_up)

    @model_validator(mode="before")
    @classmethod
    def _cookbook_spellings(cls, data: Any) -> Any:
        """The cookbook's names and "off" values: renamed fields work as aliases, the rest fail saying what to use."""
        return cookbook_spellings(data) if isinstance(data, dict) else data

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
    def _check_distillation(self) -> Config:
        """teacher_model and distill_weight agree with each other and with the run (see the fields)."""
        if self.teacher_model is not None:
            if not self.teacher_model.strip():
                raise ValueError("teacher_model: give the teacher's path or hub id (or leave it unset)")
            if self.lora:
                raise ValueError(
                    "teacher_model: on-policy distillation needs full fine-tuning for now; a LoRA run (lora_rank > 0) "
                    "takes its reference from its own base weights (adapter disabled), not from a teacher"
                )
            if self.distill_weight is None:
                object.__setattr__(self, "distill_weight", 1.0)  # pure distillation (no re-validation)
        elif self.distill_weight:
            raise ValueError(
                f"distill_weight ({self.distill_weight}) needs teacher_model: the teacher's logprobs are the signal"
            )
        elif self.distill_weight is None:
            object.__setattr__(self, "distill_weight", 0.0)
        return self

    @model_validator(mode="after")
    def _check_cross_fields(self) -> Config:
        g = self.completions_per_prompt
        if self.weight_transport in ("collective", "engine") and self.weight_fanout != "direct":
            raise ValueError(
                f"weight_transport {self.weight_transport!r} needs weight_fanout 'direct' (got "
                f"{self.weight_fanout!r}): the trainer sends to every replica itself, relays do not take part"
            )
        if self.weight_transport == "engine" and self.lora_rank > 0:
            raise ValueError(
                "weight_transport 'engine' needs full fine-tuning (lora_rank = 0): a LoRA adapter travels over the "
                "weight stream; set weight_transport 'zmq'"
            )
        if g < 2:
            raise ValueError(f"completions_per_prompt must be >= 2 for group advantages, got {g}")
        if self.max_head_offpolicy_versions < 0:
            raise ValueError(f"max_head_offpolicy_versions must be >= 0, got {self.max_head_offpolicy_versions}")
        if self.max_concurrency is not None and self.max_concurrency < g:
            raise ValueError(
                f"max_concurrency ({self.max_concurrency}) must be >= completions_per_prompt ({g}):"
                " a row of G samples could never be admitted"
            )
        if self.min_group_size > g:
            raise ValueError(f"min_group_size ({self.min_group_size}) must be <= completions_per_prompt ({g})")
        if isinstance(self.max_seq_len, int) and self.max_completion_tokens >= self.max_seq_len:
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
        self._check_lora()
        if self.datasets is not None:
            if self.dataset is not None:
                raise ValueError("dataset and datasets: name one dataset or a mixture of several, not both")
            check_sources(self.datasets)
        if self.lr_warmup_steps and self.max_steps and self.lr_warmup_steps > self.max_steps:
            raise ValueError(f"lr_warmup_steps ({self.lr_warmup_steps}) must be <= max_steps ({self.max_steps})")
        return self

    def _check_lora(self) -> None:
        """LoRA settings without lora_rank > 0 would be silently ignored: refuse them, naming the field."""
        if self.lora_rank > 0:
            if self.lora_target_modules != "all-linear" and not self.lora_target_modules:
                raise ValueError("lora_target_modules: name at least one module, or 'all-linear'")
            return
        lora_only = {
            "lora_alpha": self.lora_alpha is not None,
            "lora_dropout": self.lora_dropout != 0.0,
            "lora_target_modules": self.lora_target_modules != "all-linear",
            "warm_start_from_adapter": self.warm_start_from_adapter is not None,
            "export_merged": self.export_merged,
        }
        for name, is_set in lora_only.items():
            if is_set:
                raise ValueError(
                    f"{name} is a LoRA setting: it needs lora_rank > 0 (lora_rank = 0 is full fine-tuning)"
                )

    @property
    def lora(self) -> bool:
        """True for a LoRA run (lora_rank > 0): the trainer trains and publishes only the adapter."""
        return self.lora_rank > 0

    @property
    def lora_scale_alpha(self) -> float:
        """lora_alpha, or its default 2 * lora_rank."""
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank

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
        return cls.load(data, source=str(path), override_keys=overrides or ())

    @classmethod
    def load(cls, data: dict[str, Any], source: str = "config", override_keys: Iterable[str] = ()) -> Config:
        """Validate a dict; raise `ConfigError` with one line per bad field. A bad field among `override_keys`
        (the --set flags) is blamed on --set, not on `source`."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, source, cls, override_keys)) from None


def wants_reference_logprobs(cfg: Any) -> bool:
    """Whether the trainer needs reference logprobs: for the KL penalty (kl_beta > 0) or as the teacher's signal
    (teacher_model set: fetched even with kl_beta = 0). `cfg` is a Config or anything with its attribute names."""
    return getattr(cfg, "kl_beta", 0.0) > 0 or getattr(cfg, "teacher_model", None) is not None


def reference_model_path(cfg: Any) -> str:
    """The model the reference holds: the distillation teacher when teacher_model is set, else base_model."""
    teacher = getattr(cfg, "teacher_model", None)
    return teacher if teacher is not None else cfg.base_model


COOKBOOK_RENAMED: dict[str, str] = {
    "lr_scheduler": "lr_schedule",
    "ppo_n_minibatches": "num_minibatches",
    "max_concurrency_rollout_sample": "max_concurrency",
}
"""Cookbook field names accepted as aliases of fleetrl's (the value means the same)."""
COOKBOOK_REFUSED: dict[str, str] = {}
"""Cookbook fields whose meaning differs: refused with what to write instead."""


def cookbook_spellings(data: dict[str, Any]) -> dict[str, Any]:
    """Map the cookbook's spellings onto fleetrl's: renamed fields (COOKBOOK_RENAMED), `grad_clip_norm = 0.0` (off,
    as None); `ValueError` naming the field otherwise. The cookbook's `deployment` / `trainer` / `wandb` objects
    are `fleetrl.cookbook.cookbook_tables`'s business."""
    data = dict(data)
    for old, new in COOKBOOK_RENAMED.items():
        if old in data:
            if new in data:
                raise ValueError(f"{old} is the cookbook's name for {new}: set one of them, not both")
            data[new] = data.pop(old)
    for old, advice in COOKBOOK_REFUSED.items():
        if old in data:
            raise ValueError(f"{old}: not a fleetrl field; {advice}")
    if data.get("grad_clip_norm") == 0:
        data["grad_clip_norm"] = None  # the cookbook's "off"
    return data


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


def format_validation_error(
    exc: ValidationError,
    source: str,
    model: type[BaseModel] | None = None,
    override_keys: Iterable[str] = (),
    prefix: str = "",
) -> str:
    """One line per bad field under a `source: invalid config` header. An unknown field names the closest known
    one of `model` ("max_step: unknown field, did you mean max_steps?"); a field set by a --set flag
    (`override_keys`) is blamed on the flag, and when every bad field came from --set the header says so."""
    overrides = set(override_keys)
    errors = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(cross-field)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = unknown_field_message(str(err["loc"][-1]), list(model.model_fields) if model else [])
        where = f"{prefix}{where}" if err["loc"] else where
        errors.append((bool(err["loc"]) and str(err["loc"][0]) in overrides, f"{where}: {msg}"))
    if errors and all(from_flag for from_flag, _ in errors):
        return "\n".join(["--set: invalid config", *(f"  {line}" for _, line in errors)])
    lines = [f"  {'--set ' if from_flag else ''}{line}" for from_flag, line in errors]
    return "\n".join([f"{source}: invalid config", *lines])


def unknown_field_message(name: str, known: Iterable[str]) -> str:
    """'unknown field, did you mean <closest>?' (difflib), or 'unknown field' when nothing is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"unknown field, did you mean {close[0]}?" if close else "unknown field"


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


def check_warm_start_adapter(cfg: Config) -> dict[str, Any] | None:
    """The adapter config of `cfg.warm_start_from_adapter` (None when unset), checked against the run's LoRA
    settings; `ConfigError` naming the field when the folder is missing, is no PEFT LoRA adapter, or disagrees.

    Called where the adapter is read (the trainer), not by every service that parses the run config: the path
    need only exist on the trainer's machine."""
    if cfg.warm_start_from_adapter is None:
        return None
    folder = Path(cfg.warm_start_from_adapter).expanduser()
    name = "warm_start_from_adapter"
    if not folder.is_dir():
        raise ConfigError(f"{name}: no adapter folder at {folder}")
    config_file = folder / "adapter_config.json"
    try:
        saved = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{name}: {folder} has no adapter_config.json (not a PEFT adapter)") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name}: {config_file} is not valid JSON: {exc}") from None
    if not isinstance(saved, dict) or saved.get("peft_type") != "LORA":
        kind = saved.get("peft_type") if isinstance(saved, dict) else None
        raise ConfigError(f"{name}: {folder} is not a LoRA adapter (peft_type {kind!r})")
    if saved.get("r") != cfg.lora_rank:
        raise ConfigError(f"{name}: the adapter's rank is {saved.get('r')}, but lora_rank = {cfg.lora_rank}")
    if cfg.lora_alpha is not None and saved.get("lora_alpha") != cfg.lora_alpha:
        raise ConfigError(
            f"{name}: the adapter's lora_alpha is {saved.get('lora_alpha')}, but lora_alpha = {cfg.lora_alpha} "
            "(leave lora_alpha unset to take the adapter's)"
        )
    # "all-linear" is resolved to module names when an adapter is made, so only a list can be compared.
    if "lora_target_modules" in cfg.model_fields_set and isinstance(cfg.lora_target_modules, list):
        theirs = saved.get("target_modules")
        theirs = sorted(theirs) if isinstance(theirs, list) else theirs
        ours = sorted(cfg.lora_target_modules)
        if theirs != ours:
            raise ConfigError(
                f"{name}: the adapter targets {theirs}, but lora_target_modules = {ours} "
                "(leave lora_target_modules unset to take the adapter's)"
            )
    return saved
