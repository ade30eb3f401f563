"""HSDP on CPU: 4 gloo ranks laid out as 2 "nodes" x 2 ranks (torchrun's LOCAL_WORLD_SIZE = 2) shard within a node
and replicate across nodes (a 2-D device mesh); they train the same batches as 1 rank to the same weights, and the
checkpoint they write resumes on 1 rank."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from fleetrl.rollout_group import read_groups_jsonl, write_groups_jsonl
from fleetrl.trainer import DistContext, PolicyTrainer
from fleetrl.trainer.distributed import destroy
from tests.integration.trainer.rank_env import end_rank
from tests.unit.trainer.helpers import make_cfg, tiny_groups

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SETTINGS = {"num_minibatches": 2, "policy_loss": "grpo", "loss_agg_mode": "seq-mean-token-mean"}
WORLD, LOCAL = 4, 2


def _worker(rank: int, port: int, model_dir: str, workdir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank % LOCAL),
        LOCAL_WORLD_SIZE=str(LOCAL),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    ctx = DistContext.from_env(device="cpu", timeout_s=120, sharding="hsdp")
    trainer = PolicyTrainer(make_cfg(model_dir, f"{workdir}/hsdp", **SETTINGS), dist_ctx=ctx, micro_batch_size=2)
    try:
        param = next(trainer.model.parameters())
        layout = {"mesh": list(param.device_mesh.shape), "placements": [repr(p) for p in param.placements]}
        if rank == 0:
            groups = list(read_groups_jsonl(f"{workdir}/groups.jsonl"))
            results = [trainer.train_step(groups[:2]), trainer.train_step(groups[2:])]
            trainer.export_hf(f"{workdir}/hsdp_export")
            trainer.save_checkpoint({"cursor": 4})
            trainer.stop_followers()
            with open(f"{workdir}/hsdp_metrics.json", "w") as f:
                json.dump({"metrics": [r.metrics for r in results], **layout}, f)
        else:
            trainer.follow()
    finally:
        destroy(ctx)
    end_rank()


def test_hsdp_on_two_nodes_of_two_ranks_matches_one_rank(tiny_model_dir, tmp_path, free_port):
    groups = tiny_groups(tiny_model_dir, num_groups=4)
    write_groups_jsonl(tmp_path / "groups.jsonl", groups)
    mp.spawn(_worker, args=(free_port, tiny_model_dir, str(tmp_path)), nprocs=WORLD, join=True)
    hsdp = json.loads((tmp_path / "hsdp_metrics.json").read_text())
    assert hsdp["mesh"] == [2, 2] and hsdp["placements"] == ["Replicate()", "Shard(dim=0)"]

    single = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path / "single", **SETTINGS), micro_batch_size=2)
    single_metrics = [single.train_step(groups[:2]).metrics, single.train_step(groups[2:]).metrics]
    for ours, theirs in zip(single_metrics, hsdp["metrics"], strict=True):
        for key in ("train/loss", "optim/grad_norm", "optim/entropy", "optim/kl_sample_train_v1"):
            assert theirs[key] == pytest.approx(ours[key], rel=1e-4, abs=1e-6), key

    exported = load_file(tmp_path / "hsdp_export" / "model.safetensors")
    for name, value in single.model.state_dict().items():
        torch.testing.assert_close(exported[name], value.detach(), atol=2e-5, rtol=1e-4, msg=name)

    # The HSDP checkpoint (Replicate x Shard DTensors) loads into 1 rank with its state.
    resumed = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path / "hsdp", **SETTINGS))
    assert resumed.resume() and resumed.version == 2 and resumed.state.data_position == {"cursor": 4}
    for name, value in resumed.model.state_dict().items():
        torch.testing.assert_close(value, exported[name], atol=0, rtol=0, msg=name)
