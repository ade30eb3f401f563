"""PolicyTrainer on the real tiny model (CPU): losses go down, gradients are the policy gradient, splitting a
batch changes nothing, rows are never trained twice, versions and publishing follow the intervals."""

from __future__ import annotations

import math

import pytest
import torch

from fleetrl.losses import LOSS_NAMES
from fleetrl.rollout import RolloutSample
from fleetrl.rollout_group import RolloutGroup
from fleetrl.trainer import PolicyTrainer, StepError
from fleetrl.trainer.datum import build_datum
from fleetrl.trainer.model import load_causal_lm, sequence_logprobs
from fleetrl.trainer.step_batch import build_step_batch
from tests.unit.trainer.helpers import make_cfg, tiny_groups


@pytest.fixture(scope="module")
def groups(tiny_model_dir: str) -> list[RolloutGroup]:
    return tiny_groups(tiny_model_dir, num_groups=2, group_size=4)


@pytest.fixture(scope="module")
def ref_fn(tiny_model_dir: str):
    """Reference logprobs from a frozen copy of the base model (what the reference service computes)."""
    frozen = load_causal_lm(tiny_model_dir, trainable=False)
    return lambda sequences, temperature: sequence_logprobs(frozen, sequences, temperature=temperature)


def _batch_inputs(groups: list[RolloutGroup], mode: str = "standardize"):
    batch = build_step_batch(groups, advantage_mode=mode)
    datums = [build_datum(s) for s in batch.samples]
    return datums, torch.tensor(batch.advantages), list(range(len(datums)))


