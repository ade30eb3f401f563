"""Step building and batch splitting: advantages per group, step statistics, and split-invariant losses."""

from __future__ import annotations

import pytest
import torch

from fleetrl.losses import policy_loss
from fleetrl.rollout import RolloutSample
from fleetrl.rollout_group import RolloutGroup
from fleetrl.trainer.batching import (
    RowFigures,
    Totals,
    balance_by_tokens,
    build_step_batch,
    chunk,
    part_loss_scale,
    rank_rows,
    split_even,
    token_micro_batches,
)


def _sample(reward: float, versions: list[int] | None = None, metrics: dict | None = None) -> RolloutSample:
    return RolloutSample(
        tokens=[1, 2, 3, 4],
        logprobs=[0.0, 0.0, -1.0, -1.0],
        loss_mask=[0, 0, 1, 1],
        reward=reward,
        versions=versions,
        metrics=metrics or {},
    )


def test_advantages_per_group_and_groups_of_one_skipped():
    groups = [
        RolloutGroup(7, 3, [_sample(r) for r in (1.0, 0.0, 0.0, 1.0)]),
        RolloutGroup(8, 3, [_sample(1.0)]),
    ]
    batch = build_step_batch(groups, train_version=4)
    assert [round(a, 3) for a in batch.advantages] == [0.866, -0.866, -0.866, 0.866]
    assert batch.row_ids == [7] and batch.skipped_row_ids == [8] and batch.num_samples == 4
    assert batch.stats["rollout/filtered_reward"] == 0.5 and batch.stats["data/groups_skipped"] == 1
    assert batch.stats["async/version_offset_max"] == 1.0  # no per-token versions: submit_version


def test_a_trajectory_split_into_samples_counts_once_and_its_samples_share_its_advantage():
    unsplit = build_step_batch([RolloutGroup(7, 3, [_sample(r) for r in (1.0, 0.0, 0.0, 1.0)])])
    pieces = [RolloutSample([1, 2, 3, 4], [0.0, 0.0, -1.0, -1.0], [0, 0, 1, 1], 0.0, member=1) for _ in range(3)]
    split = build_step_batch([RolloutGroup(7, 3, [_sample(1.0), *pieces, _sample(0.0), _sample(1.0)])])
    a = unsplit.advantages
    assert split.advantages == [a[0], a[1], a[1], a[1], a[2], a[3]] and split.num_samples == 6


def test_center_mode_and_version_offsets_from_trainable_tokens():
    samples = [
        _sample(2.0, versions=[0, 0, 5, 6], metrics={"correct": 1}),
        _sample(0.0, versions=[9, 9, 3, 4], metrics={"correct": 0}),
    ]
    batch = build_step_batch([RolloutGroup(1, 2, samples)], advantage_mode="center", train_version=6)
    assert batch.advantages == [1.0, -1.0]
    # Offsets count the oldest *generated* token: 6-5 and 6-3 (prompt versions are ignored).
    assert batch.stats["async/version_offset_mean"] == 2.0 and batch.stats["async/version_offset_max"] == 3.0
    assert batch.stats["env/all/correct"] == 0.5


def test_split_even_and_chunk():
    assert [list(r) for r in split_even(7, 3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(r) for r in split_even(1, 2)] == [[0], []]
    assert chunk([4, 5, 6], 2) == [[4, 5], [6]] and chunk([4, 5], None) == [[4, 5]] and chunk([], 2) == []
    with pytest.raises(ValueError):
        split_even(3, 0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "sum"])
def test_parts_scaled_sum_to_the_whole_batch_loss(mode):
    g = torch.Generator().manual_seed(0)
    B, T = 5, 6
    mask = (torch.rand(B, T, generator=g) > 0.4).float()
    mask[3] = 0.0  # a sequence with no trainable token
    mask[0, 0] = 1.0
    logprobs = -torch.rand(B, T, generator=g) * 3
    old = logprobs + 0.1 * torch.randn(B, T, generator=g)
    advantages = torch.randn(B, generator=g)

    class Cfg:
        loss_agg_mode = mode
        loss_agg_constant = float(T)  # what the trainer passes for sum-norm: the minibatch's width

    whole, _ = policy_loss("ppo", logprobs, old, old, advantages, mask, cfg=Cfg)
    totals = Totals.of(mask.int().tolist())
    parts = 0.0
    for rows in ([0, 1], [2], [3, 4]):
        part, _ = policy_loss("ppo", logprobs[rows], old[rows], old[rows], advantages[rows], mask[rows], cfg=Cfg)
        parts += float(part) * part_loss_scale(mode, mask[rows], totals)
    assert parts == pytest.approx(float(whole), rel=1e-6, abs=1e-7)


