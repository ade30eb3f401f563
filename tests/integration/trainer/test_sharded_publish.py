"""The trainer publishes at world size 2 without a full state dict (issue 39 item 2): two gloo ranks train two steps,
each step's version reaches rank 0's `WeightPublisher` gathered shard by shard (`publish(..., sharded=True)` on
rank 0, `gather_shards` on rank 1, cast to inference_dtype on the device), and a replica's fetch of it has exactly
the bytes of the sharded HF export of the same weights (every rank's own shards, cast to the same dtype: no gather
at all). `full_state_dict` (the whole model in float32 in rank 0's host memory) is a tripwire in both ranks: the
publish path must not call it. The service wires its publisher the same way (services/trainer/server.py)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from fleetrl.rollout_group import read_groups_jsonl, write_groups_jsonl
from fleetrl.trainer import PolicyTrainer
from fleetrl.trainer import distributed as fdist
from fleetrl.weights.manifest import tensor_bytes
from tests.integration.trainer.rank_env import end_rank, rank_context
from tests.unit.trainer.helpers import make_cfg, tiny_groups

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WORLD = 2


def _no_full_gather(*args: object, **kwargs: object) -> None:
    raise AssertionError("full_state_dict called: the publish gathered the whole model")


def _worker(rank: int, port: int, model_dir: str, workdir: str, inference_dtype: str) -> None:
    from fleetrl.weights import WeightPublisher, fetch_weights

    ctx = rank_context(rank, WORLD, port)
    fdist.full_state_dict = _no_full_gather  # type: ignore[assignment]
    cfg = make_cfg(model_dir, f"{workdir}/run", inference_dtype=inference_dtype, weight_sync_interval=1)
    publisher = WeightPublisher() if rank == 0 else None
    sink = functools.partial(publisher.publish, background=True) if publisher is not None else None
    trainer = PolicyTrainer(cfg, dist_ctx=ctx, micro_batch_size=2, weight_sink=sink)
    try:
        if rank != 0:
            trainer.follow()
            return
        groups = list(read_groups_jsonl(f"{workdir}/groups.jsonl"))
        published = [trainer.train_step(groups[:2]).published, trainer.train_step(groups[2:]).published]
        info = trainer.publish()  # the Publish RPC's call: waits for the staged version's checksum
        fetched = {v: fetch_weights(publisher.address, v)[1] for v in (1, 2)}
        trainer.export_hf(f"{workdir}/export")
        trainer.stop_followers()
        exported = load_file(f"{workdir}/export/model.safetensors")
        mismatched = [
            name
            for name, want in exported.items()
            if name not in fetched[2]
            or fetched[2][name].dtype != want.dtype
            or bytes(tensor_bytes(fetched[2][name])) != bytes(tensor_bytes(want.contiguous()))
        ]
        result = {
            "published": published,
            "checksum": info.checksum,
            "mismatched": mismatched,
            "missing": sorted(set(fetched[2]) - set(exported) - {"lm_head.weight"}),
            "dtypes": sorted({str(t.dtype) for t in fetched[2].values()}),
            "changed": [n for n, t in fetched[2].items() if not torch.equal(t, fetched[1][n])],
        }
        Path(workdir, "result.json").write_text(json.dumps(result))
    finally:
        if publisher is not None:
            publisher.close()
        fdist.destroy(ctx)
    end_rank()


@pytest.mark.parametrize("inference_dtype", ["float32", "bfloat16"])
def test_two_ranks_publish_each_version_shard_by_shard_with_the_exports_bytes(
    tiny_model_dir, tmp_path, free_port, inference_dtype
):
    write_groups_jsonl(tmp_path / "groups.jsonl", tiny_groups(tiny_model_dir, num_groups=4))
    mp.spawn(_worker, args=(free_port, tiny_model_dir, str(tmp_path), inference_dtype), nprocs=WORLD, join=True)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["published"] == [True, True] and result["checksum"]
    assert result["mismatched"] == [] and result["missing"] == []
    assert result["dtypes"] == [f"torch.{inference_dtype}"]
    assert result["changed"]  # version 2 is not version 1 again
