"""FSDP2 data parallelism on CPU: 2 ranks (gloo, torch.multiprocessing) train the same batches as 1 rank and
report the same loss, end with the same weights, and write a DCP checkpoint that 1 rank resumes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from fleetrl.rollout_group import read_groups_jsonl, write_groups_jsonl
from fleetrl.trainer import PolicyTrainer
from fleetrl.trainer.checkpoint import MANIFEST, CheckpointDamaged, checkpoint_path, resume_checkpoint
from fleetrl.trainer.distributed import destroy
from tests.integration.trainer.rank_env import end_rank, rank_context
from tests.unit.trainer.helpers import make_cfg, tiny_groups

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SETTINGS = {"num_minibatches": 2, "policy_loss": "grpo", "loss_agg_mode": "seq-mean-token-mean"}


def _worker(rank: int, world: int, port: int, model_dir: str, workdir: str) -> None:
    ctx = rank_context(rank, world, port)
    cfg = make_cfg(model_dir, f"{workdir}/fsdp", **SETTINGS)
    trainer = PolicyTrainer(cfg, dist_ctx=ctx, micro_batch_size=2)
    try:
        if rank == 0:
            groups = list(read_groups_jsonl(f"{workdir}/groups.jsonl"))
            results = [trainer.train_step(groups[:2]), trainer.train_step(groups[2:])]
            trainer.export_hf(f"{workdir}/fsdp_export")
            trainer.save_checkpoint({"cursor": 4})
            trainer.stop_followers()
            with open(f"{workdir}/fsdp_metrics.json", "w") as f:
                json.dump([r.metrics for r in results], f)
        else:
            trainer.follow()
    finally:
        destroy(ctx)
    end_rank()


def test_two_ranks_match_one_rank(tiny_model_dir, tmp_path, free_port):
    groups = tiny_groups(tiny_model_dir, num_groups=4)
    groups[0].samples.pop()  # 7 + 8 samples: uneven shards, a rank with fewer micro-batches
    write_groups_jsonl(tmp_path / "groups.jsonl", groups)
    mp.spawn(_worker, args=(2, free_port, tiny_model_dir, str(tmp_path)), nprocs=2, join=True)
    fsdp_metrics = json.loads((tmp_path / "fsdp_metrics.json").read_text())

    cfg = make_cfg(tiny_model_dir, tmp_path / "single", **SETTINGS)
    single = PolicyTrainer(cfg, micro_batch_size=2)
    single_metrics = [single.train_step(groups[:2]).metrics, single.train_step(groups[2:]).metrics]
    for ours, theirs in zip(single_metrics, fsdp_metrics, strict=True):
        keys = ("train/loss", "optim/grad_norm", "optim/entropy", "train/clip_frac", "optim/ppo_kl")
        for key in (*keys, "optim/kl_sample_train_v1"):
            assert theirs[key] == pytest.approx(ours[key], rel=1e-4, abs=1e-6), key

    exported = load_file(tmp_path / "fsdp_export" / "model.safetensors")
    config = json.loads((tmp_path / "fsdp_export" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]  # not the FSDP-wrapped class
    for name, value in single.model.state_dict().items():
        torch.testing.assert_close(exported[name], value.detach(), atol=2e-5, rtol=1e-4, msg=name)

    # The 2-rank DCP checkpoint loads into 1 rank (resharded) with its state.
    resumed = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path / "fsdp", **SETTINGS))
    assert resumed.resume() and resumed.version == 2 and resumed.state.data_position == {"cursor": 4}
    for name, value in resumed.model.state_dict().items():
        torch.testing.assert_close(value, exported[name], atol=0, rtol=0, msg=name)

    # Issue 45: rank 0 seals the checkpoint once both ranks wrote: its manifest holds both ranks' shards and RNG
    # files, and a damaged shard of rank 1 makes it untrusted (the only checkpoint: named, nothing loaded).
    checkpoint = checkpoint_path(resumed.checkpoint_dir, 2)
    listed = set(json.loads((checkpoint / MANIFEST).read_text())["files"])
    assert {"rng-rank0.json", "rng-rank1.json", "__0_0.distcp", "__1_0.distcp"} <= listed, listed
    shard = checkpoint / "__1_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    with pytest.raises(CheckpointDamaged, match=r"__1_0\.distcp"):
        resume_checkpoint(resumed.checkpoint_dir)


LORA_SETTINGS = {**SETTINGS, "lora_rank": 4, "kl_beta": 0.1, "learning_rate": 1e-2, "max_head_offpolicy_versions": 1}


def _lora_worker(rank: int, world: int, port: int, model_dir: str, workdir: str) -> None:
    from safetensors.torch import save_file

    ctx = rank_context(rank, world, port)
    published: list[tuple[int, dict, dict]] = []
    cfg = make_cfg(model_dir, f"{workdir}/fsdp", **LORA_SETTINGS)
    trainer = PolicyTrainer(
        cfg, dist_ctx=ctx, micro_batch_size=2, weight_sink=lambda v, sd, **kw: published.append((v, dict(sd), kw))
    )
    try:
        if rank == 0:
            groups = list(read_groups_jsonl(f"{workdir}/groups.jsonl"))
            results = [trainer.train_step(groups[:2]), trainer.train_step(groups[2:])]
            trainer.export_hf(f"{workdir}/fsdp_export")
            trainer.save_checkpoint({"cursor": 4})
            trainer.stop_followers()
            version, tensors, kwargs = published[-1]
            save_file(tensors, f"{workdir}/fsdp_published.safetensors")
            with open(f"{workdir}/fsdp_metrics.json", "w") as f:
                json.dump({"metrics": [r.metrics for r in results], "version": version, **kwargs}, f)
        else:
            trainer.follow()
            assert not published  # only rank 0 hands weights to the sink
    finally:
        destroy(ctx)
    end_rank()


def test_lora_two_ranks_match_one_rank(tiny_model_dir, tmp_path, free_port):
    """LoRA under FSDP2: the same losses (with the adapter-disabled reference computed across ranks), the same
    published adapter tensors and export, and a checkpoint of the adapter that 1 rank resumes."""
    from fleetrl import metric_names as mn

    groups = tiny_groups(tiny_model_dir, num_groups=4)
    groups[0].samples.pop()
    write_groups_jsonl(tmp_path / "groups.jsonl", groups)
    mp.spawn(_lora_worker, args=(2, free_port, tiny_model_dir, str(tmp_path)), nprocs=2, join=True)
    fsdp = json.loads((tmp_path / "fsdp_metrics.json").read_text())

    published: list = []
    single = PolicyTrainer(
        make_cfg(tiny_model_dir, tmp_path / "single", **LORA_SETTINGS),
        micro_batch_size=2,
        weight_sink=lambda v, sd, **kw: published.append((v, {k: t.clone() for k, t in sd.items()}, kw)),
    )
    single_metrics = [single.train_step(groups[:2]).metrics, single.train_step(groups[2:]).metrics]
    assert single_metrics[1][mn.KL_REFERENCE] > 0
    for ours, theirs in zip(single_metrics, fsdp["metrics"], strict=True):
        for key in (mn.LOSS, mn.GRAD_NORM, mn.ENTROPY, mn.KL_REFERENCE, mn.KL_SAMPLE_TRAIN):
            assert theirs[key] == pytest.approx(ours[key], rel=1e-4, abs=1e-6), key

    version, tensors, kwargs = published[-1]
    assert fsdp["version"] == version == 2 and fsdp["adapter"] == kwargs["adapter"]
    fsdp_tensors = load_file(tmp_path / "fsdp_published.safetensors")
    assert set(fsdp_tensors) == set(tensors) and all("lora_" in name for name in tensors)
    for name, value in tensors.items():
        torch.testing.assert_close(fsdp_tensors[name], value, atol=2e-5, rtol=1e-4, msg=name)

    exported = load_file(tmp_path / "fsdp_export" / "adapter_model.safetensors")
    assert json.loads((tmp_path / "fsdp_export" / "adapter_config.json").read_text())["r"] == 4
    for name, value in tensors.items():
        torch.testing.assert_close(exported[name], value, atol=2e-5, rtol=1e-4, msg=name)

    resumed = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path / "fsdp", **LORA_SETTINGS))
    assert resumed.resume() and resumed.version == 2 and resumed.state.data_position == {"cursor": 4}
    resumed_params = {n: p for n, p in resumed.model.named_parameters() if p.requires_grad}
    for name in tensors:
        param = resumed_params[name.replace(".weight", ".default.weight")]
        torch.testing.assert_close(param.detach(), exported[name], atol=0, rtol=0, msg=name)


MIXED_SETTINGS = {"compute_dtype": "bfloat16", "learning_rate": 1e-6, "grad_clip_norm": None}


def _mixed_worker(rank: int, world: int, port: int, model_dir: str, workdir: str) -> None:
    ctx = rank_context(rank, world, port)
    trainer = PolicyTrainer(make_cfg(model_dir, f"{workdir}/mixed", **MIXED_SETTINGS), dist_ctx=ctx)
    seen: list[torch.dtype] = []
    trainer.model.model.layers[0].mlp.down_proj.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    try:
        if rank == 0:
            trainer.train_step(list(read_groups_jsonl(f"{workdir}/groups.jsonl")))
            trainer.export_hf(f"{workdir}/mixed_export")
            trainer.stop_followers()
        else:
            trainer.follow()
        sharded = [p.dtype for p in trainer.model.parameters()]
        state = [t.dtype for s in trainer.optimizer.state.values() for t in s.values() if t.dim()]
        with open(f"{workdir}/mixed_{rank}.json", "w") as f:
            json.dump(
                {
                    "forward": sorted({str(d) for d in seen}),
                    "params": sorted({str(d) for d in sharded}),
                    "optimizer": sorted({str(d) for d in state}),
                },
                f,
            )
    finally:
        destroy(ctx)
    end_rank()


def test_two_ranks_train_in_mixed_precision_over_float32_shards(tiny_model_dir, tmp_path, free_port):
    """FSDP2's MixedPrecisionPolicy: forward in bfloat16, float32 shards and AdamW state, and an lr-1e-6 step that
    moves the weights (it would round away in bfloat16)."""
    write_groups_jsonl(tmp_path / "groups.jsonl", tiny_groups(tiny_model_dir, num_groups=2))
    mp.spawn(_mixed_worker, args=(2, free_port, tiny_model_dir, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"mixed_{rank}.json").read_text())
        assert seen == {"forward": ["torch.bfloat16"], "params": ["torch.float32"], "optimizer": ["torch.float32"]}
    exported = load_file(tmp_path / "mixed_export" / "model.safetensors")
    base = load_file(f"{tiny_model_dir}/model.safetensors")
    changed = sum(int((exported[n] != base[n]).sum()) for n in base)
    total = sum(t.numel() for t in base.values())
    assert exported["model.norm.weight"].dtype == torch.float32
    assert changed / total > 0.5


REF_SETTINGS = {**SETTINGS, "kl_beta": 0.1, "temperature": 0.9, "max_head_offpolicy_versions": 1}


def _ref_worker(rank: int, world: int, port: int, model_dir: str, workdir: str, placement: str) -> None:
    from fleetrl.trainer.model import load_causal_lm, sequence_logprobs

    ctx = rank_context(rank, world, port)
    ref_fn = None
    if placement == "service" and rank == 0:  # what the reference service computes, called from rank 0's thread
        frozen = load_causal_lm(model_dir, trainable=False)
        ref_fn = lambda seqs, t: sequence_logprobs(frozen, seqs, temperature=t)  # noqa: E731
    trainer = PolicyTrainer(
        make_cfg(model_dir, f"{workdir}/{placement}", **REF_SETTINGS),
        dist_ctx=ctx,
        micro_batch_size=2,
        ref_logprobs_fn=ref_fn,
        colocated_reference=placement == "colocated",
    )
    try:
        if placement == "colocated":  # sharded like the policy: this rank holds a shard only
            assert all(hasattr(p, "full_tensor") for p in trainer.reference_model.parameters())
        if rank == 0:
            groups = list(read_groups_jsonl(f"{workdir}/groups.jsonl"))
            results = [trainer.train_step(groups[:2]), trainer.train_step(groups[2:])]
            trainer.stop_followers()
            with open(f"{workdir}/{placement}_metrics.json", "w") as f:
                json.dump([r.metrics for r in results], f)
        else:
            trainer.follow()
    finally:
        destroy(ctx)
    end_rank()


@pytest.mark.parametrize("placement", ["colocated", "service"])
def test_two_ranks_get_the_reference_of_one_rank(tiny_model_dir, tmp_path, free_port, placement):
    """The KL term under FSDP2 with the reference colocated (a sharded frozen copy) or from a service (rank 0
    scatters each rank's share once the step is under way) equals one process's."""
    from fleetrl import metric_names as mn
    from fleetrl.trainer.model import load_causal_lm, sequence_logprobs

    groups = tiny_groups(tiny_model_dir, num_groups=4, temperature=0.9)
    groups[0].samples.pop()
    write_groups_jsonl(tmp_path / "groups.jsonl", groups)
    mp.spawn(_ref_worker, args=(2, free_port, tiny_model_dir, str(tmp_path), placement), nprocs=2, join=True)
    theirs_all = json.loads((tmp_path / f"{placement}_metrics.json").read_text())
    frozen = load_causal_lm(tiny_model_dir, trainable=False)
    single = PolicyTrainer(
        make_cfg(tiny_model_dir, tmp_path / "single", **REF_SETTINGS),
        micro_batch_size=2,
        ref_logprobs_fn=lambda seqs, t: sequence_logprobs(frozen, seqs, temperature=t),
    )
    ours_all = [single.train_step(groups[:2]).metrics, single.train_step(groups[2:]).metrics]
    assert ours_all[1][mn.KL_REFERENCE] > 0
    for ours, theirs in zip(ours_all, theirs_all, strict=True):
        for key in (mn.LOSS, mn.GRAD_NORM, mn.KL_REFERENCE):
            assert theirs[key] == pytest.approx(ours[key], rel=1e-4, abs=1e-6), key


MEMORY_OPTIONS = {
    "baseline": {},
    "cpu_offload": {"fsdp_cpu_offload": True},
    "bf16_moments": {"optimizer_state_dtype": "bfloat16"},
}


def _memory_worker(rank: int, world: int, port: int, model_dir: str, workdir: str, option: str) -> None:
    ctx = rank_context(rank, world, port)
    cfg = make_cfg(model_dir, f"{workdir}/{option}", **SETTINGS, **MEMORY_OPTIONS[option])
    trainer = PolicyTrainer(cfg, dist_ctx=ctx, micro_batch_size=2)
    try:
        state = trainer.model._get_fsdp_state()._fsdp_param_group  # FSDP2's own record of the policy it applies
        seen = {"offload": type(state.offload_policy).__name__}
        if rank == 0:
            groups = list(read_groups_jsonl(f"{workdir}/groups.jsonl"))
            results = [trainer.train_step(groups[:2]), trainer.train_step(groups[2:])]
            moments = {str(s["exp_avg"].dtype) for s in trainer.optimizer.state.values()}
            trainer.export_hf(f"{workdir}/{option}_export")
            trainer.stop_followers()
            seen |= {"moments": sorted(moments), "losses": [r.metrics["train/loss"] for r in results]}
            with open(f"{workdir}/{option}.json", "w") as f:
                json.dump(seen, f)
        else:
            trainer.follow()
    finally:
        destroy(ctx)
    end_rank()


def test_cpu_offload_and_bfloat16_moments_train_like_the_default_on_two_ranks(tiny_model_dir, tmp_path, free_port):
    """The 70B options (issue 40 item 3): FSDP2's CPUOffloadPolicy gives the same steps as the default (the same
    update, run in host memory), and bfloat16 AdamW moments over float32 shards move the weights the same way
    (cosine similarity of the two runs' updates > 0.99) with bfloat16 moments."""
    write_groups_jsonl(tmp_path / "groups.jsonl", tiny_groups(tiny_model_dir, num_groups=4))
    for option in MEMORY_OPTIONS:
        mp.spawn(_memory_worker, args=(2, free_port, tiny_model_dir, str(tmp_path), option), nprocs=2, join=True)
    seen = {option: json.loads((tmp_path / f"{option}.json").read_text()) for option in MEMORY_OPTIONS}
    assert seen["baseline"]["offload"] == "OffloadPolicy" and seen["cpu_offload"]["offload"] == "CPUOffloadPolicy"
    assert seen["baseline"]["moments"] == ["torch.float32"] and seen["bf16_moments"]["moments"] == ["torch.bfloat16"]
    assert seen["cpu_offload"]["losses"] == pytest.approx(seen["baseline"]["losses"], rel=1e-5)
    # step 1 has two minibatches: its mean loss sees one update in each moment dtype
    assert seen["bf16_moments"]["losses"][0] == pytest.approx(seen["baseline"]["losses"][0], rel=1e-4)
    base = load_file(f"{tiny_model_dir}/model.safetensors")

    def update(option: str) -> torch.Tensor:
        exported = load_file(tmp_path / f"{option}_export" / "model.safetensors")
        return torch.cat([(exported[n].float() - base[n].float()).flatten() for n in sorted(base)])

    reference = update("baseline")
    assert torch.allclose(update("cpu_offload"), reference, atol=1e-6)
    cosine = torch.nn.functional.cosine_similarity(update("bf16_moments"), reference, dim=0)
    assert cosine > 0.99, float(cosine)


def _export_worker(rank: int, world: int, port: int, model_dir: str, workdir: str) -> None:
    ctx = rank_context(rank, world, port)
    trainer = PolicyTrainer(make_cfg(model_dir, f"{workdir}/export", **SETTINGS), dist_ctx=ctx, micro_batch_size=2)
    try:
        if rank == 0:
            groups = list(read_groups_jsonl(f"{workdir}/groups.jsonl"))
            trainer.train_step(groups[:2])
            trainer.export_hf(f"{workdir}/export_fp32")
            trainer.export_hf(f"{workdir}/export_bf16", dtype="bfloat16")
            trainer.stop_followers()
        else:
            trainer.follow()
    finally:
        destroy(ctx)
    end_rank()


def test_two_ranks_export_bfloat16_from_their_own_shards(tiny_model_dir, tmp_path, free_port):
    """The HF export at world size > 1 goes through torch.distributed.checkpoint's HF writer (each rank writes its
    shards, rank 0 consolidates from disk): a bfloat16 export loads in transformers with the float32 export's logits
    up to bfloat16 rounding, and leaves no shard folder behind."""
    from transformers import AutoModelForCausalLM

    write_groups_jsonl(tmp_path / "groups.jsonl", tiny_groups(tiny_model_dir, num_groups=2))
    mp.spawn(_export_worker, args=(2, free_port, tiny_model_dir, str(tmp_path)), nprocs=2, join=True)
    bf16 = load_file(tmp_path / "export_bf16" / "model.safetensors")
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
    assert not (tmp_path / "export_bf16" / "sharded").exists()
    models = {
        name: AutoModelForCausalLM.from_pretrained(tmp_path / f"export_{name}", dtype=torch.float32)
        for name in ("fp32", "bf16")
    }
    assert json.loads((tmp_path / "export_bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    tokens = torch.tensor([[1, 5, 9, 14, 3, 7]])
    logits = {name: model(input_ids=tokens).logits for name, model in models.items()}
    assert torch.allclose(logits["bf16"], logits["fp32"], atol=5e-2, rtol=5e-2)
    assert not torch.equal(logits["bf16"], logits["fp32"])  # it really is the bf16 copy
