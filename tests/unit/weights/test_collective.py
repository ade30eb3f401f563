"""The collective weight transport over real gloo process groups and the real weight stream on 127.0.0.1.

Replicas are threads here (each its own TCPStore client and gloo group, as a process would have); the engines'
end-to-end tests start real replicas (tests/integration/inference/test_collective_push.py).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from fleetrl.weights import WeightPublisher, WeightRelay, WeightTransferError
from fleetrl.weights.collective import join_group, receive_into, receive_state_dict, request_group
from fleetrl.weights.collective_plan import flat_layout


def _state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "embed.weight": torch.randn(37, 13, generator=gen),
        "big": torch.randn(5, 1001, generator=gen),  # 20020 B, split over several 4 KiB buckets
        "norm": torch.randn(13, generator=gen).to(torch.bfloat16),
        "position_ids": torch.arange(257, dtype=torch.int64),
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(-1.5),
    }


def _replicas(address: str, version: int, count: int, ranks: int = 1) -> dict[int, Any]:
    """`count` replicas joining at once; each result is (membership, tensors) or the exception it raised."""
    results: dict[int, Any] = {}

    def replica(i: int) -> None:
        try:
            offer = request_group(address, version, replicas=count, timeout_s=30)
            membership = join_group(offer, ranks)
            results[i] = (membership, None if membership is None else receive_state_dict(offer, membership))
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_two_replicas_receive_the_version_in_one_group() -> None:
    sd = _state_dict()
    with WeightPublisher(collective_bucket_bytes=4096) as publisher:
        publisher.publish(4, sd)
        results = _replicas(publisher.address, 4, 2)
        (sender,) = publisher.collective_senders
        assert sender.done.wait(60) and sender.error == ""
    assert sender.world_size == 3
    assert sorted(m.rank_offset for m, _ in results.values()) == [1, 2]
    for membership, tensors in results.values():
        assert membership.world_size == 3
        assert list(tensors) == list(sd)
        for name, tensor in sd.items():
            assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name
    assert publisher.counts["manifests_served"] == 0  # no byte went over the stream


def test_a_replica_after_the_close_is_told_to_use_the_stream_and_the_next_push_opens_a_new_group() -> None:
    with WeightPublisher(collective_join_timeout_s=0.2) as publisher:
        publisher.publish(1, _state_dict())
        first = request_group(publisher.address, 1, replicas=2, timeout_s=30)  # expects two; only one comes
        membership = join_group(first, 1)
        assert membership is not None and membership.world_size == 2
        receive_state_dict(first, membership)
        assert publisher.collective_senders[0].done.wait(60)
        assert join_group(first, 1) is None  # a late claim on the closed group: not a member
        again = request_group(publisher.address, 1, replicas=1, timeout_s=30)  # a new group for a catch-up
        assert again.group != first.group
        late = join_group(again, 1)
        assert late is not None and late.rank_offset == 1
        receive_state_dict(again, late)


def test_a_worker_pair_claims_two_ranks_and_each_receives_into_its_buffer() -> None:
    sd = _state_dict()
    with WeightPublisher(collective_bucket_bytes=4096) as publisher:
        publisher.publish(2, sd)
        offer = request_group(publisher.address, 2, replicas=1, timeout_s=30)
        membership = join_group(offer, 2)
        assert membership is not None and membership.world_size == 3
        _, size = flat_layout([t.nbytes for t in offer.manifest.tensors])
        received: dict[int, dict[str, torch.Tensor]] = {}

        def worker(rank: int) -> None:
            received[rank] = receive_into(offer, rank, membership.world_size, torch.empty(size, dtype=torch.uint8))

        threads = [threading.Thread(target=worker, args=(membership.rank_offset + i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert sorted(received) == [1, 2]
    for tensors in received.values():
        assert all(torch.equal(tensors[n], t) for n, t in sd.items())


def test_a_member_that_never_builds_the_group_fails_the_others_within_the_timeout() -> None:
    with WeightPublisher() as publisher:
        publisher.publish(1, _state_dict())
        offer = request_group(publisher.address, 1, replicas=2, timeout_s=2)
        memberships: list[Any] = []
        threads = [threading.Thread(target=lambda: memberships.append(join_group(offer, 1))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(memberships) == 2 and None not in memberships
        # The second member claimed its rank, then "died" before building the group.
        with pytest.raises(WeightTransferError) as raised:
            receive_state_dict(offer, memberships[0])
        assert raised.value.reason == "collective"
        assert publisher.collective_senders[0].done.wait(60)
        assert publisher.collective_senders[0].error


def test_an_unknown_version_and_a_relay_refuse_the_collective_request() -> None:
    with WeightPublisher() as publisher:
        publisher.publish(1, _state_dict())
        with pytest.raises(WeightTransferError) as raised:
            request_group(publisher.address, 7, replicas=1, timeout_s=10)
        assert raised.value.reason == "unknown_version"
        relay = WeightRelay(publisher.address, 1)
        try:
            with pytest.raises(WeightTransferError) as raised:
                request_group(relay.address, 1, replicas=1, timeout_s=10)
        finally:
            relay.close()
        assert raised.value.reason == "unsupported"


def test_the_collective_request_needs_the_token() -> None:
    with WeightPublisher(auth_token="secret") as publisher:
        publisher.publish(1, _state_dict())
        with pytest.raises(WeightTransferError) as raised:
            request_group(publisher.address, 1, replicas=1, timeout_s=10)
        assert raised.value.reason == "auth"
        offer = request_group(publisher.address, 1, replicas=1, timeout_s=10, auth_token="secret")
        assert offer.manifest.version == 1


def test_closing_the_publisher_cancels_a_group_still_waiting_for_replicas() -> None:
    publisher = WeightPublisher(collective_join_timeout_s=600)
    publisher.publish(1, _state_dict())
    request_group(publisher.address, 1, replicas=2, timeout_s=30)  # nobody joins: the group waits its window
    (sender,) = publisher.collective_senders
    publisher.close(timeout_s=5)
    assert sender.done.is_set() and "cancelled" in sender.error  # not left polling until the window ends
