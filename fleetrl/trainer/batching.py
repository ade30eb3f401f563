"""From rollout groups to optimizer batches: advantages, step statistics, and how a batch is split.

A step is P groups. Each group's rewards become advantages (fleetrl.advantages), one per group member: the samples
of a trajectory split into several (`RolloutSample.member`) share their member's advantage; a group with fewer than
two valid members carries no relative signal and is skipped. The step's B samples are split into
`num_minibatches` minibatches (one optimizer step each, the PPO inner loop), each minibatch across the
data-parallel ranks (balanced by tokens), and each rank's share into micro-batches by a token budget (gradient
accumulation). `rank_rows` names the rows one
rank trains over the whole step (the rows rank 0 sends it); `RowFigures` holds what every rank knows of every row
(its length and trainable tokens), enough for the minibatch-wide figures (`Totals`, the padded width) without the
rows themselves.

Splitting must not change the loss: `part_loss_scale` gives the factor that makes the sum of the
parts' aggregated losses equal the loss of the whole minibatch for every `loss_agg_mode`.

Pure logic: no sockets, no process groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fleetrl.advantages import member_advantages
from fleetrl.rollout import RolloutSample
from fleetrl.rollout_group import RolloutGroup
from fleetrl.step_metrics import sample_metrics


@dataclass
class StepBatch:
    """The samples of one step with their advantages, and what was left out."""

    samples: list[RolloutSample]
    advantages: list[float]
    row_ids: list[int]  # rows whose samples are in `samples`
    skipped_row_ids: list[int] = field(default_factory=list)  # fewer than 2 valid samples
    stats: dict[str, float] = field(default_factory=dict)
    sample_row_ids: list[int] = field(default_factory=list)  # the row of each of `samples`
    sample_offsets: list[int] = field(default_factory=list)  # the version offset of each of `samples`

    @property
    def num_samples(self) -> int:
        return len(self.samples)


def build_step_batch(
    groups: Sequence[RolloutGroup],
    *,
    advantage_mode: str = "standardize",
    train_version: int = 0,
    max_offpolicy: int | None = None,
    vocab_size: int | None = None,
) -> StepBatch:
    """Advantages per group and the step's data statistics.

    train_version: the policy version this step trains against (the version offset of a sample is
    train_version minus the oldest version that generated one of its trainable tokens).
    max_offpolicy: when set (stale_policy "requeue"), a sample more than this many versions behind is refused
    and counted (`train/samples_refused_stale`) before advantages are computed. The controller already keeps
    stale groups out; this is defence in depth, so the bound holds for every trained sample whatever a
    sender claims.
    vocab_size: the model's embedding rows; a sample with a token id at or above it is refused and counted
    (`train/samples_refused_vocab`) instead of failing the step in the embedding lookup.
    """
    samples: list[RolloutSample] = []
    advantages: list[float] = []
    row_ids: list[int] = []
    sample_row_ids: list[int] = []
    sample_offsets: list[int] = []
    skipped: list[int] = []
    refused = {"stale": 0, "vocab": 0}
    kept_groups: list[RolloutGroup] = []
    for group in groups:
        kept = group.samples
        if vocab_size is not None:
            kept = [s for s in kept if max(s.tokens) < vocab_size]
            refused["vocab"] += len(group.samples) - len(kept)
        if max_offpolicy is not None:
            fresh = [s for s in kept if _sample_offset(s, group.submit_version, train_version) <= max_offpolicy]
            refused["stale"] += len(kept) - len(fresh)
            kept = fresh
        if len(kept) != len(group.samples):
            group = replace(group, samples=kept)
        kept_groups.append(group)
        members = [s.member for s in group.samples]
        group_adv = member_advantages(group.rewards, members, mode=advantage_mode)  # type: ignore[arg-type]
        if group_adv is None:
            skipped.append(group.row_id)
            continue
        samples.extend(group.samples)
        advantages.extend(group_adv)
        row_ids.append(group.row_id)
        sample_row_ids.extend([group.row_id] * len(group.samples))
        sample_offsets.extend(_sample_offset(s, group.submit_version, train_version) for s in group.samples)
    batch = StepBatch(
        samples, advantages, row_ids, skipped, sample_row_ids=sample_row_ids, sample_offsets=sample_offsets
    )
    batch.stats = step_stats(kept_groups, batch, train_version)
    if max_offpolicy is not None:
        batch.stats["train/samples_refused_stale"] = float(refused["stale"])
    if vocab_size is not None:
        batch.stats["train/samples_refused_vocab"] = float(refused["vocab"])
    return batch


def _sample_offset(sample: RolloutSample, submit_version: int, train_version: int) -> int:
    if sample.versions is None:
        return train_version - submit_version
    versions = [v for v, m in zip(sample.versions, sample.loss_mask, strict=True) if m]
    return train_version - (min(versions) if versions else submit_version)


def step_stats(groups: Sequence[RolloutGroup], batch: StepBatch, train_version: int) -> dict[str, float]:
    """rollout/* (rewards, response lengths), env/all/<metric>, async/version_offset_mean|max|min
    (fleetrl.step_metrics), and batch sizes."""
    kept = set(batch.row_ids)
    samples: list[RolloutSample] = []
    offsets: list[int] = []
    for group in groups:
        if group.row_id not in kept:
            continue
        for s in group.samples:
            samples.append(s)
            offsets.append(_sample_offset(s, group.submit_version, train_version))
    stats: dict[str, float] = {
        "data/groups": float(len(batch.row_ids)),
        "data/groups_skipped": float(len(batch.skipped_row_ids)),
        "data/samples": float(len(batch.samples)),
        "data/tokens": float(sum(len(s.tokens) for s in batch.samples)),
        "data/trainable_tokens": float(sum(sum(s.loss_mask[1:]) for s in batch.samples)),
    }
    stats.update(sample_metrics(samples, offsets))
    return stats


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


def balance_by_tokens(rows: Sequence[int], lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Each rank's share of `rows`, balanced by tokens (`lengths[row]`): longest first, each to the rank with the
    fewest tokens so far (ties to the lowest rank), each share then in row order. Deterministic, so rank 0 (which
    sends each rank its rows) and every rank (which trains them) compute the same shares. RL completions are
    long-tailed: balancing by sample count leaves one rank with the long ones and the others waiting for it."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    shares: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for row in sorted(rows, key=lambda r: (-lengths[r], r)):
        rank = min(range(world_size), key=lambda k: (load[k], k))
        shares[rank].append(row)
        load[rank] += lengths[row]
    return [sorted(share) for share in shares]


def rank_rows(lengths: Sequence[int], num_minibatches: int, world_size: int, rank: int) -> list[int]:
    """The rows of a step (`lengths[row]` tokens each) that `rank` trains, in order: its share
    (`balance_by_tokens`) of each of the `num_minibatches` minibatches (`split_even` of the rows, empty ones
    dropped), as the inner loop splits."""
    out: list[int] = []
    for minibatch in split_even(len(lengths), num_minibatches):
        out.extend(balance_by_tokens(list(minibatch), lengths, world_size)[rank])
    return out


def token_micro_batches(
    rows: Sequence[int], lengths: Sequence[int], max_tokens: int | None, max_samples: int | None = None
) -> list[list[int]]:
    """Consecutive micro-batches of `rows` holding at most `max_tokens` tokens and `max_samples` samples (None: no
    cap); a row longer than `max_tokens` goes alone."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {max_tokens}")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {max_samples}")
    out: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for row in rows:
        full_tokens = max_tokens is not None and tokens + lengths[row] > max_tokens
        full_samples = max_samples is not None and len(current) >= max_samples
        if current and (full_tokens or full_samples):
            out.append(current)
            current, tokens = [], 0
        current.append(row)
        tokens += lengths[row]
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
class RowFigures:
    """Every row of a step as every rank knows it, whether or not it holds the row: its datum's length (tokens - 1)
    and trainable tokens (the sum of its weights). Enough for a minibatch's `Totals` and padded width."""

    lengths: Sequence[int]
    trainable: Sequence[int]

    @classmethod
    def of(cls, datums: Sequence[Any]) -> RowFigures:
        """From datums (anything with `len()` and `weights`) of every row."""
        return cls([len(d) for d in datums], [sum(d.weights) for d in datums])

    def __len__(self) -> int:
        return len(self.lengths)

    def totals(self, rows: Sequence[int]) -> Totals:
        return Totals.of_counts([self.trainable[i] for i in rows])

    def width(self, rows: Sequence[int]) -> int:
        """The longest datum of `rows`: the minibatch's padded length as if it ran in one piece."""
        return max(self.lengths[i] for i in rows)


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