@pytest.mark.parametrize("loss_name", LOSS_NAMES)
def test_one_step_on_a_fixed_batch_decreases_the_loss(loss_name, tiny_model_dir, tmp_path, groups, ref_fn):
    kl_beta = 0.05 if loss_name == "grpo" else 0.0
    cfg = make_cfg(tiny_model_dir, tmp_path, policy_loss=loss_name, kl_beta=kl_beta, learning_rate=1e-4)
    trainer = PolicyTrainer(cfg, ref_logprobs_fn=ref_fn if kl_beta else None)
    datums, advantages, rows = _batch_inputs(groups)
    old = trainer.loop.compute_logprobs(datums, [rows])  # the policy before the step = old_logprobs of the step
    ref_by_sample = [old[i] for i in rows] if kl_beta else None

    before = trainer.loop.accumulate_gradients(datums, advantages, rows, old=old, ref_by_sample=ref_by_sample)["_loss"]
    trainer.model.zero_grad(set_to_none=True)
    result = trainer.train_step(groups)
    if loss_name == "cispo":
        # CISPO's coefficient sg(clip(r)) is a constant of the step, so the objective the step descends
        # is -c0*A*pi*w with c0 = clip(1) = 1 before the step: the reinforce form (w = 1 here, since the
        # rollout logprobs are the base model's). Re-evaluating with a new c is a different function.
        trainer.loop.loss_name = "reinforce"
    after = trainer.loop.accumulate_gradients(datums, advantages, rows, old=old, ref_by_sample=ref_by_sample)["_loss"]

    assert math.isclose(result.metrics["train/loss"], before, rel_tol=1e-4, abs_tol=1e-6)
    assert after < before - 1e-5, f"{loss_name}: loss {before:.6f} -> {after:.6f}"
    if kl_beta:
        assert result.metrics["train/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 1


def test_reinforce_gradient_is_the_hand_derived_policy_gradient(tiny_model_dir, tmp_path):
    """Two samples [a, b_i], mask [0, 1], rewards [1, 0] -> A = [+1/sqrt2, -1/sqrt2]. With token-mean,
    L = -(1/2) sum_i A_i log softmax(W h / tau)[b_i], h the final hidden state after `a`. Since
    sum_i A_i = 0 the softmax terms cancel: dL/dW = -(1/2) sum_i A_i e_{b_i} h^T / tau, i.e. only rows
    b_1, b_2 of the LM head get a gradient, -A_i h / (2 tau)."""
    tau = 0.7
    cfg = make_cfg(tiny_model_dir, tmp_path, policy_loss="reinforce", temperature=tau)
    trainer = PolicyTrainer(cfg)
    a, b1, b2 = 17, 42, 99
    samples = [
        RolloutSample(tokens=[a, b], logprobs=[0.0, -1.0], loss_mask=[0, 1], reward=r)
        for b, r in ((b1, 1.0), (b2, 0.0))
    ]
    datums, advantages, rows = _batch_inputs([RolloutGroup(0, 0, samples)])
    assert advantages.tolist() == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], abs=1e-6)

    trainer.loop.accumulate_gradients(datums, advantages, rows)
    grad_W = trainer.model.get_output_embeddings().weight.grad

    with torch.no_grad():
        h = trainer.model.model(input_ids=torch.tensor([[a]])).last_hidden_state[0, 0]
    expected = torch.zeros_like(grad_W)
    expected[b1] = -advantages[0] * h / (2 * tau)
    expected[b2] = -advantages[1] * h / (2 * tau)
    torch.testing.assert_close(grad_W, expected, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_give_the_gradient_of_the_whole_batch(agg, tiny_model_dir, tmp_path, groups):
    grads = []
    for micro in (None, 3):
        cfg = make_cfg(tiny_model_dir, tmp_path, policy_loss="grpo", loss_agg_mode=agg)
        trainer = PolicyTrainer(cfg, micro_batch_size=micro)
        datums, advantages, rows = _batch_inputs(groups)
        out = trainer.loop.accumulate_gradients(datums, advantages, rows)
        grads.append((out["_loss"], [p.grad.clone() for p in trainer.model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = grads
    assert loss_a == pytest.approx(loss_b, rel=1e-5, abs=1e-6)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-4)


def test_ppo_inner_loop_takes_num_minibatches_steps_from_fixed_old_logprobs(tiny_model_dir, tmp_path, groups):
    cfg = make_cfg(tiny_model_dir, tmp_path, policy_loss="ppo", num_minibatches=2, lr_warmup_steps=4)
    trainer = PolicyTrainer(cfg)
    result = trainer.train_step(groups)
    assert result.metrics["optim/steps"] == 2
    assert trainer.state.optimizer_steps == 2
    # The second minibatch ran after one update, so its ratios moved away from 1: old was not recomputed.
    assert result.metrics["optim/ppo_kl"] != 0.0
    # Linear warmup over 4 optimizer steps: the last step used lr * 2/4, the next uses 3/4.
    assert trainer.scheduler.get_last_lr()[0] == pytest.approx(cfg.learning_rate * 3 / 4)


def test_rows_are_never_trained_twice_and_steps_are_ordered(tiny_model_dir, tmp_path, groups):
    published, ready = [], []
    cfg = make_cfg(tiny_model_dir, tmp_path, weight_sync_interval=2, max_head_offpolicy_versions=1)
    trainer = PolicyTrainer(
        cfg, weight_sink=lambda v, sd: published.append((v, len(sd))), on_version_ready=ready.append
    )
    first = trainer.train_step(groups[:1], step=1)
    assert (first.version, first.row_ids, first.published) == (1, [groups[0].row_id], False)
    with pytest.raises(StepError, match="out of order"):
        trainer.train_step(groups[1:], step=3)
    second = trainer.train_step(groups, step=2)  # row 0 again: skipped, row 1 trained
    assert second.row_ids == [groups[1].row_id]
    assert second.skipped_row_ids == [groups[0].row_id]
    assert second.published and published == [(2, len(trainer.model.state_dict()))] and ready == [2]
    retry = trainer.train_step(groups, step=2)
    assert retry.already_trained and retry.metrics == second.metrics and trainer.version == 2


def test_a_group_of_one_valid_sample_is_skipped_not_fatal(tiny_model_dir, tmp_path, groups):
    trainer = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path))
    lonely = RolloutGroup(99, 0, groups[0].samples[:1])
    result = trainer.train_step([lonely])
    assert result.version == 1 and result.skipped_row_ids == [99] and result.metrics["train/empty_step"] == 1.0
    assert trainer.is_trained(99)


def test_bfloat16_with_gradient_checkpointing_trains(tiny_model_dir, tmp_path, groups):
    cfg = make_cfg(tiny_model_dir, tmp_path, dtype="bfloat16", gradient_checkpointing=True)
    trainer = PolicyTrainer(cfg)
    assert next(trainer.model.parameters()).dtype == torch.bfloat16
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    result = trainer.train_step(groups)
    assert math.isfinite(result.metrics["train/loss"]) and math.isfinite(result.metrics["optim/grad_norm"])
    changed = [k for k, v in trainer.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "no parameter moved"


def test_checkpoint_restores_state_rows_and_optimizer(tiny_model_dir, tmp_path, groups):
    cfg = make_cfg(tiny_model_dir, tmp_path, lr_schedule="cosine", max_steps=4)
    trainer = PolicyTrainer(cfg)
    trainer.train_step(groups[:1], data_position={"cursor": 1})
    path = trainer.save_checkpoint()
    resumed = PolicyTrainer(cfg)
    assert resumed.resume() is True
    assert resumed.state.steps_done == 1 and resumed.state.data_position == {"cursor": 1}
    assert resumed.is_trained(groups[0].row_id) and path.name == "step-00000001"
    assert resumed.scheduler.state_dict()["last_epoch"] == trainer.scheduler.state_dict()["last_epoch"]
    for key, value in trainer.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[key], value, atol=0, rtol=0)
    exp_avg = {k: v["exp_avg"] for k, v in trainer.optimizer.state_dict()["state"].items()}
    for k, v in resumed.optimizer.state_dict()["state"].items():
        torch.testing.assert_close(v["exp_avg"], exp_avg[k], atol=0, rtol=0)
    # The next step continues identically in both.
    a, b = trainer.train_step(groups[1:]), resumed.train_step(groups[1:])
    assert a.metrics["train/loss"] == pytest.approx(b.metrics["train/loss"], rel=1e-6)


def test_every_log_samples_interval_steps_a_few_decoded_samples_come_with_the_result(tiny_model_dir, tmp_path):
    cfg = make_cfg(tiny_model_dir, tmp_path, log_samples_interval=2, log_samples_count=3)
    trainer = PolicyTrainer(cfg)
    groups = tiny_groups(tiny_model_dir, num_groups=4, group_size=4)
    assert trainer.train_step(groups[:2]).samples == []  # step 1: not due
    result = trainer.train_step(groups[2:])
    assert [s.row_id for s in result.samples] == [groups[2].row_id, groups[3].row_id, groups[2].row_id]
    first, sample = result.samples[0], groups[2].samples[0]
    prompt_len = sample.loss_mask.index(1)
    assert first.prompt == trainer.tokenizer.decode(sample.tokens[:prompt_len], skip_special_tokens=True)
    assert first.completion == trainer.tokenizer.decode(sample.tokens[prompt_len:], skip_special_tokens=True)
    assert (first.step, first.reward, first.version_offset) == (2, sample.reward, 1 - groups[2].submit_version)


@pytest.mark.parametrize(
    ("inference_dtype", "expected"),
    [(None, {}), ("float32", {}), ("bfloat16", {"float_dtype": torch.bfloat16})],
)
def test_weights_are_published_in_the_dtype_the_replicas_serve(
    tiny_model_dir, tmp_path, groups, inference_dtype, expected
):
    """inference_dtype = bfloat16 on a float32 trainer: the publisher is asked to cast floating tensors (one copy, in
    its snapshot); unset or equal to the trainer's dtype, nothing is cast."""
    calls = []
    cfg = make_cfg(tiny_model_dir, tmp_path, inference_dtype=inference_dtype)
    trainer = PolicyTrainer(cfg, weight_sink=lambda v, sd, **kw: calls.append(kw))
    assert trainer.train_step(groups, step=1).published
    assert calls == [expected]


def test_a_background_publish_serves_the_step_and_publish_gives_its_checksum(tiny_model_dir, tmp_path, groups):
    """weight_sink = publish(background=True) (the trainer service's): the step does not wait for the cast and
    checksums; the version is fetchable right away with the weights of that step, and publish() (the Publish RPC)
    waits for the staged version's checksum."""
    import functools

    from fleetrl.weights import WeightPublisher, fetch_weights

    cfg = make_cfg(tiny_model_dir, tmp_path, inference_dtype="bfloat16")
    with WeightPublisher() as publisher:
        trainer = PolicyTrainer(cfg, weight_sink=functools.partial(publisher.publish, background=True))
        assert trainer.train_step(groups, step=1).published
        want = {k: v.detach().to(torch.bfloat16) for k, v in trainer.model.state_dict().items()}
        manifest, got = fetch_weights(publisher.address, 1, timeout_s=60)
        assert trainer.publish().checksum == manifest.checksum != ""
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
