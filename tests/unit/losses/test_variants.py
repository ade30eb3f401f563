"""Values and gradients of every per-token loss on hand-computed vectors.

Most cases use `sum` aggregation so the gradient of the scalar is the per-token gradient itself.
"""

from __future__ import annotations

import math

import pytest
import torch

from fleetrl.losses import LOSS_NAMES
from fleetrl.losses.variants import LOSSES
from tests.unit.losses.helpers import LN2, from_ratios, run_loss, t

OLD = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
MASK = t([[1, 1, 1], [1, 1, 0]])
ADV = t([2.0, -1.0])
RATIOS = [[1.1, 1.5, 0.5], [0.7, 1.3, 1.0]]
PI = from_ratios(OLD, RATIOS)

CLIPPED = ("grpo", "ppo", "dapo", "gspo", "cispo", "importance_sampling")


def test_every_name_has_a_loss() -> None:
    assert tuple(LOSSES) == LOSS_NAMES


def test_ppo_clipped_surrogate_values_and_gradients() -> None:
    # eps 0.2/0.2. Row 0 (A=2): r=1.1 inside -> -2.2 (grad -A*r = -2.2); r=1.5 -> -1.2*2 = -2.4,
    # clipped (grad 0); r=0.5 -> max(-1.0, -1.6) = -1.0 unclipped (grad -1.0). Row 1 (A=-1):
    # r=0.7 -> max(0.7, 0.8) = 0.8 clipped; r=1.3 -> max(1.3, 1.2) = 1.3 unclipped (grad 1.3).
    out = run_loss("ppo", PI, OLD, OLD, ADV, MASK, loss_agg_mode="sum")
    assert out.loss.item() == pytest.approx(-2.2 - 2.4 - 1.0 + 0.8 + 1.3)
    torch.testing.assert_close(out.grad, t([[-2.2, 0.0, -1.0], [0.0, 1.3, 0.0]]))
    assert out.metrics["clip_frac"] == pytest.approx(2 / 5)


def test_ppo_token_mean_divides_by_masked_count() -> None:
    out = run_loss("ppo", PI, OLD, OLD, ADV, MASK)
    assert out.loss.item() == pytest.approx((-2.2 - 2.4 - 1.0 + 0.8 + 1.3) / 5)
    torch.testing.assert_close(out.grad, t([[-2.2, 0.0, -1.0], [0.0, 1.3, 0.0]]) / 5)


def test_ppo_respects_configured_eps() -> None:
    # eps 0.6/0.6: nothing in RATIOS is outside [0.4, 1.6], so the loss is -r*A everywhere.
    out = run_loss("ppo", PI, OLD, OLD, ADV, MASK, loss_agg_mode="sum", eps_clip=0.6, eps_clip_high=0.6)
    torch.testing.assert_close(out.grad, t([[-2.2, -3.0, -1.0], [0.7, 1.3, 0.0]]))
    assert out.metrics["clip_frac"] == 0.0


@pytest.mark.parametrize("name", ["grpo", "ppo", "dapo", "gspo", "cispo", "importance_sampling", "dro"])
def test_tis_weight_multiplies_the_policy_term(name: str) -> None:
    inf = OLD - LN2  # w = exp(old - inf) = 2 everywhere
    wide = {"eps_clip": 0.6, "eps_clip_high": 0.6, "dro_beta": 0.0, "loss_agg_mode": "sum"}
    one = run_loss(name, PI, OLD, OLD, ADV, MASK, **wide)
    two = run_loss(name, PI, OLD, inf, ADV, MASK, **wide)
    torch.testing.assert_close(two.loss, 2 * one.loss)
    torch.testing.assert_close(two.grad, 2 * one.grad)
    assert two.metrics["tis_weight_mean"] == pytest.approx(2.0)


def test_tis_weight_multiplies_the_clipped_ppo_surrogate() -> None:
    out = run_loss("ppo", PI, OLD, OLD - LN2, ADV, MASK, loss_agg_mode="sum")
    assert out.loss.item() == pytest.approx(2 * (-2.2 - 2.4 - 1.0 + 0.8 + 1.3))
    torch.testing.assert_close(out.grad, 2 * t([[-2.2, 0.0, -1.0], [0.0, 1.3, 0.0]]))


def test_reinforce_ignores_the_tis_weight() -> None:
    one = run_loss("reinforce", PI, OLD, OLD, ADV, MASK)
    two = run_loss("reinforce", PI, OLD, OLD - LN2, ADV, MASK)
    torch.testing.assert_close(two.grad, one.grad)


def test_dapo_clip_higher_defaults() -> None:
    # eps 0.2/0.28: r=1.5 with A=2 is clipped at 1.28 -> -2.56; r=1.3 with A=-1 stays 1.3.
    out = run_loss("dapo", PI, OLD, OLD, ADV, MASK, loss_agg_mode="sum")
    assert out.loss.item() == pytest.approx(-2.2 - 2.56 - 1.0 + 0.8 + 1.3)
    torch.testing.assert_close(out.grad, t([[-2.2, 0.0, -1.0], [0.0, 1.3, 0.0]]))
    assert "dual_clip_frac" not in out.metrics


