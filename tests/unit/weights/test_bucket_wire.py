"""The packed buckets of an engine transfer (fleetrl.weights.bucket_wire), pure: both ends cut the same buckets
from the metadata, a bucket unpacks to exactly its tensors, and its digest changes when one word changes or two
words swap (so a damaged bucket is caught without reading it back to the host)."""

from __future__ import annotations

import pytest
import torch

from fleetrl.weights.bucket_wire import bucket_digest, pack_bucket, plan_buckets, unpack_bucket
from fleetrl.weights.gather import ShardedWeights


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(100, 7, generator=gen),  # 2800 bytes: offsets after it need the 64-byte alignment
        "b": torch.randn(3, generator=gen).to(torch.bfloat16),
        "c": torch.arange(5, dtype=torch.int64),
        "d": torch.randn(600, generator=gen),
    }


@pytest.mark.parametrize("bucket_bytes", [64, 3000, 1 << 20])
def test_buckets_pack_and_unpack_to_exactly_the_tensors(bucket_bytes):
    state = _state()
    metas = ShardedWeights(state).metadata()
    buckets = plan_buckets(metas, bucket_bytes)
    assert [i for b in buckets for i in b.indices] == list(range(len(metas)))
    for bucket in buckets:
        assert bucket.nbytes <= bucket_bytes or len(bucket.indices) == 1
        assert all(offset % 64 == 0 for offset in bucket.offsets)
        packed = pack_bucket(bucket, [state[metas[i].name] for i in bucket.indices], "cpu")
        for name, tensor in unpack_bucket(bucket, metas, packed):
            assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name]), name


def test_the_digest_changes_with_one_word_or_a_swap_and_not_otherwise():
    state = _state()
    metas = ShardedWeights(state).metadata()
    (bucket,) = plan_buckets(metas, 1 << 20)
    packed = pack_bucket(bucket, list(state.values()), "cpu")
    digest = int(bucket_digest(packed).item())
    assert int(bucket_digest(packed.clone()).item()) == digest
    flipped = packed.clone()
    flipped[1000] ^= 0x10
    assert int(bucket_digest(flipped).item()) != digest
    words = packed.clone().view(torch.int32)
    words[[3, 40]] = words[[40, 3]].clone()
    assert words[3] != words[40] and int(bucket_digest(words.view(torch.uint8)).item()) != digest
    odd = packed[:1001]  # not a multiple of 4 bytes: zero-padded
    assert bucket_digest(odd).shape == (1,)


def test_a_bucket_size_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(ShardedWeights(_state()).metadata(), 0)
