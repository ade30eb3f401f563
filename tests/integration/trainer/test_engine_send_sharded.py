"""A sharded trainer sends through the "fleetrl_gloo" engine (issue 39 items 2 and 3): two FSDP2 gloo ranks run
`GlooTrainerWeightTransferEngine` (created through vLLM's `WeightTransferTrainerFactory.trainer_init`) over the
model's `ShardedWeights`, rank 0 the sender and rank 1 only taking part in each tensor's gather, to a receiver
process running the worker engine's receive loop (`receive_buckets`) into its own state dict. Two versions go
through one group; each arrives with exactly the bytes of the full state dict in bfloat16 (`full_state_dict`,
computed apart for the comparison), the receiver never holding more than one bucket (or one larger tensor)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from fleetrl.trainer.distributed import destroy, full_state_dict, shard_model
from tests.integration.trainer.rank_env import end_rank, rank_context

pytest.importorskip("vllm")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WORLD = 2
BUCKET_BYTES = 64 << 10  # the tiny model's 280 KB in bfloat16 travel in several buckets
VERSIONS = (1, 2)


def _receiver(conn: Any, out: str) -> None:
    """The replica: joins the group when told, receives each version bucket by bucket, saves what it got."""
    from safetensors.torch import save_file

    from fleetrl.weights.vllm_gloo import GlooInitInfo, GlooUpdateInfo, _join, receive_buckets

    info = GlooInitInfo(**conn.recv())
    group, _store = _join(info, info.rank_offset)
    conn.send("joined")
    stats = type("Stats", (), {"peak_bucket_bytes": 0})()
    for _ in VERSIONS:
        update = GlooUpdateInfo(**conn.recv())
        got: dict[str, torch.Tensor] = {}

        def load(pairs: list, into: dict = got) -> None:
            into.update({n: t.clone() for n, t in pairs})

        receive_buckets(group, info, update.metas(), load, stats)
        save_file(got, str(Path(out, f"got-{update.version}.safetensors")))
        conn.send("done")
    Path(out, "receiver.json").write_text(json.dumps({"peak_bucket_bytes": stats.peak_bucket_bytes}))


class _PipeClient:
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.conn.send(init_info)
        assert self.conn.poll(120) and self.conn.recv() == "joined"

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: Any) -> None:
        self.conn.send({k: update_info[k] for k in ("names", "dtype_names", "shapes", "version")})
        assert self.conn.poll(120) and self.conn.recv() == "done"

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


def _rank(rank: int, port: int, model_dir: str, out: str, conn: Any) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from fleetrl.weights.gather import ShardedWeights
    from fleetrl.weights.vllm_gloo import GlooTrainerInitInfo

    ctx = rank_context(rank, WORLD, port)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        shard_model(model, torch.device("cpu"), WORLD)
        info = GlooTrainerInitInfo("127.0.0.1", 0, 2, bucket_bytes=BUCKET_BYTES, timeout_s=60.0, rank=rank)
        client = _PipeClient(conn) if rank == 0 else None
        source = ShardedWeights(model.state_dict(), torch.bfloat16)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        for version in VERSIONS:
            with torch.no_grad():  # an optimizer step: new values in the same shards
                for i, p in enumerate(model.parameters()):
                    p.add_(0.001 * (i + version))
            engine.version = version
            engine.send_weights()
            full = full_state_dict(model, ctx)  # apart, for the comparison only
            want = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in full.items()}
            if rank == 0:
                save_file({n: t.contiguous() for n, t in want.items()}, str(Path(out, f"want-{version}.safetensors")))
        engine.shutdown()
    finally:
        destroy(ctx)
        end_rank()


def test_two_sharded_ranks_send_two_versions_through_one_group_with_the_full_state_dicts_bytes(
    tiny_model_dir, tmp_path, free_port
):
    from safetensors.torch import load_file

    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe()
    receiver = context.Process(target=_receiver, args=(child, str(tmp_path)))
    receiver.start()
    try:
        mp.spawn(_rank, args=(free_port, tiny_model_dir, str(tmp_path), conn), nprocs=WORLD, join=True)
    finally:
        receiver.join(60)
    assert receiver.exitcode == 0
    for version in VERSIONS:
        want = load_file(tmp_path / f"want-{version}.safetensors")
        got = load_file(tmp_path / f"got-{version}.safetensors")
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (version, name)
    peak = json.loads((tmp_path / "receiver.json").read_text())["peak_bucket_bytes"]
    sizes = [t.numel() * t.element_size() for t in load_file(tmp_path / "want-1.safetensors").values()]
    assert 0 < peak <= max(BUCKET_BYTES, *sizes) < sum(sizes)  # a bucket (or one tensor), never the whole version