def test_dapo_dual_clip_bounds_negative_advantage_loss() -> None:
    old = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    pi = from_ratios(old, [[5.0, 2.0, 0.5], [5.0, 1.0, 1.0]])
    adv, mask = t([-1.0, 1.0]), t([[1, 1, 1], [1, 1, 1]])
    plain = run_loss("dapo", pi, old, old, adv, mask, loss_agg_mode="sum")
    dual = run_loss("dapo", pi, old, old, adv, mask, loss_agg_mode="sum", dual_clip_c=3.0)
    # A=-1: r=5 -> 5 without dual clip, bounded to -c*A = 3 with it (gradient cut); r=2 -> 2 < 3,
    # untouched (grad -A*r = 2); r=0.5 -> clip 0.8. A=+1: r=5 -> -1.28 (never dual-clipped);
    # r=1 -> -1 twice.
    assert plain.loss.item() == pytest.approx(5 + 2 + 0.8 - 1.28 - 1 - 1)
    assert dual.loss.item() == pytest.approx(3 + 2 + 0.8 - 1.28 - 1 - 1)
    torch.testing.assert_close(dual.grad, t([[0.0, 2.0, 0.0], [0.0, -1.0, -1.0]]))
    torch.testing.assert_close(plain.grad, t([[5.0, 2.0, 0.0], [0.0, -1.0, -1.0]]))
    assert dual.metrics["dual_clip_frac"] == pytest.approx(1 / 6)


@pytest.mark.parametrize("name", ["grpo", "ppo", "gspo", "cispo"])
def test_dual_clip_is_dapo_only(name: str) -> None:
    plain = run_loss(name, PI, OLD, OLD, ADV, MASK)
    with_c = run_loss(name, PI, OLD, OLD, ADV, MASK, dual_clip_c=1.01)
    torch.testing.assert_close(with_c.loss, plain.loss)
    torch.testing.assert_close(with_c.grad, plain.grad)


def test_grpo_without_ref_equals_ppo() -> None:
    grpo = run_loss("grpo", PI, OLD, OLD, ADV, MASK)
    ppo = run_loss("ppo", PI, OLD, OLD, ADV, MASK)
    torch.testing.assert_close(grpo.loss, ppo.loss)
    torch.testing.assert_close(grpo.grad, ppo.grad)
    assert "ref_kl" not in grpo.metrics


def test_grpo_k3_value_and_gradient() -> None:
    # A = 0 leaves only kl_beta * k3, k3 = exp(d) - d - 1 with d = ref - pi.
    pi = t([[-1.0, -2.0, -0.5], [-0.3, -1.2, -4.0]])
    d = t([[0.5, -0.5, 1.0], [-1.0, 0.0, 2.0]])
    ref = pi + d
    out = run_loss("grpo", pi, pi, pi, t([0.0, 0.0]), MASK, ref=ref, kl_beta=0.1, loss_agg_mode="sum")
    k3 = torch.exp(d) - d - 1
    assert out.loss.item() == pytest.approx(0.1 * (k3 * MASK).sum().item())
    torch.testing.assert_close(out.grad, 0.1 * (1 - torch.exp(d)) * MASK)
    assert out.metrics["ref_kl"] == pytest.approx((k3 * MASK).sum().item() / 5)
    # Spot-check one entry by hand: d = 0.5 -> grad 0.1 * (1 - e^0.5) = -0.0648721...
    assert out.grad[0, 0].item() == pytest.approx(0.1 * (1 - math.exp(0.5)))


def test_grpo_kl_beta_zero_or_other_losses_add_no_kl() -> None:
    ref = PI + 0.7
    grpo_off = run_loss("grpo", PI, OLD, OLD, ADV, MASK, ref=ref, kl_beta=0.0)
    ppo = run_loss("ppo", PI, OLD, OLD, ADV, MASK, ref=ref, kl_beta=0.5)
    base = run_loss("ppo", PI, OLD, OLD, ADV, MASK)
    torch.testing.assert_close(grpo_off.grad, base.grad)
    torch.testing.assert_close(ppo.grad, base.grad)
    grpo_on = run_loss("grpo", PI, OLD, OLD, ADV, MASK, ref=ref)  # default kl_beta 0.001
    assert not torch.allclose(grpo_on.grad, base.grad)


@pytest.mark.parametrize("name", CLIPPED)
def test_ratio_one_gives_minus_advantage_gradient(name: str) -> None:
    pi = t([[-0.3, -2.0, -1.1], [-0.7, -0.2, -5.0]])
    out = run_loss(name, pi, pi.clone(), pi.clone(), ADV, MASK, loss_agg_mode="sum")
    torch.testing.assert_close(out.grad, -ADV.unsqueeze(-1) * MASK)
    assert out.metrics["clip_frac"] == 0.0


def test_importance_sampling_is_unclipped() -> None:
    # -r * A * w with w = 2: r = 1.5, A = 2 is not clipped here: loss -6, grad -6.
    out = run_loss("importance_sampling", PI, OLD, OLD - LN2, ADV, MASK, loss_agg_mode="sum")
    ratios = t(RATIOS)
    expected = -ratios * ADV.unsqueeze(-1) * 2 * MASK
    assert out.loss.item() == pytest.approx(expected.sum().item())
    torch.testing.assert_close(out.grad, expected)
    assert out.grad[0, 1].item() == pytest.approx(-6.0)


