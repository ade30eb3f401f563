"""`WeightPublisher.publish(background=True)`: the caller waits only for the copy into reused staging buffers; the
cast, the checksums and serving run in a background thread, a fetch of the version waits until it is ready, and at
most one version is staged beyond those served. Real ZeroMQ on 127.0.0.1; a gate held in the stager plays a slow
cast (the input, not the synchronisation)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import torch

from fleetrl.weights import WeightPublisher, WeightTransferError, fetch_weights
from fleetrl.weights.manifest import tensor_bytes
from fleetrl.weights.staging import HostStaging
from tests.waiting import wait_until

CHUNK = 4096


def _state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(37, 13, generator=gen),
        "q.weight": torch.randn(3000, generator=gen).to(torch.bfloat16),
        "big": torch.randn(5, 1001, generator=gen),
        "position_ids": torch.arange(257, dtype=torch.int64).reshape(1, 257),
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(-1.5),
        "mask": torch.rand(9, generator=gen) > 0.5,
        "odd": torch.randn(3, 1, 5, generator=gen).transpose(0, 2),  # not contiguous
    }


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert bytes(tensor_bytes(got[name])) == bytes(tensor_bytes(tensor.contiguous())), name


class _GatedPublisher(WeightPublisher):
    """Its stager waits for `gate` before casting and hashing a staged version."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = threading.Event()

    def _finish_stage(self, *args: Any) -> Any:
        assert self.gate.wait(60), "the test never opened the gate"
        return super()._finish_stage(*args)


def test_the_call_returns_after_the_copy_and_a_fetch_waits_for_the_staged_version():
    live = _state_dict()
    want = {k: v.clone() for k, v in live.items()}
    with _GatedPublisher(chunk_bytes=CHUNK) as pub, ThreadPoolExecutor(1) as pool:
        future = pub.publish(1, live, background=True)
        assert isinstance(future, Future) and not future.done()  # cast and checksums not done yet
        assert pub.staged_version == 1 and pub.versions == ()
        for tensor in live.values():  # the next step changes the weights: the snapshot was taken
            if tensor.is_floating_point():
                tensor.add_(1.0)
        fetch = pool.submit(fetch_weights, pub.address, 1, timeout_s=30)
        wait_until(lambda: pub.snapshot_counts().get("manifests_deferred") == 1, 30, "the fetch to wait")
        assert not fetch.done()
        pub.gate.set()
        manifest, got = fetch.result(60)
        _assert_bit_exact(got, want)
        assert future.result(60).checksum == manifest.checksum
        assert pub.staged_version is None and pub.versions == (1,)


def test_at_most_one_version_is_staged_and_the_buffers_are_reused():
    with _GatedPublisher(chunk_bytes=CHUNK) as pub, ThreadPoolExecutor(1) as pool:
        first = pub.publish(1, _state_dict(1), background=True)
        second_call = pool.submit(pub.publish, 2, _state_dict(2), background=True)
        wait_until(lambda: pub.stage_waits == 1, 30, "the second publish to wait for the first's staging")
        assert not second_call.done() and pub.staged_version == 1
        pub.gate.set()
        second = second_call.result(60)
        assert first.result(60).version == 1 and second.result(60).version == 2
        assert pub.versions == (1, 2) and pub.staging_allocations == 1  # same sizes: the same buffers
        _, got = fetch_weights(pub.address, 2, timeout_s=30)
        _assert_bit_exact(got, _state_dict(2))


def test_the_cast_runs_in_the_background():
    sd = _state_dict()
    with WeightPublisher(chunk_bytes=CHUNK) as pub:
        manifest = pub.publish(3, sd, float_dtype=torch.bfloat16, background=True).result(60)
        _, got = fetch_weights(pub.address, 3, timeout_s=30)
        want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}
        _assert_bit_exact(got, want)
        # The same bytes and checksum as a publish in the caller.
        assert pub.publish(4, sd, float_dtype=torch.bfloat16).tensors == manifest.tensors


class _FailingStager(WeightPublisher):
    def _finish_stage(self, *args: Any) -> Any:
        raise RuntimeError("out of memory")


def test_a_failed_staging_refuses_its_fetches_and_fails_the_next_publish():
    with _FailingStager(chunk_bytes=CHUNK) as pub:
        future = pub.publish(1, _state_dict(), background=True)
        with pytest.raises(RuntimeError, match="out of memory"):
            future.result(60)
        with pytest.raises(WeightTransferError) as info:
            fetch_weights(pub.address, 1, timeout_s=30)
        assert info.value.reason in ("internal", "unknown_version")
        with pytest.raises(WeightTransferError, match="staging the previous weight version failed"):
            pub.publish(2, _state_dict(), background=True)
        pub.publish(3, _state_dict())  # reported once; publishing goes on


