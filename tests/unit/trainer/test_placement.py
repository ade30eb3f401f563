"""Each rank binds its own GPU before the process group exists (issue 26): without it every rank's NCCL
communicator, mesh and FSDP2 shards land on cuda:0. No GPU here, so CUDA's binding and the process group's
start are recording fakes: the test checks the order and the device the rank asks for, not NCCL."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fleetrl.trainer.distributed import DistContext


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    recorded: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: recorded.append(("set_device", device)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        dist, "init_process_group", lambda backend, **kw: recorded.append(("init_process_group", backend, kw))
    )
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    return recorded


def test_cuda_rank_binds_its_local_gpu_before_the_process_group(calls: list[tuple]) -> None:
    ctx = DistContext.from_env(device="cuda")
    assert [c[0] for c in calls] == ["set_device", "init_process_group"]
    assert calls[0] == ("set_device", 1)
    _, backend, kwargs = calls[1]
    assert backend == "nccl"
    assert kwargs["device_id"] == torch.device("cuda", 1)
    assert ctx.comm_device == "cuda:1" and ctx.device("cuda") == torch.device("cuda", 1)


def test_cpu_rank_binds_no_gpu(calls: list[tuple]) -> None:
    DistContext.from_env(device="cpu")
    assert [c[0] for c in calls] == ["init_process_group"]
    _, backend, kwargs = calls[0]
    assert backend == "gloo" and "device_id" not in kwargs
