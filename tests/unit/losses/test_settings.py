"""LossSettings: defaults per loss, reading partial config objects, validation messages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fleetrl.losses import LOSS_NAMES, LossSettings, resolve_loss_settings


@pytest.mark.parametrize(
    ("name", "eps"),
    [
        ("grpo", (0.2, 0.2)),
        ("ppo", (0.2, 0.2)),
        ("dapo", (0.2, 0.28)),
        ("cispo", (0.2, 0.28)),
        ("gspo", (3e-4, 4e-4)),
    ],
)
def test_eps_defaults_per_loss(name: str, eps: tuple[float, float]) -> None:
    s = resolve_loss_settings(name)
    assert (s.eps_clip, s.eps_clip_high) == eps


def test_other_defaults() -> None:
    s = resolve_loss_settings("grpo", None)
    assert s.kl_beta == 0.001 and s.dro_beta == 0.05
    assert s.tis_level == "token" and s.tis_cap == 5.0 and s.icepop_threshold is None
    assert s.loss_agg_mode == "token-mean" and s.loss_agg_constant is None
    assert s.dual_clip_c is None


def test_partial_object_and_none_values_fall_back_to_defaults() -> None:
    s = resolve_loss_settings("gspo", SimpleNamespace(eps_clip=1e-3, kl_beta=None, tis_cap=2))
    assert s.eps_clip == 1e-3 and s.eps_clip_high == 4e-4
    assert s.kl_beta == 0.001 and s.tis_cap == 2


def test_explicit_settings_win_over_loss_defaults() -> None:
    s = resolve_loss_settings("dapo", LossSettings(eps_clip=0.1, eps_clip_high=0.3))
    assert (s.eps_clip, s.eps_clip_high) == (0.1, 0.3)


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match="unknown policy loss 'sft'") as err:
        resolve_loss_settings("sft")
    assert ", ".join(LOSS_NAMES) in str(err.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("eps_clip", -0.1),
        ("eps_clip_high", float("nan")),
        ("kl_beta", -1.0),
        ("dro_beta", "0.05"),
        ("dual_clip_c", 1.0),
        ("tis_cap", 0.0),
        ("tis_level", "tokens"),
        ("icepop_threshold", 0.5),
        ("loss_agg_mode", "mean"),
        ("loss_agg_constant", 0),
        ("kl_beta", True),
    ],
)
def test_bad_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        LossSettings(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field):
        resolve_loss_settings("grpo", SimpleNamespace(**{field: value}))
