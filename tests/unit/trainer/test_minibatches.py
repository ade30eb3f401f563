"""Batch splitting (fleetrl.trainer.minibatches): minibatches across ranks balanced by tokens, token-budget
micro-batches, and losses that the split leaves unchanged."""

from __future__ import annotations

import pytest
import torch

from fleetrl.losses import policy_loss
from fleetrl.trainer.minibatches import (
    SampleFigures,
    Totals,
    balance_by_tokens,
    chunk,
    part_loss_scale,
    rank_samples,
    split_even,
    token_micro_batches,
)


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


@pytest.mark.parametrize(("n", "minibatches", "world"), [(7, 1, 2), (15, 2, 2), (9, 2, 4), (1, 1, 2), (0, 2, 2)])
def test_rank_samples_partition_the_step_as_the_minibatches_split_across_ranks(n, minibatches, world):
    lengths = [(i * 37) % 11 + 1 for i in range(n)]
    per_rank = [rank_samples(lengths, minibatches, world, r) for r in range(world)]
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
    assert [rank_samples(lengths, 1, 2, r) for r in (0, 1)] == shares
    # Equal lengths: alternate, deterministic ties to the lowest rank.
    assert balance_by_tokens([0, 1, 2, 3, 4], [5] * 5, 2) == [[0, 2, 4], [1, 3]]
    assert balance_by_tokens([], [], 3) == [[], [], []]


def test_token_micro_batches_fill_a_budget_and_a_long_sample_goes_alone():
    lengths = {0: 10, 1: 10, 2: 30, 3: 5, 4: 5, 5: 100}
    assert token_micro_batches([0, 1, 2, 3, 4, 5], lengths, 25) == [[0, 1], [2], [3, 4], [5]]
    assert token_micro_batches([0, 1, 2, 3, 4, 5], lengths, None) == [[0, 1, 2, 3, 4, 5]]
    assert token_micro_batches([0, 1, 3, 4], lengths, 1000, max_samples=3) == [[0, 1, 3], [4]]
    assert token_micro_batches([], lengths, 10) == []
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        token_micro_batches([0], lengths, 0)


def test_sample_figures_give_the_totals_and_width_of_the_samples_themselves():
    masks = [[0, 1, 1], [0, 0], [1, 1, 1, 0], [0, 1]]
    figures = SampleFigures([len(m) for m in masks], [sum(m) for m in masks])
    assert len(figures) == 4
    for rows in ([0, 1, 2, 3], [1, 3], [1], [2, 0]):
        assert figures.totals(rows) == Totals.of([masks[i] for i in rows])
        assert figures.width(rows) == max(len(masks[i]) for i in rows)
