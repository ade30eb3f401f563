"""Training datums: the one-position shift from a `RolloutSample` to model inputs and targets.

For a sample of N tokens the model reads `tokens[:-1]` and predicts `tokens[1:]`, so every per-token
quantity the trainer uses is target-aligned and has N-1 entries: `weights = loss_mask[1:]`,
`rollout_logprobs = logprobs[1:]`. `collate` pads datums into `[B, T]` tensors (right padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fleetrl.rollout import RolloutSample


@dataclass(frozen=True)
class Datum:
    """One sample after the shift; every list has N-1 entries."""

    input_tokens: list[int]
    target_tokens: list[int]
    weights: list[int]
    rollout_logprobs: list[float]
    versions: list[int] | None = None

    def __len__(self) -> int:
        return len(self.input_tokens)


def build_datum(sample: RolloutSample) -> Datum:
    """Shift a sample by one position: inputs `tokens[:-1]`, targets and weights from position 1."""
    return shift_datum(sample.tokens, sample.logprobs, sample.loss_mask, sample.versions)


def shift_tokens(tokens: Sequence[int]) -> tuple[list[int], list[int]]:
    """The one-token shift: position t's input is token t and its target token t + 1 (`tokens[:-1]`,
    `tokens[1:]`). Every datum, and every sequence the reference scores, is shifted here."""
    return list(tokens[:-1]), list(tokens[1:])


def shift_datum(
    tokens: Sequence[int],
    logprobs: Sequence[float],
    loss_mask: Sequence[int],
    versions: Sequence[int] | None = None,
) -> Datum:
    """The shift, on a sample's per-token lists (what each trainer rank receives for its own samples): the one
    implementation `build_datum` uses too."""
    inputs, targets = shift_tokens(tokens)
    return Datum(
        input_tokens=inputs,
        target_tokens=targets,
        weights=[int(m) for m in loss_mask[1:]],
        rollout_logprobs=[float(x) for x in logprobs[1:]],
        versions=None if versions is None else list(versions[1:]),
    )


@dataclass
class Batch:
    """Padded tensors for B datums; T is the longest datum. Padding has weight 0."""

    input_tokens_BT: torch.Tensor  # long
    target_tokens_BT: torch.Tensor  # long
    mask_BT: torch.Tensor  # float, 1 on trainable targets
    rollout_logprobs_BT: torch.Tensor  # float
    attention_mask_BT: torch.Tensor  # long, 1 on real positions
    lengths_B: torch.Tensor  # long, N-1 per datum
    versions_BT: torch.Tensor | None = None
    """long: the policy version that sampled each target token, -1 where unknown (a datum without versions,
    padding); None when no datum of the batch has versions."""

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_tokens_BT.shape)  # type: ignore[return-value]


def collate(datums: Sequence[Datum], pad_token_id: int = 0, pad_to: int | None = None) -> Batch:
    """Right-pad datums into `[B, T]` tensors (T = longest datum, or `pad_to` if larger)."""
    if not datums:
        raise ValueError("collate: no datums to batch")
    longest = max(len(d) for d in datums)
    width = max(longest, pad_to or 0)
    n = len(datums)
    lengths = [len(d) for d in datums]
    for name in ("target_tokens", "weights", "rollout_logprobs"):
        for i, d in enumerate(datums):
            if len(getattr(d, name)) != lengths[i]:
                got = len(getattr(d, name))
                raise ValueError(f"collate: datum {i} has {got} {name} for {lengths[i]} input tokens")
    # One tensor per field, from rows padded as lists (a tensor per datum and field before).
    inputs = _padded([d.input_tokens for d in datums], width, pad_token_id, torch.long)
    targets = _padded([d.target_tokens for d in datums], width, pad_token_id, torch.long)
    mask = _padded([d.weights for d in datums], width, 0, torch.float32)
    rollout = _padded([d.rollout_logprobs for d in datums], width, 0.0, torch.float32)
    attention = _padded([[1] * k for k in lengths], width, 0, torch.long)
    lengths_t = torch.tensor(lengths, dtype=torch.long)
    versions: torch.Tensor | None = None
    if any(d.versions is not None for d in datums):
        versions = torch.full((n, width), -1, dtype=torch.long)
        for i, d in enumerate(datums):
            if d.versions is not None:
                versions[i, : len(d.versions)] = torch.tensor(d.versions, dtype=torch.long)
    return Batch(inputs, targets, mask, rollout, attention, lengths_t, versions)


def _padded(rows: Sequence[Sequence[float]], width: int, fill: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([[*row, *([fill] * (width - len(row)))] for row in rows], dtype=dtype)


def samples_to_batch(samples: Sequence[RolloutSample], pad_token_id: int = 0, pad_to: int | None = None) -> Batch:
    """Shift and pad a list of samples in one call."""
    return collate([build_datum(s) for s in samples], pad_token_id=pad_token_id, pad_to=pad_to)


def gather_target_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Log-softmax of `logits` at the target ids: the trainer's target-aligned logprobs `[B, T]`."""
    logprobs_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
    return logprobs_BTV.gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)