def test_samples_beyond_the_bound_are_refused_before_advantages():
    # Defence in depth (stale_policy = requeue): whatever the controller decided, a sample more than O versions
    # behind the trained version is not trained, and is counted.
    fresh = [_sample(r, versions=[0, 0, 5, 5]) for r in (1.0, 0.0)]
    stale = _sample(1.0, versions=[0, 0, 3, 5])  # oldest generated token: version 3, offset 2 at version 5
    batch = build_step_batch([RolloutGroup(1, 5, [*fresh, stale])], train_version=5, max_offpolicy=1)
    assert batch.num_samples == 2 and batch.stats["train/samples_refused_stale"] == 1.0
    assert batch.stats["async/version_offset_max"] == 0.0
    assert [round(a, 3) for a in batch.advantages] == [0.707, -0.707]  # computed without the refused sample
    # A group left with fewer than two samples is skipped; stale_policy = "train" (None) keeps everything.
    only_stale = RolloutGroup(2, 3, [stale, _sample(0.0, versions=[0, 0, 3, 3])])
    assert build_step_batch([only_stale], train_version=5, max_offpolicy=1).skipped_row_ids == [2]
    kept = build_step_batch([only_stale], train_version=5)
    assert kept.num_samples == 2 and "train/samples_refused_stale" not in kept.stats
    assert kept.stats["async/version_offset_max"] == 2.0 and kept.stats["async/version_offset_min"] == 2.0


def test_samples_with_token_ids_beyond_the_vocabulary_are_refused_not_fatal():
    good = [_sample(r) for r in (1.0, 0.0)]
    bad = RolloutSample([1, 2, 100512, 4], [0.0, 0.0, -1.0, -1.0], [0, 0, 1, 1], 1.0)
    batch = build_step_batch([RolloutGroup(1, 0, [*good, bad])], vocab_size=1000)
    assert batch.num_samples == 2 and batch.stats["train/samples_refused_vocab"] == 1.0


@pytest.mark.parametrize(("n", "minibatches", "world"), [(7, 1, 2), (15, 2, 2), (9, 2, 4), (1, 1, 2), (0, 2, 2)])
def test_rank_rows_partition_the_step_as_the_minibatches_split_across_ranks(n, minibatches, world):
    lengths = [(i * 37) % 11 + 1 for i in range(n)]
    per_rank = [rank_rows(lengths, minibatches, world, r) for r in range(world)]
    assert sorted(i for rows in per_rank for i in rows) == list(range(n))  # every row on exactly one rank
    for minibatch in (list(r) for r in split_even(n, minibatches) if r):
        shares = [[i for i in rows if i in minibatch] for rows in per_rank]
        assert shares == balance_by_tokens(minibatch, lengths, world)


def test_ranks_are_balanced_by_tokens_not_by_sample_count():
    # A long-tailed step: one 4096-token sample and seven short ones. By count, rank 0 would get the long one and
    # three short ones (4096 + 96 tokens vs 128); by tokens, the long one goes alone.
    lengths = [32, 4096, 32, 32, 32, 32, 32, 32]
    shares = balance_by_tokens(list(range(8)), lengths, 2)
    assert shares == [[1], [0, 2, 3, 4, 5, 6, 7]]
    assert [rank_rows(lengths, 1, 2, r) for r in (0, 1)] == shares
    # Equal lengths: alternate, deterministic ties to the lowest rank.
    assert balance_by_tokens([0, 1, 2, 3, 4], [5] * 5, 2) == [[0, 2, 4], [1, 3]]
    assert balance_by_tokens([], [], 3) == [[], [], []]


def test_token_micro_batches_fill_a_budget_and_a_long_row_goes_alone():
    lengths = {0: 10, 1: 10, 2: 30, 3: 5, 4: 5, 5: 100}
    assert token_micro_batches([0, 1, 2, 3, 4, 5], lengths, 25) == [[0, 1], [2], [3, 4], [5]]
    assert token_micro_batches([0, 1, 2, 3, 4, 5], lengths, None) == [[0, 1, 2, 3, 4, 5]]
    assert token_micro_batches([0, 1, 3, 4], lengths, 1000, max_samples=3) == [[0, 1, 3], [4]]
    assert token_micro_batches([], lengths, 10) == []
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        token_micro_batches([0], lengths, 0)


def test_row_figures_give_the_totals_and_width_of_the_rows_themselves():
    masks = [[0, 1, 1], [0, 0], [1, 1, 1, 0], [0, 1]]
    figures = RowFigures([len(m) for m in masks], [sum(m) for m in masks])
    assert len(figures) == 4
    for rows in ([0, 1, 2, 3], [1, 3], [1], [2, 0]):
        assert figures.totals(rows) == Totals.of([masks[i] for i in rows])
        assert figures.width(rows) == max(len(masks[i]) for i in rows)
