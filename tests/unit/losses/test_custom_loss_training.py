"""A custom loss in PolicyTrainer on the real tiny model (CPU): a copy of grpo trains exactly as `grpo`, the per-token
versions of the samples reach the loss, a loss that aggregates itself trains as the built-in it copies, and a bad
loss stops the trainer at start naming `policy_loss`."""

from __future__ import annotations

import pytest
import torch

from fleetrl.rollout_group import RolloutGroup
from fleetrl.trainer import PolicyTrainer
from fleetrl.trainer.datum import build_datum
from fleetrl.trainer.model import load_causal_lm, sequence_logprobs
from fleetrl.trainer.step_batch import build_step_batch
from tests.unit.losses import custom_losses
from tests.unit.trainer.helpers import make_cfg, tiny_groups

PATH = "tests.unit.losses.custom_losses"


@pytest.fixture(scope="module")
def two_steps(tiny_model_dir: str) -> list[list[RolloutGroup]]:
    return [
        tiny_groups(tiny_model_dir, num_groups=2, group_size=4, seed=1),
        tiny_groups(tiny_model_dir, num_groups=2, group_size=4, seed=2, first_row_id=2),
    ]


@pytest.fixture(scope="module")
def ref_fn(tiny_model_dir: str):
    frozen = load_causal_lm(tiny_model_dir, trainable=False)
    return lambda sequences, temperature: sequence_logprobs(frozen, sequences, temperature=temperature)


def _train(cfg, steps, ref_fn, **kw) -> tuple[list[dict[str, float]], list[torch.Tensor]]:
    trainer = PolicyTrainer(cfg, ref_logprobs_fn=ref_fn, **kw)
    metrics = [trainer.train_step(groups).metrics for groups in steps]
    return metrics, [p.detach().clone() for p in trainer.model.parameters()]


def test_a_copy_of_grpo_trains_exactly_as_grpo(tiny_model_dir, tmp_path, two_steps, ref_fn) -> None:
    runs = {}
    for name in ("grpo", f"{PATH}:grpo_copy"):
        cfg = make_cfg(
            tiny_model_dir, tmp_path / name.replace(":", "_"), policy_loss=name, kl_beta=0.05, num_minibatches=2
        )
        runs[name] = _train(cfg, two_steps, ref_fn, micro_batch_size=3)
    (m_builtin, w_builtin), (m_custom, w_custom) = runs.values()
    for step_builtin, step_custom in zip(m_builtin, m_custom, strict=True):
        for key in ("train/loss", "optim/grad_norm", "train/clip_frac", "train/kl_ref", "optim/ppo_kl"):
            assert step_custom[key] == pytest.approx(step_builtin[key], abs=1e-6, rel=0), key
        assert step_custom["train/loss"] == step_builtin["train/loss"]  # the same arithmetic: exactly equal
        assert step_custom["optim/grad_norm"] == step_builtin["optim/grad_norm"]
    assert m_builtin[1]["optim/ppo_kl"] != 0.0  # the second minibatch trained off old logprobs: a real test
    base = load_causal_lm(tiny_model_dir, trainable=False)
    moved = max(float((w - b).abs().max()) for w, b in zip(w_builtin, base.parameters(), strict=True))
    assert moved > 1e-5  # the two steps changed the weights ...
    for a, b in zip(w_builtin, w_custom, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # ... and the copy changed them alike


def test_the_samples_per_token_versions_reach_the_loss(tiny_model_dir, tmp_path) -> None:
    groups = tiny_groups(tiny_model_dir, num_groups=2, group_size=4, seed=3)
    for k, sample in enumerate(s for g in groups for s in g.samples):
        sample.versions = [k + 10 * (i % 2) for i in range(len(sample.tokens))]  # distinct per sample and token
    batch = build_step_batch(groups, advantage_mode="standardize")
    datums = [build_datum(s) for s in batch.samples]
    trainer = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path, policy_loss=f"{PATH}:recording"), micro_batch_size=3)
    custom_losses.SEEN.clear()
    trainer.loop.accumulate_gradients(datums, torch.tensor(batch.advantages), list(range(len(datums))))

    seen = [row for x in custom_losses.SEEN for row in x.versions.tolist()]
    masks = [row for x in custom_losses.SEEN for row in x.mask.tolist()]
    assert len(seen) == len(datums)  # micro-batches of 3, in row order
    for datum, row, mask in zip(datums, seen, masks, strict=True):
        assert datum.versions is not None
        expected = [v if w else -1 for v, w in zip(datum.versions, datum.weights, strict=True)]
        assert row[: len(datum)] == expected and all(v == -1 for v in row[len(datum) :])
        assert [int(m) for m in mask[: len(datum)]] == datum.weights


def test_a_loss_that_aggregates_itself_trains_as_the_builtin_it_copies(tiny_model_dir, tmp_path, two_steps) -> None:
    runs = []
    for name in ("ppo", f"{PATH}:ppo_token_mean"):
        cfg = make_cfg(tiny_model_dir, tmp_path / name.replace(":", "_"), policy_loss=name)
        runs.append(_train(cfg, two_steps[:1], None, micro_batch_size=3))
    (m_builtin, w_builtin), (m_custom, w_custom) = runs
    assert m_custom[0]["train/loss"] == pytest.approx(m_builtin[0]["train/loss"], abs=1e-6, rel=0)
    assert m_custom[0]["optim/grad_norm"] == pytest.approx(m_builtin[0]["optim/grad_norm"], abs=1e-6, rel=0)
    for a, b in zip(w_builtin, w_custom, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests.unit.losses.nowhere:loss", "cannot import module"),
        (f"{PATH}:NOT_CALLABLE", "not a function"),
        (f"{PATH}:wrong_shape", "returned loss_BT of shape"),
    ],
)
def test_a_bad_custom_loss_stops_the_trainer_at_start_naming_policy_loss(tiny_model_dir, tmp_path, spec, message):
    with pytest.raises(ValueError, match=f"^policy_loss '{spec}'.*{message}"):
        PolicyTrainer(make_cfg(tiny_model_dir, tmp_path, policy_loss=spec))