def test_staging_buckets_pack_tensors_and_give_a_large_one_its_own():
    staging = HostStaging(bucket_bytes=1000)
    places, sizes = staging._plan([100, 100, 5000, 10, 0])
    assert places == [(0, 0, 100), (0, 128, 100), (1, 0, 5000), (2, 0, 10), (2, 64, 0)]
    assert sizes == [228, 5000, 64]
    views, ready = staging.snapshot([torch.arange(25, dtype=torch.float32), torch.ones(3, dtype=torch.bool)])
    assert ready is None and torch.equal(views[0], torch.arange(25, dtype=torch.float32))
    assert views[1].dtype == torch.bool and bool(views[1].all())
    assert staging.allocations == 1 and staging.nbytes == 131


def test_staging_casts_floating_tensors_on_the_way():
    staging = HostStaging()
    source = [torch.rand(4, 3), torch.arange(5), torch.tensor([True, False])]
    views, _ = staging.snapshot(source, torch.bfloat16)
    assert [v.dtype for v in views] == [torch.bfloat16, torch.int64, torch.bool]
    assert torch.equal(views[0], source[0].to(torch.bfloat16)) and torch.equal(views[1], source[1])
    assert staging.nbytes == 64 + 64 + 2  # 24 B of bfloat16 and 40 B of int64, each on a 64-byte boundary


def test_a_fetch_waiting_for_a_staged_version_is_answered_when_it_is_served_not_at_the_next_poll(monkeypatch):
    """The stager wakes the serving loop: with a poll timeout of ten minutes the waiting fetch still gets the version
    as soon as it is served (before, the loop answered deferred fetches only when its poll timed out, 100 ms)."""
    import fleetrl.weights.server

    monkeypatch.setattr(fleetrl.weights.server, "_POLL_MS", 600_000)
    live = _state_dict()
    want = {k: v.clone() for k, v in live.items()}
    with _GatedPublisher(chunk_bytes=CHUNK) as pub, ThreadPoolExecutor(1) as pool:
        pub.publish(1, live, background=True)
        fetched = pool.submit(fetch_weights, pub.address, 1, timeout_s=120)
        wait_until(lambda: pub.counts["manifests_deferred"] >= 1, 30, "the fetch to wait for the staged version")
        pub.gate.set()
        _, got = fetched.result(timeout=120)
    _assert_bit_exact(got, want)


def test_served_versions_reuse_their_memory_but_never_one_a_fetch_still_reads():
    """The stager's copies go into reused buffers (fresh memory for each version cost a page fault per 4 KiB:
    docs/benchmarks.md, "The CPU weight path, before and after"): three sets for keep_versions 2 over many
    versions. A fetch of an old version still open keeps that version's memory: it reads the right bytes to the
    end while newer versions are published."""
    from fleetrl.weights import iter_weights

    with WeightPublisher(chunk_bytes=CHUNK, keep_versions=2) as pub:
        pub.publish(1, _state_dict(1), background=True).result(timeout=60)
        held = iter(iter_weights(pub.address, 1))
        first = next(held)
        for version in range(2, 8):
            pub.publish(version, _state_dict(version), background=True).result(timeout=60)
            _, got = fetch_weights(pub.address, version)
            _assert_bit_exact(got, {k: v.contiguous() for k, v in _state_dict(version).items()})
        # Three in turn and version 1's, which the open fetch holds (one more if ZeroMQ had not yet let go of a reply).
        assert 4 <= pub.served_allocations <= 5
        rest = dict([first, *held])
    _assert_bit_exact(rest, {k: v.contiguous() for k, v in _state_dict(1).items()})


def test_three_sets_of_served_buffers_serve_any_number_of_versions():
    with WeightPublisher(chunk_bytes=CHUNK, keep_versions=2) as pub:
        for version in range(1, 13):
            pub.publish(version, _state_dict(version), background=True).result(timeout=60)
            _, got = fetch_weights(pub.address, version)
            _assert_bit_exact(got, {k: v.contiguous() for k, v in _state_dict(version).items()})
        assert 3 <= pub.served_allocations <= 4  # not one per version (one more if ZeroMQ still held a reply)
