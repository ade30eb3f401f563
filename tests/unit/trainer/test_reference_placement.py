"""The KL reference where the policy is: a colocated frozen copy (the trainer's device and compute dtype, same
micro-batches), and a reference service whose forward overlaps the step instead of being awaited before it."""

from __future__ import annotations

import threading

import pytest
import torch

from fleetrl import metric_names as mn
from fleetrl.trainer import PolicyTrainer
from fleetrl.trainer.model import load_causal_lm, sequence_logprobs
from tests.unit.trainer.helpers import make_cfg, tiny_groups

KL = {"kl_beta": 0.1, "temperature": 0.9}


def _service_like(model_dir: str):
    """What the reference service computes (the base model's logprobs), as a plain function."""
    model = load_causal_lm(model_dir, trainable=False)

    def ref(sequences, temperature):
        return sequence_logprobs(model, sequences, temperature=temperature)

    return ref


def test_the_colocated_reference_gives_the_services_kl(tiny_model_dir, tmp_path):
    groups = [tiny_groups(tiny_model_dir, num_groups=2, temperature=0.9, seed=s, first_row_id=10 * s) for s in (1, 2)]
    colocated = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path / "colocated", **KL), colocated_reference=True)
    service = PolicyTrainer(
        make_cfg(tiny_model_dir, tmp_path / "service", **KL), ref_logprobs_fn=_service_like(tiny_model_dir)
    )
    ref = colocated.reference_model
    assert ref is not None and service.reference_model is None
    assert not any(p.requires_grad for p in ref.parameters())
    assert all(p.dtype == torch.float32 for p in ref.parameters())  # the compute dtype on CPU
    optimized = {id(p) for g in colocated.optimizer.param_groups for p in g["params"]}
    assert not optimized & {id(p) for p in ref.parameters()}
    for step, batch in enumerate(groups, start=1):
        ours, theirs = colocated.train_step(batch).metrics, service.train_step(batch).metrics
        if step == 1:
            assert ours[mn.KL_REFERENCE] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any update
        else:
            assert ours[mn.KL_REFERENCE] > 1e-6
        for key in (mn.LOSS, mn.KL_REFERENCE, mn.GRAD_NORM):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (step, key)
        assert ours["perf/ref_forward_time"] > 0 and ours["perf/ref_wait_time"] == 0.0
    colocated.close()
    service.close()


def test_the_colocated_reference_is_in_the_compute_dtype(tiny_model_dir, tmp_path):
    trainer = PolicyTrainer(
        make_cfg(tiny_model_dir, tmp_path, compute_dtype="bfloat16", **KL), colocated_reference=True
    )
    assert all(p.dtype == torch.bfloat16 for p in trainer.reference_model.parameters())
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    metrics = trainer.train_step(tiny_groups(tiny_model_dir, num_groups=2, temperature=0.9)).metrics
    assert abs(metrics[mn.KL_REFERENCE]) < 1e-3  # bf16 forward of the same weights on both sides
    trainer.close()


def test_no_colocated_copy_without_kl_or_with_lora(tiny_model_dir, tmp_path):
    assert PolicyTrainer(make_cfg(tiny_model_dir, tmp_path / "a"), colocated_reference=True).reference_model is None


@pytest.mark.parametrize("minibatches", [1, 2])
def test_the_reference_service_computes_while_the_step_runs(tiny_model_dir, tmp_path, minibatches):
    """The reference cannot answer until the policy's forward has started: a step that awaited it first would
    wait for ever (here: until the reference gives up and the step fails)."""
    forward_started = threading.Event()
    service = _service_like(tiny_model_dir)

    def slow_reference(sequences, temperature):
        if not forward_started.wait(60.0):
            raise TimeoutError("the step never started its forward while the reference computed")
        return service(sequences, temperature)

    cfg = make_cfg(tiny_model_dir, tmp_path, num_minibatches=minibatches, **KL)
    trainer = PolicyTrainer(cfg, ref_logprobs_fn=slow_reference)
    hook = trainer.model.model.layers[0].register_forward_pre_hook(lambda *_: forward_started.set())
    metrics = trainer.train_step(tiny_groups(tiny_model_dir, num_groups=2, temperature=0.9)).metrics
    hook.remove()
    assert forward_started.is_set()
    if minibatches == 1:  # (with two, the second minibatch runs after an update and has left the reference)
        assert metrics[mn.KL_REFERENCE] == pytest.approx(0.0, abs=1e-6)
    assert metrics["perf/ref_wait_time"] >= 0.0
    trainer.close()
