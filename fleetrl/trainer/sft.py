"""Supervised fine-tuning on the RL trainer: `fleetrl sft CONFIG` (fleetrl.commands.sft) trains a model on rows of
prompt/completion pairs or chat messages, loss on the completion tokens only.

    fleetrl sft examples/arithmetic/sft.toml            # [run]: the trainer's settings; [sft]: this module's

A row is `{"prompt": str, "completion": str}` (the tokens of prompt then completion, then end-of-text; the loss on
the completion and end-of-text) or `{"messages": [{"role": ..., "content": ...}, ...]}` (rendered by the tokenizer's
chat template; the loss on every assistant message's tokens as the template renders them after the conversation so
far). A row that cannot train is dropped and counted by reason, never truncated (`DROP_REASONS`): not an object of
either form ("malformed"), an empty completion or assistant message ("empty_completion"), a chat template that
cannot render it, or renders a conversation so that an earlier turn is not a prefix of the next ("template"), or
more tokens than `max_seq_len` ("too_long").

Training is `PolicyTrainer`'s, unchanged (packing, mixed precision, FSDP2, LoRA, checkpoints, HF export): each row
becomes a one-sample group whose loss_mask covers its completion, trained with the `reinforce` loss (`-A * logprob`
per token) at advantage 1 under `loss_agg_mode` token-mean, which is the mean negative log-likelihood of the
completion tokens (`completion_nll` computes it on its own, for tests). The trainer's advantage estimator is
`unit_advantages` (1 for every sample, a group of one included) and `kl_beta` is 0. Pure row logic up to `run_sft`,
which drives the trainer.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fleetrl.rollout import RolloutSample
from fleetrl.rollout_group import RolloutGroup

logger = logging.getLogger(__name__)

DROP_REASONS: tuple[str, ...] = ("malformed", "empty_completion", "template", "too_long")
"""Why a row is dropped (counted as `sft/rows_dropped/<reason>`)."""
UNIT_ADVANTAGES = "fleetrl.trainer.sft:unit_advantages"


class SFTSettings(BaseModel):
    """The `[sft]` table of a `fleetrl sft` config (the trainer's own settings are the `[run]` table)."""

    model_config = ConfigDict(extra="forbid")

    dataset: str = Field(description="JSONL rows: {prompt, completion} or {messages}; relative to the working folder.")
    batch_size: int = Field(64, ge=1, description="Rows per optimizer step.")
    checkpoint_interval: int = Field(0, ge=0, description="Save a checkpoint every N steps; 0 = only at the end.")
    log_interval: int = Field(20, ge=1, description="Print the mean loss every N steps.")


class RowDropped(ValueError):
    """A row that cannot train; `reason` is one of DROP_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class SFTExample:
    """One row as tokens with 1 on the tokens the loss covers."""

    tokens: list[int]
    loss_mask: list[int]

    def to_sample(self) -> RolloutSample:
        """The trainer's sample: logprobs 0 (unused by the `reinforce` loss), reward 0 (advantages are 1)."""
        return RolloutSample(
            tokens=list(self.tokens), logprobs=[0.0] * len(self.tokens), loss_mask=list(self.loss_mask), reward=0.0
        )


def _chat_ids(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # newer transformers may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _render_messages(tokenizer: Any, messages: Any) -> SFTExample:
    if not isinstance(messages, list) or not messages:
        raise RowDropped("malformed", "messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RowDropped("malformed", f"messages[{i}] must be an object with string role and content")
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant:
        raise RowDropped("empty_completion", "no assistant message to train on")
    empty = next((i for i in assistant if not messages[i]["content"].strip()), None)
    if empty is not None:
        raise RowDropped("empty_completion", f"messages[{empty}] (assistant) is empty")
    try:
        full = _chat_ids(tokenizer, messages, generation_prompt=False)
        mask = [0] * len(full)
        for i in assistant:
            before = _chat_ids(tokenizer, messages[:i], generation_prompt=True) if i else []
            through = _chat_ids(tokenizer, messages[: i + 1], generation_prompt=False)
            if through[: len(before)] != before or full[: len(through)] != through:
                raise RowDropped(
                    "template",
                    f"the chat template renders messages[{i}] so that the conversation before it is not a prefix "
                    "(it rewrites earlier turns): its tokens cannot be told apart",
                )
            for t in range(len(before), len(through)):
                mask[t] = 1
    except RowDropped:
        raise
    except Exception as exc:  # a template is user code (Jinja): whatever it raises drops the row
        raise RowDropped("template", f"the chat template cannot render it ({type(exc).__name__}: {exc})") from None
    return SFTExample(full, mask)


def render_row(row: Any, tokenizer: Any, max_seq_len: int | None = None) -> SFTExample:
    """The row as tokens and loss mask (see the module docstring); `RowDropped` naming why it cannot train."""
    if not isinstance(row, dict):
        raise RowDropped("malformed", f"expected an object, got {type(row).__name__}")
    if "messages" in row:
        example = _render_messages(tokenizer, row["messages"])
    elif "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise RowDropped("malformed", "prompt and completion must be strings")
        if not completion.strip():
            raise RowDropped("empty_completion", "the completion is empty")
        prompt_ids = [int(t) for t in tokenizer.encode(prompt)]
        completion_ids = [int(t) for t in tokenizer.encode(completion, add_special_tokens=False)]
        eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(eos, int) and (not completion_ids or completion_ids[-1] != eos):
            completion_ids.append(eos)
        example = SFTExample(prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids))
    else:
        raise RowDropped("malformed", f"needs 'messages' or 'prompt' and 'completion'; has {sorted(row)}")
    if max_seq_len is not None and len(example.tokens) > max_seq_len:
        raise RowDropped("too_long", f"{len(example.tokens)} tokens > max_seq_len {max_seq_len}")
    if not any(example.loss_mask[1:]):
        raise RowDropped("empty_completion", "no completion token after the first position")
    return example


def load_examples(
    path: str | Path, tokenizer: Any, max_seq_len: int | None = None
) -> tuple[list[SFTExample], Counter[str]]:
    """The trainable examples of a JSONL file and the dropped rows counted by reason (each drop logged with its
    line). A missing file raises FileNotFoundError naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"sft.dataset: no such file: {path}")
    examples: list[SFTExample] = []
    dropped: Counter[str] = Counter()
    seen: dict[str, SFTExample | RowDropped] = {}  # a repeated row is rendered once (SFTExample is immutable)
    with path.open() as handle:
        for lineno, line in enumerate(handle, 1):
            key = line.strip()
            if not key:
                continue
            try:
                if key not in seen:
                    try:
                        seen[key] = render_row(_parse_line(key), tokenizer, max_seq_len)
                    except RowDropped as exc:
                        seen[key] = exc
                known = seen[key]
                if isinstance(known, RowDropped):
                    raise known
                examples.append(known)
            except RowDropped as exc:
                dropped[exc.reason] += 1
                if sum(dropped.values()) <= 20:  # the first few by line; the counts say the rest
                    logger.warning("%s:%d: row dropped (%s): %s", path, lineno, exc.reason, exc)
    return examples, dropped


def _parse_line(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise RowDropped("malformed", f"not valid JSON: {exc}") from None


def unit_advantages(rewards_GM: list[list[float]]) -> list[list[float] | None]:
    """The SFT run's advantage estimator: 1 for every sample, a group of one included (no baseline in SFT)."""
    return [[1.0] * len(group) for group in rewards_GM]


def completion_nll(logprobs_BT: Any, mask_BT: Any) -> Any:
    """The SFT loss: the mean negative log-likelihood over the masked (completion) tokens of the batch."""
    mask = mask_BT.to(logprobs_BT.dtype)
    return -(logprobs_BT * mask).sum() / mask.sum().clamp(min=1)


def batches(n_examples: int, batch_size: int, seed: int, shuffle: bool = True) -> Iterator[list[int]]:
    """Example indices, `batch_size` at a time, forever: each epoch a fresh permutation (seeded) of every example;
    a batch may span two epochs."""
    rng = random.Random(seed)
    pending: list[int] = []
    while True:
        order = list(range(n_examples))
        if shuffle:
            rng.shuffle(order)
        pending.extend(order)
        while len(pending) >= batch_size:
            yield pending[:batch_size]
            pending = pending[batch_size:]


def trainer_config(cfg: Any) -> Any:
    """The run config the trainer gets: the user's, with the loss, estimator and KL that make a step SFT."""
    return cfg.model_copy(
        update={
            "policy_loss": "reinforce",
            "loss_agg_mode": "token-mean",
            "advantage_estimator": UNIT_ADVANTAGES,
            "kl_beta": 0.0,
            "teacher_model": None,
            "distill_weight": None,
            "num_minibatches": 1,
            "max_head_offpolicy_versions": 0,
        }
    )


@dataclass
class SFTResult:
    steps: int
    examples: int
    dropped: dict[str, int]
    losses: list[float] = field(default_factory=list)
    checkpoint: str | None = None
    export: str | None = None
    seconds: float = 0.0


def run_sft(
    cfg: Any, settings: SFTSettings, *, device: str = "cpu", trackers: Any = None, resume: bool = False
) -> SFTResult:
    """Train `cfg.max_steps` steps of `settings.batch_size` rows of `settings.dataset` with PolicyTrainer, then save
    a checkpoint and the HF export (cfg.output_dir, default log_path/final). `trackers`: a TrackerSet the step
    metrics go to (fleetrl.trackers), or None. `resume`: continue from the latest checkpoint under
    log_path/checkpoints (its step and the rows it had consumed), if any. Under torchrun (WORLD_SIZE > 1) the ranks
    shard the model with FSDP2 (gloo on CPU, nccl on CUDA): rank 0 drives the steps, the others follow it."""
    from fleetrl.seq_len import resolve_max_seq_len
    from fleetrl.trainer.distributed import DistContext, destroy
    from fleetrl.trainer.model import load_tokenizer
    from fleetrl.trainer.policy_trainer import PolicyTrainer

    started = time.monotonic()
    if cfg.max_steps is None:
        raise ValueError("max_steps: fleetrl sft needs the run length ([run] max_steps)")
    tokenizer = load_tokenizer(cfg.tokenizer_model or cfg.base_model)
    examples, dropped = load_examples(settings.dataset, tokenizer, resolve_max_seq_len(cfg))
    summary = ", ".join(f"{dropped[r]} {r}" for r in DROP_REASONS if dropped[r]) or "none"
    logger.info("sft: %d rows to train on, dropped: %s", len(examples), summary)
    if not examples:
        raise ValueError(f"sft.dataset: no trainable row in {settings.dataset} (dropped: {summary})")
    ctx = DistContext.from_env(device=device)
    trainer = PolicyTrainer(
        trainer_config(cfg), device=device, dist_ctx=ctx, total_steps=cfg.max_steps, refuse_stale=False
    )
    result = SFTResult(0, len(examples), {r: dropped[r] for r in DROP_REASONS})
    if not ctx.is_main:
        try:
            trainer.follow()
        finally:
            trainer.close()
            destroy(ctx)
        return result
    order = batches(len(examples), settings.batch_size, cfg.seed, cfg.shuffle)
    next_row, first_step = 0, 1
    if resume and trainer.resume():
        position = trainer.state.data_position
        next_row = int(position.get("sft_rows", 0)) if isinstance(position, dict) else 0
        for _ in range(next_row // settings.batch_size):  # the batches already trained, drawn again and skipped
            next(order)
        first_step = trainer.steps_done + 1
        logger.info("sft: resumed at step %d, %d rows consumed", trainer.steps_done, next_row)
    try:
        for step in range(first_step, cfg.max_steps + 1):
            groups = []
            for index in next(order):
                groups.append(RolloutGroup(next_row, trainer.version, [examples[index].to_sample()]))
                next_row += 1
            out = trainer.train_step(groups, step=step)
            loss = float(out.metrics.get("train/loss", float("nan")))
            result.losses.append(loss)
            result.steps = step
            if trackers is not None:
                metrics = {**out.metrics, **{f"sft/rows_dropped/{r}": float(n) for r, n in result.dropped.items()}}
                trackers.log_metrics(step, metrics)
            if step % settings.log_interval == 0 or step == cfg.max_steps:
                recent = result.losses[-settings.log_interval :]
                logger.info("sft: step %d/%d, loss %.4f", step, cfg.max_steps, sum(recent) / len(recent))
            if settings.checkpoint_interval and step % settings.checkpoint_interval == 0 and step < cfg.max_steps:
                trainer.save_checkpoint({"sft_rows": next_row})
        checkpoint, export = trainer.finish({"sft_rows": next_row})
        result.checkpoint, result.export = str(checkpoint), str(export)
    finally:
        trainer.stop_followers()
        trainer.close()
        destroy(ctx)
    result.seconds = time.monotonic() - started
    return result


def examples_of(rows: Sequence[Any], tokenizer: Any, max_seq_len: int | None = None) -> list[SFTExample]:
    """`render_row` over in-memory rows, raising on the first bad one (for tests and scripts with clean rows)."""
    return [render_row(row, tokenizer, max_seq_len) for row in rows]
