"""A replica receives version after version into one reused buffer (fleetrl.weights.fetch.ReceiveBuffer).

Before, every fetch received each tensor into memory ZeroMQ had just allocated: fresh pages, faulted in on their
first write, for every version (0.35 s per 0.42 GB on the 2-core VM: docs/benchmarks.md, "The CPU weight path,
before and after"). These tests check the structure, not the time: the second version lands in the very memory
the first one used, with the same bytes as a plain fetch.
"""

from __future__ import annotations

import torch

from fleetrl.weights import WeightPublisher, fetch_weights
from fleetrl.weights.fetch import _SPLIT_BYTES, ReceiveBuffer


def _state_dict(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(37, 13, generator=gen),
        "norm.weight": torch.randn(13, generator=gen).to(torch.bfloat16),
        "big": torch.randn(_SPLIT_BYTES // 4 + 1001, generator=gen),  # more than one 8 MiB piece
        "position_ids": torch.arange(257, dtype=torch.int64),
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(-1.5),
        "mask": torch.rand(9, generator=gen) > 0.5,
    }


def _addresses(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in tensors.items() if t.numel()}


def test_versions_arrive_in_the_same_memory_with_the_same_bytes():
    buffer = ReceiveBuffer()
    with WeightPublisher(keep_versions=2) as publisher:
        publisher.publish(1, _state_dict(1))
        publisher.publish(2, _state_dict(2))
        _, first = fetch_weights(publisher.address, 1, into=buffer)
        first_bytes = {n: t.clone() for n, t in first.items()}
        first_addresses = _addresses(first)
        del first
        _, second = fetch_weights(publisher.address, 2, into=buffer)
        _, plain = fetch_weights(publisher.address, 2)
    assert buffer.allocations == 1
    assert _addresses(second) == first_addresses  # no fresh memory for version 2
    for name, expected in _state_dict(1).items():
        assert torch.equal(first_bytes[name], expected.contiguous()), name
    for name, tensor in second.items():
        assert tensor.dtype == plain[name].dtype and tensor.shape == plain[name].shape, name
        assert torch.equal(tensor, plain[name]), name
        assert tensor.data_ptr() % 64 == 0 or not tensor.numel(), name  # aligned for any dtype view


def test_a_version_of_another_size_gets_new_memory_and_release_gives_it_up():
    buffer = ReceiveBuffer()
    small = {"w": torch.arange(10, dtype=torch.float32)}
    with WeightPublisher() as publisher:
        publisher.publish(1, _state_dict(1))
        publisher.publish(2, small)
        fetch_weights(publisher.address, 1, into=buffer)
        held = buffer.nbytes
        _, tensors = fetch_weights(publisher.address, 2, into=buffer)
    assert buffer.allocations == 2 and held > buffer.nbytes == 40
    assert torch.equal(tensors["w"], small["w"])
    buffer.release()
    assert buffer.nbytes == 0
