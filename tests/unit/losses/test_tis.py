"""Truncated importance sampling weights and IcePop on hand-made vectors."""

from __future__ import annotations

import math

import pytest
import torch

from fleetrl.losses import LossSettings, policy_loss, tis_weights
from tests.unit.losses.helpers import LN2, t

MASK = t([[1, 1, 1, 0]])
OLD = t([[-1.0, -2.0, -0.5, -3.0]])
# old - inf = [ln 2, ln 8, -ln 2, (masked) 7.0]
INF = OLD - t([[LN2, 3 * LN2, -LN2, 7.0]])


def test_equal_old_and_rollout_give_weight_one() -> None:
    for level in ("token", "sequence"):
        tis = tis_weights(OLD, OLD.clone(), MASK, level=level)
        assert torch.equal(tis.weights_BT, torch.ones_like(OLD))
        assert not tis.capped_BT.any()


def test_token_level_weight_is_capped_ratio() -> None:
    tis = tis_weights(OLD, INF, MASK, level="token", cap=5.0)
    torch.testing.assert_close(tis.weights_BT, t([[2.0, 5.0, 0.5, 1.0]]))
    assert tis.capped_BT.tolist() == [[False, True, False, False]]


def test_sequence_level_weight_is_exp_of_masked_mean() -> None:
    # masked mean of old - inf = (ln 2 + 3 ln 2 - ln 2) / 3 = ln 2: every masked token gets 2.
    tis = tis_weights(OLD, INF, MASK, level="sequence", cap=5.0)
    torch.testing.assert_close(tis.weights_BT, t([[2.0, 2.0, 2.0, 1.0]]))
    assert not tis.capped_BT.any()


def test_sequence_level_weight_is_capped_per_sequence() -> None:
    tis = tis_weights(OLD, INF, MASK, level="sequence", cap=1.5)
    torch.testing.assert_close(tis.weights_BT, t([[1.5, 1.5, 1.5, 1.0]]))
    assert tis.capped_BT.tolist() == [[True, True, True, False]]


def test_off_gives_weight_one() -> None:
    assert torch.equal(tis_weights(OLD, INF, MASK, level="off").weights_BT, torch.ones_like(OLD))


@pytest.mark.parametrize("level", ["token", "sequence", "off"])
def test_masked_out_positions_never_change_the_weights(level: str) -> None:
    base = tis_weights(OLD, INF, MASK, level=level, icepop_threshold=3.0).weights_BT
    for junk in (1e6, -1e6, math.nan, math.inf):
        old, inf = OLD.clone(), INF.clone()
        old[0, 3], inf[0, 3] = junk, -junk if not math.isnan(junk) else junk
        tis = tis_weights(old, inf, MASK, level=level, icepop_threshold=3.0)
        assert torch.equal(tis.weights_BT, base), junk
        assert tis.weights_BT[0, 3].item() == 1.0


def test_icepop_zeroes_tokens_outside_the_band() -> None:
    # t = 3: ratios 2 and 0.5 lie in [1/3, 3] and keep their TIS weight, 8 lies outside -> 0.
    tis = tis_weights(OLD, INF, MASK, level="token", cap=5.0, icepop_threshold=3.0)
    torch.testing.assert_close(tis.weights_BT, t([[2.0, 0.0, 0.5, 1.0]]))
    assert tis.icepop_dropped_BT.tolist() == [[False, True, False, False]]
    # A band of [1/1.5, 1.5] drops the 0.5 token too (below 1/t).
    tis = tis_weights(OLD, INF, MASK, level="token", cap=5.0, icepop_threshold=1.5)
    torch.testing.assert_close(tis.weights_BT, t([[0.0, 0.0, 0.0, 1.0]]))


def test_icepop_acts_per_token_at_sequence_level() -> None:
    tis = tis_weights(OLD, INF, MASK, level="sequence", cap=5.0, icepop_threshold=3.0)
    torch.testing.assert_close(tis.weights_BT, t([[2.0, 0.0, 2.0, 1.0]]))


def test_weights_are_constants() -> None:
    old = OLD.clone().requires_grad_(True)
    assert not tis_weights(old, INF, MASK).weights_BT.requires_grad


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"level": "tokens"}, "tis_level"),
        ({"icepop_threshold": 1.0}, "icepop_threshold"),
        ({"cap": 0.0}, "tis_cap"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tis_weights(OLD, INF, MASK, **kwargs)


def test_policy_loss_applies_and_reports_tis() -> None:
    # importance_sampling with pi = old (r = 1) and A = 1: per-token loss = -w.
    pi = OLD.clone()
    cfg = {"tis_level": "token", "tis_cap": 5.0, "icepop_threshold": 3.0}
    loss, metrics = policy_loss("importance_sampling", pi, OLD, INF, t([1.0]), MASK, cfg=LossSettings(**cfg))
    assert loss.item() == pytest.approx(-(2.0 + 0.0 + 0.5) / 3)
    assert metrics["tis_weight_mean"] == pytest.approx((2.0 + 0.0 + 0.5) / 3)
    assert metrics["tis_clip_frac"] == pytest.approx(1 / 3)
    assert metrics["icepop_frac"] == pytest.approx(1 / 3)
