"""The collective transport's backend chosen per push from where the trainer and the replica run, and the device path.

NCCL needs GPUs; here every path runs with gloo and device "cpu" through the same code (the device is a parameter),
and the NCCL choice is checked where it is made (the offer, the refusal), never by building an NCCL group.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from pydantic import ValidationError

import fleetrl.weights.collective as collective
from fleetrl.config import Config
from fleetrl.services.trainer.config import TrainerServiceConfig
from fleetrl.weights import WeightPublisher, WeightTransferError
from fleetrl.weights.collective import (
    CollectiveSender,
    join_group,
    receive_into,
    receive_state_dict,
    request_group,
)
from fleetrl.weights.collective_plan import choose_backend, flat_layout, receive_device


def _state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {
        "embed.weight": torch.randn(37, 13, generator=gen),
        "big": torch.randn(5, 1001, generator=gen),  # 20020 B: pieces of whole 4 KiB buckets
        "norm": torch.randn(13, generator=gen).to(torch.bfloat16),
        "position_ids": torch.arange(257, dtype=torch.int64),
    }


@pytest.mark.parametrize(
    ("setting", "trainer", "replica", "backend"),
    [
        ("auto", "cuda:0", "cuda", "nccl"),
        ("auto", "cuda", "cpu", "gloo"),
        ("auto", "cpu", "cuda:1", "gloo"),
        ("auto", "cpu", "cpu", "gloo"),
        ("gloo", "cuda", "cuda", "gloo"),
        ("nccl", "cuda:0", "cuda:3", "nccl"),
    ],
)
def test_the_backend_follows_the_setting_and_both_devices(setting: str, trainer: str, replica: str, backend: str):
    assert choose_backend(setting, trainer, replica) == backend


def test_nccl_off_cuda_and_unknown_values_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match="collective_backend 'nccl' needs the trainer and the replica on CUDA"):
        choose_backend("nccl", "cuda", "cpu")
    with pytest.raises(ValueError, match="collective_backend must be one of"):
        choose_backend("mpi", "cpu", "cpu")
    with pytest.raises(ValueError, match="device must be one of"):
        choose_backend("auto", "tpu", "cpu")


def test_receivers_use_their_device_under_nccl_and_host_memory_under_gloo():
    assert receive_device("nccl", "cuda:2") == "cuda:2"
    assert receive_device("gloo", "cuda:2") == "cpu"
    assert receive_device("gloo", "cpu") == "cpu"
    with pytest.raises(ValueError, match="NCCL receiver needs a CUDA device"):
        receive_device("nccl", "cpu")


def test_a_gpu_replica_asking_a_cpu_trainer_gets_a_gloo_group_whose_offer_names_both_devices():
    sd = _state_dict()
    with WeightPublisher(collective_bucket_bytes=4096) as publisher:  # collective_backend "auto", trainer on cpu
        publisher.publish(2, sd)
        offer = request_group(publisher.address, 2, replicas=1, timeout_s=30, device="cuda")
        assert (offer.backend, offer.trainer_device, offer.replica_device) == ("gloo", "cpu", "cuda")
        membership = join_group(offer, 1)
        assert membership is not None
        tensors = receive_state_dict(offer, membership, device="cuda")  # gloo: received into host memory
        (sender,) = publisher.collective_senders
        assert sender.done.wait(60) and sender.error == ""
    for name, tensor in sd.items():
        assert tensors[name].device.type == "cpu" and torch.equal(tensors[name], tensor), name


def test_collective_backend_nccl_refuses_a_cpu_replica_which_then_loads_over_the_stream():
    # The trainer "on CUDA" only as a setting: the refusal comes before any group is built.
    with WeightPublisher(collective_backend="nccl", collective_device="cuda:0") as publisher:
        publisher.publish(1, _state_dict())
        with pytest.raises(WeightTransferError, match="collective_backend 'nccl' needs") as caught:
            request_group(publisher.address, 1, replicas=1, timeout_s=30, device="cpu")
        assert caught.value.reason == "unsupported"
        assert not publisher.collective_senders


def test_a_replica_whose_device_needs_another_backend_than_the_open_group_is_refused():
    # auto with the trainer on CUDA: a CUDA replica opens an NCCL group (never built: nobody joins it here), a CPU
    # replica of the same version needs gloo and is told to use the stream.
    with WeightPublisher(collective_device="cuda", collective_join_timeout_s=5.0) as publisher:
        publisher.publish(3, _state_dict())
        first = request_group(publisher.address, 3, replicas=2, timeout_s=30, device="cuda")
        assert (first.backend, first.trainer_device) == ("nccl", "cuda")
        with pytest.raises(WeightTransferError, match="broadcasts over nccl") as caught:
            request_group(publisher.address, 3, replicas=2, timeout_s=30, device="cpu")
        assert caught.value.reason == "unsupported"
        publisher.collective_senders[0].cancel()


def test_the_publisher_refuses_nccl_for_a_trainer_off_cuda_naming_the_setting():
    with pytest.raises(ValueError, match="collective_backend 'nccl' needs the trainer on CUDA"):
        WeightPublisher(collective_backend="nccl")
    with pytest.raises(ValueError, match="collective_backend must be one of"):
        WeightPublisher(collective_backend="mpi")
    with pytest.raises(ValueError, match="collective_device"):
        WeightPublisher(collective_device="tpu")


def test_the_sender_broadcasts_through_one_reused_bucket_buffer_on_its_device_and_receivers_load_from_theirs(
    monkeypatch: pytest.MonkeyPatch,
):
    # Pieces below 1 KiB are packed through the sender's device buffer (the path every piece takes on a GPU), the
    # 4 KiB pieces of "big" go from the snapshot where it lies on the sender's device; the receiver's flat buffer is
    # on its device ("cpu": gloo) and the tensors it returns are views of it.
    monkeypatch.setattr(collective, "SMALL_PIECE_BYTES", 1024)
    sd = _state_dict()
    with WeightPublisher(collective_bucket_bytes=4096, collective_device="cpu") as publisher:
        publisher.publish(6, sd)
        offer = request_group(publisher.address, 6, replicas=1, timeout_s=30, device="cpu")
        membership = join_group(offer, 1)
        assert membership is not None
        _, size = flat_layout([t.nbytes for t in offer.manifest.tensors])
        flat = torch.empty(size, dtype=torch.uint8, device="cpu")
        tensors = receive_into(offer, membership.rank_offset, membership.world_size, flat)
        (sender,) = publisher.collective_senders
        assert sender.done.wait(60) and sender.error == ""
    assert sender.device == torch.device("cpu")
    assert sender.buffer_bytes == max(b.nbytes for b in sender.buckets) <= 4096
    for name, tensor in sd.items():
        assert torch.equal(tensors[name], tensor), name
        assert tensors[name].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), name


def test_a_gloo_receiver_refuses_a_buffer_off_host_memory():
    with WeightPublisher() as publisher:
        publisher.publish(1, _state_dict())
        offer = request_group(publisher.address, 1, replicas=1, timeout_s=30)
        _, size = flat_layout([t.nbytes for t in offer.manifest.tensors])
        with pytest.raises(ValueError, match="gloo receiver's buffer lives in host memory"):
            receive_into(offer, 1, 2, torch.empty(size, dtype=torch.uint8, device="meta"))
        publisher.collective_senders[0].cancel()


def test_an_nccl_sender_needs_a_cuda_device():
    manifest = _published_manifest()
    with pytest.raises(ValueError, match="NCCL receiver needs a CUDA device"):
        CollectiveSender(manifest, (), expected_replicas=1, backend="nccl", device="cpu")


def _published_manifest() -> Any:
    with WeightPublisher() as publisher:
        publisher.publish(1, {"w": torch.ones(3)})
        return publisher._versions[1].manifest


def test_request_group_refuses_an_unknown_device_naming_it():
    with pytest.raises(ValueError, match="device must be one of"):
        request_group("tcp://127.0.0.1:1", 1, replicas=1, timeout_s=1, device="tpu")


def test_the_run_setting_is_validated_and_nccl_needs_a_cuda_trainer():
    with pytest.raises(ValidationError, match="collective_backend"):
        Config(base_model="x", collective_backend="mpi")
    assert Config(base_model="x").collective_backend == "auto"
    run = Config(base_model="x", weight_transport="collective", collective_backend="nccl", kl_beta=0.0)
    with pytest.raises(ValidationError, match="collective_backend"):
        TrainerServiceConfig(run=run, device="cpu")
    assert TrainerServiceConfig(run=run, device="cuda").run.collective_backend == "nccl"


def test_concurrent_replicas_on_mixed_devices_share_one_gloo_group():
    sd = _state_dict()
    results: dict[str, Any] = {}

    def replica(device: str) -> None:
        try:
            offer = request_group(publisher.address, 9, replicas=2, timeout_s=30, device=device)
            membership = join_group(offer, 1)
            assert membership is not None
            results[device] = receive_state_dict(offer, membership, device=device)
        except Exception as exc:
            results[device] = exc

    with WeightPublisher(collective_device="cuda") as publisher:  # auto: a CPU replica makes it gloo
        publisher.publish(9, sd)
        threads = [threading.Thread(target=replica, args=(d,)) for d in ("cpu", "cpu:0")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    for tensors in results.values():
        assert isinstance(tensors, dict), tensors
        assert all(torch.equal(tensors[n], t) for n, t in sd.items())
