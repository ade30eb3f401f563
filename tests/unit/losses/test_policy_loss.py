"""The policy_loss contract: masking, constants, metrics, input validation, dtypes."""

from __future__ import annotations

import math

import pytest
import torch

from fleetrl.losses import LOSS_NAMES, LossSettings, policy_loss
from tests.unit.losses.helpers import run_loss, t

PI = t([[-1.0, -2.0, -0.5, -0.1], [-0.3, -1.2, -4.0, -0.9]])
OLD = PI + t([[0.1, -0.2, 0.05, 0.0], [0.3, -0.1, 0.0, 0.2]])
INF = OLD + t([[0.2, -0.4, 0.1, 0.0], [-0.1, 0.3, 0.0, 0.6]])
REF = PI + t([[0.5, -0.5, 0.2, 0.0], [0.1, 0.0, -0.3, 0.4]])
MASK = t([[0, 1, 1, 1], [1, 1, 0, 0]])
ADV = t([1.5, -0.5])


def _with_junk_at_masked(x: torch.Tensor, junk: float) -> torch.Tensor:
    return torch.where(MASK.bool(), x, torch.full_like(x, junk))


@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("junk", [123.0, -1e4, math.nan])
def test_masked_out_positions_change_nothing(name: str, junk: float) -> None:
    cfg = {"icepop_threshold": 2.0, "dual_clip_c": 3.0, "loss_agg_mode": "seq-mean-token-mean"}
    base = run_loss(name, PI, OLD, INF, ADV, MASK, ref=REF, **cfg)
    j = [_with_junk_at_masked(x, junk) for x in (PI, OLD, INF, REF)]
    moved = run_loss(name, j[0], j[1], j[2], ADV, MASK, ref=j[3], **cfg)
    torch.testing.assert_close(moved.loss, base.loss)
    torch.testing.assert_close(moved.grad, base.grad)
    assert moved.metrics == pytest.approx(base.metrics)
    assert torch.equal(moved.grad * (1 - MASK), torch.zeros_like(PI))


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_only_logprobs_receive_gradient(name: str) -> None:
    pi = PI.clone().requires_grad_(True)
    old, inf, ref, adv = (x.clone().requires_grad_(True) for x in (OLD, INF, REF, ADV))
    wide = LossSettings(eps_clip=0.9, eps_clip_high=0.9)  # no token clipped: all get a gradient
    loss, _ = policy_loss(name, pi, old, inf, adv, MASK, ref_logprobs=ref, cfg=wide)
    assert loss.dim() == 0
    loss.backward()
    assert pi.grad is not None and pi.grad.abs().sum() > 0
    assert old.grad is None and inf.grad is None and ref.grad is None and adv.grad is None


def test_metrics_on_hand_values() -> None:
    pi = t([[-1.0, -2.0, 7.0]])
    old = t([[-1.2, -1.5, 0.0]])
    inf = t([[-0.9, -2.3, 0.0]])
    ref = t([[-1.0, -1.5, 0.0]])
    mask = t([[1, 1, 0]])
    out = run_loss("ppo", pi, old, inf, t([1.0]), mask, ref=ref)
    m = out.metrics
    # inf - pi = [0.1, -0.3]
    assert m["kl_sample_train_v1"] == pytest.approx((0.1 - 0.3) / 2)
    assert m["kl_sample_train_v2"] == pytest.approx(0.5 * (0.01 + 0.09) / 2)
    # old - pi = [-0.2, 0.5]
    assert m["ppo_kl"] == pytest.approx((-0.2 + 0.5) / 2)
    # w = exp(old - inf) = exp([-0.3, 0.8]), none capped
    assert m["tis_weight_mean"] == pytest.approx((math.exp(-0.3) + math.exp(0.8)) / 2)
    assert m["tis_clip_frac"] == 0.0
    # r = exp(pi - old) = exp([0.2, -0.5]); A > 0: r = e^0.2 > 1.2? 1.2214 yes -> clipped; e^-0.5
    # = 0.61 < 0.8 but A > 0 keeps the unclipped (smaller) objective -> not clipped.
    assert m["clip_frac"] == pytest.approx(0.5)
    assert m["ratio_mean"] == pytest.approx((math.exp(0.2) + math.exp(-0.5)) / 2)
    # k3 with d = ref - pi = [0, 0.5]
    assert m["ref_kl"] == pytest.approx((0 + math.exp(0.5) - 0.5 - 1) / 2)
    assert all(isinstance(v, float) for v in m.values())


