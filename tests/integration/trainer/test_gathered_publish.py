"""Publishing a sharded model (issue 39 item 2): two gloo ranks gather it one tensor at a time into rank 0's staging
buffers, cast on the device (`WeightPublisher.publish(..., sharded=True)` on rank 0, `gather_shards` on the other),
and the version served has exactly the bytes of today's full state dict (`full_state_dict`: the whole model
gathered in float32 into rank 0's host memory), cast as the publisher casts it. Rank 0's host memory for it is the
version's bytes in the served dtype; the other rank keeps none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from fleetrl.trainer.distributed import destroy, full_state_dict, shard_model
from fleetrl.weights.manifest import tensor_bytes
from tests.integration.trainer.rank_env import end_rank, rank_context

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WORLD = 2


def _worker(rank: int, port: int, model_dir: str, dtype_name: str, out: str) -> None:
    from transformers import AutoModelForCausalLM

    from fleetrl.weights import WeightPublisher, fetch_weights
    from fleetrl.weights.publisher import gather_shards

    ctx = rank_context(rank, WORLD, port)
    dtype = None if dtype_name == "none" else getattr(torch, dtype_name)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():  # weights that differ from the file's, so nothing passes by reading it again
            for i, p in enumerate(model.parameters()):
                p.add_(0.001 * (i + 1))
        shard_model(model, torch.device("cpu"), WORLD)
        today = full_state_dict(model, ctx)  # the path this replaces, for the comparison
        if rank != 0:
            gather_shards(model.state_dict(), dtype)
            return
        with WeightPublisher() as publisher:
            manifest = publisher.publish(1, model.state_dict(), sharded=True, float_dtype=dtype).result(timeout=120)
            staged = publisher._staging.nbytes
            _, got = fetch_weights(publisher.address, 1)
        mismatched = []
        for name, tensor in today.items():
            want = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
            g = got.get(name)
            same = g is not None and g.dtype == want.dtype and g.shape == want.shape
            if not same or bytes(tensor_bytes(g)) != bytes(tensor_bytes(want.contiguous())):
                mismatched.append(name)
        expected_bytes = sum(
            t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size())
            for t in today.values()
        )
        result = {
            "names": [s.name for s in manifest.tensors] == list(today),
            "mismatched": mismatched,
            "staged_bytes": staged,
            "expected_bytes": expected_bytes,
            "float32_bytes": sum(t.numel() * t.element_size() for t in today.values()),
        }
        Path(out, "result.json").write_text(json.dumps(result))
    finally:
        destroy(ctx)
        end_rank()


@pytest.mark.parametrize("dtype_name", ["none", "bfloat16"])
def test_a_sharded_publish_serves_exactly_the_full_state_dict(tiny_model_dir, tmp_path, free_port, dtype_name):
    mp.spawn(_worker, args=(free_port, tiny_model_dir, dtype_name, str(tmp_path)), nprocs=WORLD, join=True)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["names"] and result["mismatched"] == []
    # Rank 0 held the version in the served dtype (64-byte alignment aside), not the float32 model.
    assert result["expected_bytes"] <= result["staged_bytes"] < result["expected_bytes"] + 64 * 200
    if dtype_name == "bfloat16":
        assert result["staged_bytes"] < 0.6 * result["float32_bytes"]


def _refused_worker(rank: int, port: int, model_dir: str, out: str) -> None:
    from transformers import AutoModelForCausalLM

    from fleetrl.weights import WeightPublisher
    from fleetrl.weights.publisher import gather_shards

    ctx = rank_context(rank, WORLD, port, timeout_s=60)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        shard_model(model, torch.device("cpu"), WORLD)
        if rank != 0:
            gather_shards(model.state_dict())  # version 1
            gather_shards(model.state_dict())  # the refused version 1 again: must not wait for rank 0 forever
            gather_shards(model.state_dict())  # version 2: the ranks are still in step
            Path(out, "follower.json").write_text(json.dumps({"done": True}))
            return
        with WeightPublisher() as publisher:
            publisher.publish(1, model.state_dict(), sharded=True).result(timeout=120)
            try:
                publisher.publish(1, model.state_dict(), sharded=True)
                error = ""
            except ValueError as exc:
                error = str(exc)
            manifest = publisher.publish(2, model.state_dict(), sharded=True).result(timeout=120)
        Path(out, "result.json").write_text(json.dumps({"error": error, "version": manifest.version}))
    finally:
        destroy(ctx)
        end_rank()


def test_a_refused_sharded_publish_still_takes_part_in_the_gathers(tiny_model_dir, tmp_path, free_port):
    """Rank 0's publisher refuses a version (not newer than the last) after every other rank has begun gathering
    it: it takes part in the gathers before raising, so the others finish and the next version publishes (before,
    rank 1 waited in its first all-gather until the process group's timeout)."""
    mp.spawn(_refused_worker, args=(free_port, tiny_model_dir, str(tmp_path)), nprocs=WORLD, join=True)
    result = json.loads((tmp_path / "result.json").read_text())
    assert "not newer" in result["error"] and result["version"] == 2
    assert json.loads((tmp_path / "follower.json").read_text()) == {"done": True}
