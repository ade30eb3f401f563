"""Sample trajectories for the run's record: every `log_samples_interval` steps, a few decoded samples of the step
(prompt, completion, reward, version offset, row) go to `<log_path>/samples.jsonl` and to the trackers. With
`log_samples_token_ids` each also carries the token ids that were trained (`prompt_token_ids`,
`completion_token_ids`: the sample's tokens split where the first trained token starts), so what was trained can be
audited against what the replicas generated without a side log; those go to samples.jsonl, not the trackers' tables.

The trainer holds the tokens and the tokenizer, so it picks and decodes them (`logged_samples`) and returns them
with the step's result; the controller writes them. Pure logic: no sockets, no tokenizer of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from fleetrl.rollout import RolloutSample

SAMPLE_COLUMNS: tuple[str, ...] = (
    "step",
    "row_id",
    "prompt",
    "completion",
    "reward",
    "version_offset",
    "finish_reason",
)
"""The fields of one logged sample, in the order tables show them."""

TOKEN_ID_COLUMNS: tuple[str, ...] = ("prompt_token_ids", "completion_token_ids")
"""The token ids a logged sample carries with `log_samples_token_ids` (samples.jsonl only)."""


@dataclass(frozen=True)
class LoggedSample:
    """One decoded sample of a step, as it is logged."""

    step: int
    row_id: int
    prompt: str
    completion: str
    reward: float
    version_offset: int
    finish_reason: str = ""
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None

    def as_row(self) -> dict[str, Any]:
        """A JSON-ready dict with the keys of SAMPLE_COLUMNS, and of TOKEN_ID_COLUMNS when it carries them."""
        row = asdict(self)
        for key in TOKEN_ID_COLUMNS:
            if row[key] is None:
                del row[key]
        return row


def samples_due(step: int, interval: int) -> bool:
    """Whether step `step` logs samples (`log_samples_interval`; 0 = never)."""
    return interval > 0 and step > 0 and step % interval == 0


def choose_samples(row_ids: Sequence[int], count: int) -> list[int]:
    """Indices of up to `count` samples, taken from the rows in turn (the first sample of each row, then the
    second, ...), so a few samples show as many prompts as they can. Deterministic: the same batch logs the same
    samples."""
    by_row: dict[int, list[int]] = {}
    for i, row in enumerate(row_ids):
        by_row.setdefault(row, []).append(i)
    chosen: list[int] = []
    rank = 0
    while len(chosen) < count and any(rank < len(ix) for ix in by_row.values()):
        chosen += [ix[rank] for ix in by_row.values() if rank < len(ix)][: count - len(chosen)]
        rank += 1
    return chosen


def split_prompt(tokens: Sequence[int], loss_mask: Sequence[int]) -> tuple[list[int], list[int]]:
    """(prompt, completion): the tokens before the first policy-generated one, and the rest (a multi-turn
    completion keeps its tool and user turns)."""
    first = next((i for i, m in enumerate(loss_mask) if m), len(tokens))
    return list(tokens[:first]), list(tokens[first:])


def logged_samples(
    step: int,
    samples: Sequence[RolloutSample],
    row_ids: Sequence[int],
    version_offsets: Sequence[int],
    count: int,
    decode: Callable[[list[int]], str] | None,
    *,
    token_ids: bool = False,
) -> list[LoggedSample]:
    """Up to `count` samples of a step's batch, decoded with `decode` (a tokenizer's decode). Without a tokenizer
    the prompt is left empty and the completion is the sample's own `text`. `token_ids`: each also carries its
    prompt and completion token ids (`log_samples_token_ids`)."""
    out = []
    for i in choose_samples(row_ids, count):
        sample = samples[i]
        prompt_tokens, completion_tokens = split_prompt(sample.tokens, sample.loss_mask)
        if decode is None:
            prompt, completion = "", sample.text
        else:
            prompt, completion = decode(prompt_tokens), decode(completion_tokens)
        out.append(
            LoggedSample(
                step=step,
                row_id=int(row_ids[i]),
                prompt=prompt,
                completion=completion,
                reward=float(sample.reward),
                version_offset=int(version_offsets[i]),
                finish_reason=sample.finish_reason,
                prompt_token_ids=[int(t) for t in prompt_tokens] if token_ids else None,
                completion_token_ids=[int(t) for t in completion_tokens] if token_ids else None,
            )
        )
    return out