def test_reinforce_value_and_gradient() -> None:
    # -A * pi, no ratio and no TIS weight: grad -A per masked token whatever old/inf hold.
    pi = t([[-1.0, -2.0, -0.5], [-0.3, -1.2, -4.0]])
    out = run_loss("reinforce", pi, pi + 3.0, pi - 1.0, ADV, MASK, loss_agg_mode="sum")
    assert out.loss.item() == pytest.approx(2 * 3.5 - 1 * 1.5)
    torch.testing.assert_close(out.grad, -ADV.unsqueeze(-1) * MASK)


def test_dro_quadratic_value_and_gradient() -> None:
    # -pi*A*w + 0.5*beta*(pi - old)^2, beta 0.05; w = 2 via inf = old - ln 2.
    pi, old = t([[-1.0, -2.0]]), t([[-1.5, -1.0]])
    out = run_loss("dro", pi, old, old - LN2, t([1.0]), t([[1, 1]]), loss_agg_mode="sum")
    expected = (1.0 * 2 + 0.025 * 0.25) + (2.0 * 2 + 0.025 * 1.0)
    assert out.loss.item() == pytest.approx(expected)
    # grad = -A*w + beta*(pi - old) = -2 + 0.05*0.5, -2 + 0.05*(-1)
    torch.testing.assert_close(out.grad, t([[-2.0 + 0.025, -2.0 - 0.05]]))
    custom = run_loss("dro", pi, old, old, t([0.0]), t([[1, 1]]), dro_beta=1.0, loss_agg_mode="sum")
    torch.testing.assert_close(custom.grad, t([[0.5, -1.0]]))
    assert custom.loss.item() == pytest.approx(0.5 * (0.25 + 1.0))


def test_gspo_uses_the_sequence_ratio() -> None:
    # pi - old = [0.1, 0.3, (masked) 5.0] -> s = exp(0.2) for both masked tokens; eps 0.5 keeps
    # s inside the clip range, so loss = -s*A per token and the gradient is -s*A on each token
    # (the same on both even though their own token ratios differ).
    old = t([[-1.0, -1.0, -1.0]])
    pi = old + t([[0.1, 0.3, 5.0]])
    s = math.exp(0.2)
    args = (pi, old, old, t([1.0]), t([[1, 1, 0]]))
    out = run_loss("gspo", *args, loss_agg_mode="sum", eps_clip=0.5, eps_clip_high=0.5)
    assert out.loss.item() == pytest.approx(-2 * s)
    torch.testing.assert_close(out.grad, t([[-s, -s, 0.0]]))
    assert out.metrics["ratio_mean"] == pytest.approx(s)
    # Default eps 3e-4/4e-4: s > 1.0004 with A > 0 is clipped: loss -(1.0004) per token, grad 0.
    default = run_loss("gspo", *args, loss_agg_mode="sum")
    assert default.loss.item() == pytest.approx(-2 * 1.0004)
    torch.testing.assert_close(default.grad, torch.zeros_like(pi))
    assert default.metrics["clip_frac"] == 1.0


def test_cispo_stop_gradient_on_clipped_ratio() -> None:
    # -sg(clip(r, 0.8, 1.28)) * pi * A * w: r = [1.5, 0.5, 1.1] -> clip [1.28, 0.8, 1.1]; unlike
    # PPO the clipped tokens keep a gradient, -clip(r) * A * w.
    old = t([[-1.0, -1.0, -1.0]])
    pi = from_ratios(old, [[1.5, 0.5, 1.1]])
    clip_r = t([[1.28, 0.8, 1.1]])
    mask = t([[1, 1, 1]])
    out = run_loss("cispo", pi, old, old - LN2, t([1.0]), mask, loss_agg_mode="sum")
    assert out.loss.item() == pytest.approx((-clip_r * pi * 2).sum().item())
    torch.testing.assert_close(out.grad, -clip_r * 2)
    assert out.metrics["clip_frac"] == pytest.approx(2 / 3)


def test_extreme_log_ratios_are_clamped() -> None:
    # pi - old = 50 would overflow exp in float32; clamped to 20 the ratio is e^20 (finite) and,
    # past the clamp, carries no gradient.
    pi = t([[10.0, -1.0]]).float()
    old = t([[-40.0, -1.0]]).float()
    for name in LOSS_NAMES:
        out = run_loss(name, pi, old, old, t([-1.0]).float(), t([[1, 1]]).float(), ref=old)
        assert math.isfinite(out.loss.item()), name
        assert torch.isfinite(out.grad).all(), name
        assert all(math.isfinite(v) for v in out.metrics.values()), name
    out = run_loss("importance_sampling", pi, old, old, t([-1.0]), t([[1, 1]]), loss_agg_mode="sum")
    assert out.loss.item() == pytest.approx(math.exp(20) + 1.0)
    assert out.grad[0, 0].item() == 0.0
