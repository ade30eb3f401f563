"""LoRA on the real tiny model (CPU, real PEFT): only the adapter trains, only the adapter is published (its bytes
are the adapter's parameters x dtype size), the reference is the base model (adapter disabled), checkpoints resume
to the same next step, and the export is a PEFT adapter (plus the merged model on request)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fleetrl import metric_names as mn
from fleetrl.commands.evaluate import servable_model
from fleetrl.rollout_group import RolloutGroup
from fleetrl.trainer import PolicyTrainer
from fleetrl.trainer.model import load_causal_lm, sequence_logprobs
from fleetrl.weights import WeightPublisher
from tests.unit.trainer.helpers import make_cfg, tiny_groups

# O = 1: the synthetic groups are all sampled from version 0, and step 2 trains some of them.
LORA = {"lora_rank": 4, "learning_rate": 1e-2, "max_head_offpolicy_versions": 1}


@pytest.fixture(scope="module")
def groups(tiny_model_dir: str) -> list[RolloutGroup]:
    return tiny_groups(tiny_model_dir, num_groups=4, group_size=4)


def _sequences(groups: list[RolloutGroup]) -> list[list[int]]:
    return [list(s.tokens) for g in groups for s in g.samples]


def _adapter_params(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}


def test_only_the_adapter_trains(tiny_model_dir, tmp_path, groups):
    trainer = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path, **LORA))
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in trainer.model.parameters() if p.requires_grad}
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    adapter_before = _adapter_params(trainer)

    trainer.train_step(groups[:2])
    for name, param in trainer.model.named_parameters():
        if name in base_before:
            assert torch.equal(param.detach(), base_before[name]), name
    moved = [n for n, t in _adapter_params(trainer).items() if not torch.equal(t, adapter_before[n])]
    assert any(".lora_B." in n for n in moved)  # B starts at 0 and leaves it: the adapter learned


def test_a_publish_carries_only_the_adapter(tiny_model_dir, tmp_path, groups):
    cfg = make_cfg(tiny_model_dir, tmp_path, **LORA)
    manifests = []
    with WeightPublisher() as publisher:

        def sink(version, state_dict, **kwargs):
            manifests.append(publisher.publish(version, state_dict, **kwargs))
            return manifests[-1]

        trainer = PolicyTrainer(cfg, weight_sink=sink)
        result = trainer.train_step(groups[:2])
    assert result.published and len(manifests) == 1
    manifest = manifests[0]
    assert trainer.last_publish is not None and trainer.last_publish.checksum == manifest.checksum
    adapter_numel = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert manifest.is_adapter
    assert manifest.total_bytes == adapter_numel * torch.float32.itemsize
    full_bytes = sum(p.numel() * p.element_size() for p in trainer.model.get_base_model().parameters())
    assert manifest.total_bytes < 0.2 * full_bytes
    names = {t.name for t in manifest.tensors}
    assert names == {n.replace(".default", "") for n in _adapter_params(trainer)}
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert manifest.adapter == trainer.adapter_config
    assert manifest.adapter["r"] == 4 and manifest.adapter["lora_alpha"] == 8  # the default alpha: 2 * rank
    assert manifest.adapter["peft_type"] == "LORA" and "q_proj" in manifest.adapter["target_modules"]
    json.dumps(manifest.adapter)


def test_a_bfloat16_run_publishes_its_adapter_in_bfloat16(tiny_model_dir, tmp_path, groups):
    """AdamW keeps float32 adapter weights (PEFT's autocast of the adapter), the push is in the trainer's dtype."""
    published = []
    cfg = make_cfg(tiny_model_dir, tmp_path, dtype="bfloat16", **LORA)
    trainer = PolicyTrainer(cfg, weight_sink=lambda v, sd, **kw: published.append(dict(sd)))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters() if p.requires_grad)
    trainer.train_step(groups[:2])
    (tensors,) = published
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    adapter_numel = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == adapter_numel * 2


def test_the_reference_is_the_base_model_with_the_adapter_disabled(tiny_model_dir, tmp_path, groups):
    trainer = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path, kl_beta=0.5, **LORA))
    first = trainer.train_step(groups[:2]).metrics
    assert first[mn.KL_REFERENCE] == 0.0  # B = 0: version 0 of a LoRA run is the base model
    second = trainer.train_step(groups[2:]).metrics
    assert second[mn.KL_REFERENCE] > 0  # the adapter moved the policy away from the reference

    sequences = _sequences(groups)
    base = load_causal_lm(tiny_model_dir, trainable=False)
    expected = sequence_logprobs(base, sequences)
    with trainer.model.disable_adapter():
        disabled = sequence_logprobs(trainer.model, sequences)
    policy = sequence_logprobs(trainer.model, sequences)
    for ours, theirs in zip(disabled, expected, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-5, rtol=0)
    assert any(
        not torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4) for a, b in zip(policy, expected, strict=True)
    )


def test_kl_uses_the_internal_reference_and_no_reference_fn(tiny_model_dir, tmp_path, groups):
    """A reference function given to a LoRA trainer is not called: the base weights are the reference."""
    calls: list[int] = []

    def ref_fn(sequences, temperature):
        calls.append(len(sequences))
        raise AssertionError("a LoRA trainer must not ask for reference logprobs")

    trainer = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path, kl_beta=0.5, **LORA), ref_logprobs_fn=ref_fn)
    trainer.train_step(groups[:2])
    with_kl = trainer.train_step(groups[2:]).metrics
    plain = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path / "plain", kl_beta=0.0, **LORA))
    plain.train_step(groups[:2])
    without_kl = plain.train_step(groups[2:]).metrics
    assert not calls
    assert with_kl[mn.LOSS] != pytest.approx(without_kl[mn.LOSS], abs=1e-7)


def test_checkpoint_resume_gives_the_same_next_step(tiny_model_dir, tmp_path, groups):
    import torch.distributed.checkpoint as dcp

    cfg = make_cfg(tiny_model_dir, tmp_path, kl_beta=0.1, **LORA)
    first = PolicyTrainer(cfg)
    first.train_step(groups[:2])
    path = first.save_checkpoint({"cursor": 2})
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)  # the frozen base is not copied into checkpoints
    assert any(k.startswith("optim.state.") and "lora_" in k for k in saved)  # AdamW moments of the adapter

    resumed = PolicyTrainer(cfg)
    assert resumed.resume() and resumed.version == 1 and resumed.state.data_position == {"cursor": 2}
    for name, value in _adapter_params(first).items():
        assert torch.equal(_adapter_params(resumed)[name], value), name
    a, b = first.train_step(groups[2:]), resumed.train_step(groups[2:])
    assert a.metrics[mn.LOSS] == b.metrics[mn.LOSS] and a.metrics[mn.GRAD_NORM] == b.metrics[mn.GRAD_NORM]
    for name, value in _adapter_params(first).items():
        assert torch.equal(_adapter_params(resumed)[name], value), name  # same optimizer state -> same update


def test_export_is_a_peft_adapter_and_optionally_merged(tiny_model_dir, tmp_path, groups):
    from peft import PeftModel

    cfg = make_cfg(tiny_model_dir, tmp_path, export_merged=True, **LORA)
    trainer = PolicyTrainer(cfg)
    trainer.train_step(groups[:2])
    _, out = trainer.finish()
    assert out == tmp_path / "final"
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == tiny_model_dir
    tensors = load_file(out / "adapter_model.safetensors")
    assert set(tensors) == {n.replace(".default", "") for n in _adapter_params(trainer)}
    assert (out / "tokenizer.json").exists()

    sequences = _sequences(groups)
    expected = sequence_logprobs(trainer.model, sequences)
    loaded = PeftModel.from_pretrained(load_causal_lm(tiny_model_dir, trainable=False), str(out))
    merged = load_causal_lm(str(out / "merged"), trainable=False)  # a plain HF model folder
    assert not hasattr(merged, "peft_config")
    for model in (loaded, merged):
        for ours, theirs in zip(sequence_logprobs(model, sequences), expected, strict=True):
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-4, rtol=0)
    # `fleetrl eval --model <final>` serves the merged model of an adapter folder.
    assert servable_model(str(out), tmp_path / "eval") == str(out / "merged")
    assert servable_model(tiny_model_dir, tmp_path / "eval") == tiny_model_dir


def test_eval_merges_an_adapter_without_a_merged_copy(tiny_model_dir, tmp_path, groups):
    trainer = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path, **LORA))
    trainer.train_step(groups[:2])
    _, out = trainer.finish()
    assert not (out / "merged").exists()
    served = servable_model(str(out), tmp_path / "eval")
    assert served == str(tmp_path / "eval" / "merged")
    sequences = _sequences(groups)
    merged = load_causal_lm(served, trainable=False)
    expected = sequence_logprobs(trainer.model, sequences)
    for ours, theirs in zip(sequence_logprobs(merged, sequences), expected, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-4, rtol=0)


def test_warm_start_from_an_adapter(tiny_model_dir, tmp_path, groups):
    first = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path / "a", **LORA))
    first.train_step(groups[:2])
    _, adapter = first.finish()
    second = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path / "b", warm_start_from_adapter=str(adapter), **LORA))
    assert second.version == 0
    for name, value in _adapter_params(first).items():
        assert torch.equal(_adapter_params(second)[name], value), name
    assert all(p.requires_grad for n, p in second.model.named_parameters() if "lora_" in n)
    second.train_step(groups[2:])  # it trains on from there
    assert any(not torch.equal(_adapter_params(second)[n], v) for n, v in _adapter_params(first).items())


@pytest.mark.parametrize("lora", [False, True])
def test_an_adapter_given_as_base_model_is_refused_naming_what_to_set(tiny_model_dir, tmp_path, groups, lora):
    # Issue 14: a PEFT adapter as base_model failed with "optimizer got an empty parameter list" (full) or a PEFT
    # NoMatchingPeftModuleError (LoRA).
    first = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path / "a", **LORA))
    _, adapter = first.finish()
    extra = LORA if lora else {}
    with pytest.raises(ValueError, match=r"base_model: .* is a PEFT adapter .*warm_start_from_adapter"):
        PolicyTrainer(make_cfg(str(adapter), tmp_path / "b", **extra))
