"""How a step's batch is split, and what the parts normalise by: the PPO inner loop's minibatch arithmetic.

The step's B samples (indices 0..B-1 of its batch, fleetrl.trainer.step_batch) are split into `num_minibatches`
minibatches (one optimizer step each), each minibatch across the data-parallel ranks (balanced by tokens), and each
rank's share into micro-batches by a token budget (gradient accumulation). `rank_samples` names the samples one
rank trains over the whole step (the samples rank 0 sends it); `SampleFigures` holds what every rank knows of
every sample (its length and trainable tokens), enough for the minibatch-wide figures (`Totals`, the padded width)
without the samples themselves.

Splitting must not change the loss: `part_loss_scale` gives the factor that makes the sum of the
parts' aggregated losses equal the loss of the whole minibatch for every `loss_agg_mode`.

Pure logic: no sockets, no process groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def split_even(n: int, parts: int) -> list[range]:
    """Split range(n) into `parts` contiguous ranges whose sizes differ by at most one."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def balance_by_tokens(samples: Sequence[int], lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Each rank's share of `samples`, balanced by tokens (`lengths[sample]`): longest first, each to the rank with the
    fewest tokens so far (ties to the lowest rank), each share then in index order. Deterministic, so rank 0 (which
    sends each rank its samples) and every rank (which trains them) compute the same shares. RL completions are
    long-tailed: balancing by sample count leaves one rank with the long ones and the others waiting for it."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    shares: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for sample in sorted(samples, key=lambda s: (-lengths[s], s)):
        rank = min(range(world_size), key=lambda k: (load[k], k))
        shares[rank].append(sample)
        load[rank] += lengths[sample]
    return [sorted(share) for share in shares]


def rank_samples(lengths: Sequence[int], num_minibatches: int, world_size: int, rank: int) -> list[int]:
    """The samples of a step (`lengths[sample]` tokens each) that `rank` trains, in order: its share
    (`balance_by_tokens`) of each of the `num_minibatches` minibatches (`split_even` of the samples, empty ones
    dropped), as the inner loop splits."""
    out: list[int] = []
    for minibatch in split_even(len(lengths), num_minibatches):
        out.extend(balance_by_tokens(list(minibatch), lengths, world_size)[rank])
    return out


def token_micro_batches(
    samples: Sequence[int], lengths: Sequence[int], max_tokens: int | None, max_samples: int | None = None
) -> list[list[int]]:
    """Consecutive micro-batches of `samples` holding at most `max_tokens` tokens and `max_samples` samples (None:
    no cap); a sample longer than `max_tokens` goes alone."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {max_tokens}")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {max_samples}")
    out: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for sample in samples:
        full_tokens = max_tokens is not None and tokens + lengths[sample] > max_tokens
        full_samples = max_samples is not None and len(current) >= max_samples
        if current and (full_tokens or full_samples):
            out.append(current)
            current, tokens = [], 0
        current.append(sample)
        tokens += lengths[sample]
    if current:
        out.append(current)
    return out


def chunk(indices: Sequence[int], size: int | None) -> list[list[int]]:
    """Consecutive chunks of at most `size` (None: one chunk)."""
    items = list(indices)
    if size is None or size >= len(items):
        return [items] if items else []
    if size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {size}")
    return [items[i : i + size] for i in range(0, len(items), size)]


@dataclass(frozen=True)
class Totals:
    """What a whole minibatch normalises by: its trainable tokens and its sequences that have any."""

    tokens: float
    sequences: float

    @classmethod
    def of(cls, masks: Sequence[Sequence[int]]) -> Totals:
        return cls.of_counts([sum(m) for m in masks])

    @classmethod
    def of_counts(cls, counts: Sequence[int]) -> Totals:
        """From each sequence's trainable token count."""
        return cls(float(sum(counts)), float(sum(1 for c in counts if c > 0)))


@dataclass(frozen=True)
class SampleFigures:
    """Every sample of a step as every rank knows it, whether or not it holds the sample: its datum's length
    (tokens - 1) and trainable tokens (the sum of its weights). Enough for a minibatch's `Totals` and padded
    width."""

    lengths: Sequence[int]
    trainable: Sequence[int]

    @classmethod
    def of(cls, datums: Sequence[Any]) -> SampleFigures:
        """From datums (anything with `len()` and `weights`) of every sample."""
        return cls([len(d) for d in datums], [sum(d.weights) for d in datums])

    def __len__(self) -> int:
        return len(self.lengths)

    def totals(self, samples: Sequence[int]) -> Totals:
        return Totals.of_counts([self.trainable[i] for i in samples])

    def width(self, samples: Sequence[int]) -> int:
        """The longest datum of `samples`: the minibatch's padded length as if it ran in one piece."""
        return max(self.lengths[i] for i in samples)


def part_loss_scale(mode: str, part_mask_BT: torch.Tensor, totals: Totals) -> float:
    """Factor turning a part's aggregated loss into its share of the whole minibatch's loss.

    token-mean: the part's masked tokens / all masked tokens. seq-mean-*: the part's sequences with
    masked tokens / all such sequences (seq-mean-token-sum-norm also needs the same constant K in
    every part; the trainer passes the minibatch's padded length explicitly). sum: 1.
    """
    if mode == "sum":
        return 1.0
    if mode == "token-mean":
        return float(part_mask_BT.sum()) / totals.tokens if totals.tokens else 0.0
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        sequences = float((part_mask_BT.sum(dim=-1) > 0).sum())
        return sequences / totals.sequences if totals.sequences else 0.0
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


def part_loss_scale_of_counts(mode: str, part_counts: Sequence[int], totals: Totals) -> float:
    """`part_loss_scale` from the part's trainable-token count per sequence (`SampleFigures.trainable`) instead of
    its mask: the same factor, read on the host, so the trainer needs no device sync for it."""
    if mode == "sum":
        return 1.0
    if mode == "token-mean":
        return float(sum(part_counts)) / totals.tokens if totals.tokens else 0.0
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        sequences = float(sum(1 for c in part_counts if c > 0))
        return sequences / totals.sequences if totals.sequences else 0.0
    raise ValueError(f"unknown loss_agg_mode {mode!r}")
