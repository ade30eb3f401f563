"""One staged copy per replica (services/inference/vllm_worker.py), without vLLM: local rank 0's staging thread
fetches a version from a real WeightPublisher into a shared-memory file, another rank's thread maps it; where the
file cannot be reserved (a full /dev/shm) every rank fetches its own copy instead of failing.
The two-rank vLLM replica test is tests/integration/tensor_parallel/test_vllm_tensor_parallel.py."""

from __future__ import annotations

import errno
import threading

import pytest
import torch

from fleetrl.services.inference import vllm_worker
from fleetrl.services.inference.vllm_worker import (
    STAGE_FAILED,
    STAGE_READY,
    _fetch_shared_into,
    _map_shared_from_rank0,
    _Staged,
    shared_paths,
    spec_from_state_dict,
)
from fleetrl.weights import WeightPublisher

pytestmark = pytest.mark.integration


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(vllm_worker.SHM_DIR_ENV, str(tmp_path))
    return tmp_path


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(33, 7, generator=gen),
        "b.bias": torch.randn(5, generator=gen),
        "c.weight": torch.randn(4, 4, 3, generator=gen),
    }


def _stage_two_ranks(publisher: WeightPublisher, version: int, state) -> tuple[_Staged, _Staged]:
    spec = spec_from_state_dict(state, "float32")
    handle = {"load_id": "L1", "address": publisher.address, "version": version, "timeout_s": 30.0}
    rank0, rank1 = _Staged("L1", version), _Staged("L1", version)
    threads = [
        threading.Thread(target=_map_shared_from_rank0, args=(rank1, handle, spec)),
        threading.Thread(target=_fetch_shared_into, args=(rank0, handle, spec)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return rank0, rank1


def test_rank_zero_fetches_once_and_the_other_rank_maps_its_copy(shm_dir):
    state = _state()
    with WeightPublisher() as publisher:
        manifest = publisher.publish(3, state)
        rank0, rank1 = _stage_two_ranks(publisher, 3, state)
        counts = publisher.snapshot_counts()
    for staged in (rank0, rank1):
        assert staged.state == STAGE_READY, staged.error
        assert staged.checksum == manifest.checksum and staged.nbytes == manifest.total_bytes
        assert all(torch.equal(dict(staged.tensors)[name], tensor) for name, tensor in state.items())
    assert counts["manifests_served"] == 1 and counts["bytes_served"] == manifest.total_bytes
    assert all(p.exists() for p in shared_paths("L1"))
    rank0.release()  # rank 0 applied its copy: the files go, the other rank's mapping stays readable
    assert not any(shm_dir.iterdir())
    assert torch.equal(dict(rank1.tensors)["a.weight"], state["a.weight"])


def test_without_room_for_the_shared_copy_every_rank_fetches_its_own(shm_dir, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(vllm_worker.os, "posix_fallocate", full)
    state = _state()
    with WeightPublisher() as publisher:
        manifest = publisher.publish(4, state)
        rank0, rank1 = _stage_two_ranks(publisher, 4, state)
        counts = publisher.snapshot_counts()
    for staged in (rank0, rank1):
        assert staged.state == STAGE_READY, staged.error
        assert all(torch.equal(dict(staged.tensors)[name], tensor) for name, tensor in state.items())
    # Rank 0 read the manifest once more (to size the copy it found no room for), but no tensor byte twice.
    assert counts["manifests_served"] == 3 and counts["bytes_served"] == 2 * manifest.total_bytes
    rank0.release()
    assert not any(shm_dir.iterdir())


def test_a_rank_waiting_for_a_discarded_load_stops(shm_dir):
    staged = _Staged("L2", 1)
    spec = spec_from_state_dict(_state(), "float32")
    thread = threading.Thread(target=_map_shared_from_rank0, args=(staged, {"load_id": "L2"}, spec))
    thread.start()
    staged.cancelled.set()
    thread.join(10)
    assert not thread.is_alive()
    assert staged.state == STAGE_FAILED and "cancelled" in staged.error