def test_required_metric_keys() -> None:
    required = {"clip_frac", "ppo_kl", "tis_weight_mean", "tis_clip_frac"}
    required |= {"kl_sample_train_v1", "kl_sample_train_v2"}
    for name in LOSS_NAMES:
        _, without_ref = policy_loss(name, PI, OLD, INF, ADV, MASK)
        _, with_ref = policy_loss(name, PI, OLD, INF, ADV, MASK, ref_logprobs=REF)
        assert required <= set(without_ref) and "ref_kl" not in without_ref
        assert required | {"ref_kl"} <= set(with_ref)


def test_empty_mask_gives_zero_loss_and_metrics() -> None:
    pi = PI.clone().requires_grad_(True)
    loss, metrics = policy_loss("grpo", pi, OLD, INF, ADV, torch.zeros_like(MASK))
    loss.backward()
    assert loss.item() == 0.0 and all(v == 0.0 for v in metrics.values())
    assert pi.grad is not None and not pi.grad.any()


def test_low_precision_logprobs_compute_in_float32() -> None:
    pi = PI.to(torch.bfloat16).requires_grad_(True)
    loss, _ = policy_loss("grpo", pi, OLD.bfloat16(), INF.float(), ADV.float(), MASK.bool())
    assert loss.dtype == torch.float32
    loss.backward()
    assert pi.grad is not None and pi.grad.dtype == torch.bfloat16 and pi.grad.abs().sum() > 0


def test_bool_int_and_float_masks_agree() -> None:
    losses = [policy_loss("dapo", PI, OLD, INF, ADV, m)[0].item() for m in (MASK, MASK.bool(), MASK.long())]
    assert losses[0] == losses[1] == losses[2]


def test_unknown_loss_name_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="unknown policy loss 'grpo2'") as err:
        policy_loss("grpo2", PI, OLD, INF, ADV, MASK)
    assert all(name in str(err.value) for name in LOSS_NAMES)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"old_logprobs": OLD[:, :3]}, r"old_logprobs has shape \(2, 3\) but logprobs"),
        ({"rollout_logprobs": INF[:1]}, r"rollout_logprobs has shape \(1, 4\)"),
        ({"ref_logprobs": REF.T}, r"ref_logprobs has shape \(4, 2\)"),
        ({"mask": MASK[:, :2]}, r"mask has shape \(2, 2\)"),
        ({"advantages": ADV[:1]}, r"advantages must be \[B\] = \[2\].*\(1,\)"),
        ({"advantages": ADV.unsqueeze(-1)}, r"advantages must be \[B\]"),
        ({"logprobs": PI[0]}, r"logprobs must be \[B, T\]"),
        ({"mask": MASK * 2}, "mask must hold only 0 and 1"),
        ({"old_logprobs": OLD.long()}, "old_logprobs must be a floating-point tensor"),
        ({"rollout_logprobs": INF.tolist()}, "rollout_logprobs must be a torch.Tensor"),
    ],
)
def test_bad_inputs_name_the_culprit(kwargs: dict, match: str) -> None:
    args = {
        "logprobs": PI,
        "old_logprobs": OLD,
        "rollout_logprobs": INF,
        "advantages": ADV,
        "mask": MASK,
        "ref_logprobs": REF,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        policy_loss("grpo", **args)


def test_bad_settings_are_rejected_before_computing() -> None:
    class Partial:
        loss_agg_mode = "mean"

    with pytest.raises(ValueError, match="loss_agg_mode='mean'"):
        policy_loss("grpo", PI, OLD, INF, ADV, MASK, cfg=Partial())


def test_cfg_may_be_any_object_with_matching_names() -> None:
    class RunConfig:  # stands in for the run-level pydantic Config
        policy_loss = "ppo"
        eps_clip = 0.6
        eps_clip_high = None  # None -> the loss's own default (0.2 for ppo)
        learning_rate = 1e-6  # unrelated fields are ignored
        loss_agg_mode = "sum"

    from_obj = run_loss("ppo", PI, OLD, INF, ADV, MASK, loss_agg_mode="sum")  # baseline
    loss, _ = policy_loss("ppo", PI, OLD, INF, ADV, MASK, cfg=RunConfig())
    explicit = run_loss("ppo", PI, OLD, INF, ADV, MASK, eps_clip=0.6, eps_clip_high=0.2, loss_agg_mode="sum")
    assert loss.item() == pytest.approx(explicit.loss.item())
    assert from_obj.loss.item() != pytest.approx(explicit.loss.item())
    assert policy_loss("ppo", PI, OLD, INF, ADV, MASK, cfg=LossSettings())[0].item() == (
        pytest.approx(policy_loss("ppo", PI, OLD, INF, ADV, MASK)[0].item())
    )
