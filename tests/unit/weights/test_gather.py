"""`ShardedWeights` (fleetrl.weights.gather), the pure part: what it declares matches what it yields, cast to the
served dtype, and its buckets hold at most `bucket_bytes` of full tensors (a larger tensor alone). The gathers
themselves (DTensor shards on two gloo ranks) are tested in tests/integration/trainer/test_gathered_publish.py and
test_sharded_publish.py."""

from __future__ import annotations

import pytest
import torch

from fleetrl.weights.gather import ShardedWeights, gather_shards


def _state() -> dict[str, torch.Tensor]:
    return {
        "embed": torch.randn(64, 8),  # 2048 bytes in float32, 1024 in bfloat16
        "norm": torch.randn(8),
        "steps": torch.arange(4, dtype=torch.int64),  # not floating: keeps its dtype
        "head": torch.randn(16, 8),
    }


def test_metadata_matches_iteration_in_the_served_dtype():
    state = _state()
    weights = ShardedWeights(state, torch.bfloat16)
    metas = weights.metadata()
    got = list(weights)
    assert [m.name for m in metas] == [n for n, _ in got] == list(state)
    for meta, (name, tensor) in zip(metas, got, strict=True):
        assert (meta.dtype, meta.shape) == (tensor.dtype, tuple(tensor.shape)), name
        assert torch.equal(tensor, state[name].to(meta.dtype)), name
    assert [m.dtype for m in metas] == [torch.bfloat16, torch.bfloat16, torch.int64, torch.bfloat16]
    assert weights.total_bytes == 1024 + 16 + 32 + 256


def test_iteration_holds_one_full_tensor_at_a_time():
    weights = ShardedWeights(_state(), torch.bfloat16)
    for _ in weights:
        pass
    assert weights.peak_full_bytes == 1024  # the largest tensor, never two


@pytest.mark.parametrize("bucket_bytes", [300, 1100, 4096])
def test_buckets_hold_at_most_bucket_bytes_and_a_larger_tensor_alone(bucket_bytes):
    state = _state()
    weights = ShardedWeights(state, torch.bfloat16)
    batches = list(weights.buckets(bucket_bytes))
    assert [n for names, _ in batches for n in names] == list(state)
    for names, tensors in batches:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        assert nbytes <= bucket_bytes or len(tensors) == 1, (names, nbytes)
        for name, tensor in zip(names, tensors, strict=True):
            assert torch.equal(tensor, state[name].to(tensor.dtype))
    assert weights.peak_full_bytes <= max(bucket_bytes, 1024)
    if bucket_bytes >= weights.total_bytes:
        assert len(batches) == 1


def test_a_bucket_size_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="bucket_bytes"):
        next(ShardedWeights(_state()).buckets(0))


def test_gather_shards_of_plain_tensors_keeps_nothing():
    assert gather_shards(_state(), torch.bfloat16) is None
