"""The collective transport's pure planning: rank claims, the close, bucket layout (fleetrl.weights.collective_plan)."""

from __future__ import annotations

import itertools

import pytest

from fleetrl.weights.collective_plan import (
    CLOSED,
    Piece,
    claimed_rank_offset,
    flat_layout,
    plan_buckets,
    plan_ops,
    world_size_at_close,
)


def test_claims_in_arrival_order_get_consecutive_ranks_after_the_trainer() -> None:
    counter, offsets = 0, []
    for ranks in (1, 2, 1):  # an hf replica, a two-worker vLLM replica, another hf replica
        counter += ranks
        offsets.append(claimed_rank_offset(counter, ranks))
    assert offsets == [1, 2, 4]
    assert world_size_at_close(counter + CLOSED) == 5  # the trainer (rank 0) and four workers


def test_a_claim_after_the_close_is_not_a_member() -> None:
    counter = 3 + CLOSED  # closed with three ranks claimed
    assert claimed_rank_offset(counter + 2, 2) is None
    assert world_size_at_close(3 + CLOSED) == 4


def test_a_group_nobody_joined_is_the_trainer_alone() -> None:
    assert world_size_at_close(CLOSED) == 1


@pytest.mark.parametrize("bad", [(0, 0), (1, 2)])
def test_bad_claims_are_refused(bad: tuple[int, int]) -> None:
    counter, ranks = bad
    with pytest.raises(ValueError):
        claimed_rank_offset(counter, ranks)


def test_closing_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="closed twice"):
        world_size_at_close(2 * CLOSED + 1)
    with pytest.raises(ValueError, match="not closed"):
        world_size_at_close(5)


def _covered(buckets: tuple, sizes: list[int]) -> dict[int, list[tuple[int, int]]]:
    ranges: dict[int, list[tuple[int, int]]] = {}
    for bucket in buckets:
        for piece in bucket.pieces:
            ranges.setdefault(piece.tensor_index, []).append((piece.start, piece.stop))
    return ranges


def test_buckets_cover_every_byte_once_within_the_bound() -> None:
    sizes = [100, 5000, 0, 64, 1, 300, 129]
    bucket_bytes = 1024
    buckets = plan_buckets(sizes, bucket_bytes)
    for bucket in buckets:
        assert bucket.nbytes <= bucket_bytes
        ends = [p.offset + p.stop - p.start for p in bucket.pieces]
        assert max(ends) == bucket.nbytes
        assert all(p.offset % 64 == 0 for p in bucket.pieces)
        spans = sorted((p.offset, p.offset + p.stop - p.start) for p in bucket.pieces)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # no overlap
    ranges = _covered(buckets, sizes)
    for index, size in enumerate(sizes):
        covered = sorted(ranges.get(index, []))
        if size == 0:
            assert covered == []
            continue
        assert covered[0][0] == 0 and covered[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))


def test_a_tensor_that_does_not_fit_starts_a_new_bucket_rather_than_split() -> None:
    buckets = plan_buckets([600, 600], 1024)
    assert [b.pieces for b in buckets] == [(Piece(0, 0, 600, 0),), (Piece(1, 0, 600, 0),)]


def test_a_tensor_larger_than_a_bucket_is_split_over_whole_buckets() -> None:
    buckets = plan_buckets([2500], 1024)
    assert [b.pieces for b in buckets] == [
        (Piece(0, 0, 1024, 0),),
        (Piece(0, 1024, 2048, 0),),
        (Piece(0, 2048, 2500, 0),),
    ]


def test_small_tensors_share_a_bucket_aligned() -> None:
    (bucket,) = plan_buckets([10, 70, 3], 1024)
    assert bucket.pieces == (Piece(0, 0, 10, 0), Piece(1, 0, 70, 64), Piece(2, 0, 3, 192))
    assert bucket.nbytes == 195


def test_bucket_bytes_must_be_an_aligned_positive_size() -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([1], 100)


def test_flat_layout_aligns_each_tensor() -> None:
    assert flat_layout([10, 64, 0, 1]) == ((0, 64, 128, 128), 192)


def test_ops_send_large_pieces_alone_and_pack_runs_of_small_ones() -> None:
    (bucket,) = plan_buckets([10, 20, 5000, 30, 40, 6000, 7], 1 << 16)
    ops = plan_ops(bucket, 1000)
    offsets = [p.offset for p in bucket.pieces]
    ends = [p.offset + p.stop - p.start for p in bucket.pieces]
    assert ops == (
        (offsets[0], ends[1]),  # the two small ones before the first large one, packed
        (offsets[2], ends[2]),
        (offsets[3], ends[4]),
        (offsets[5], ends[5]),
        (offsets[6], ends[6]),
    )
    assert plan_ops(bucket, 1) == tuple((o, e) for o, e in zip(offsets, ends, strict=True))  # nothing small
    assert plan_ops(bucket, 1 << 20) == ((0, bucket.nbytes),)  # everything small: one packed broadcast
