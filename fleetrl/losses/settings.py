"""Loss settings: the knobs of the policy losses, their per-loss defaults and their validation.

`policy_loss` accepts `cfg` as None (all defaults), a `LossSettings`, or any object carrying attributes
with the same names (the run-level `Config`, a namespace). Attributes are read with `getattr`, so a
partial object works, and a value of None always means "the loss's own default".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

TisLevel = Literal["token", "sequence", "off"]
AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "sum"]

LOSS_NAMES: tuple[str, ...] = (
    "grpo",
    "ppo",
    "dapo",
    "importance_sampling",
    "reinforce",
    "dro",
    "gspo",
    "cispo",
)
TIS_LEVELS: tuple[str, ...] = ("token", "sequence", "off")
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "sum")

# Every log-ratio (pi - old, old - inf, ref - pi, ...) is clamped to this range before exp() so one
# wild token cannot overflow a ratio to inf and poison the batch.
LOG_RATIO_CLAMP = 20.0

# (eps_clip, eps_clip_high) used when the setting is None. grpo/ppo: symmetric PPO clip (Schulman et
# al. 2017). dapo/cispo: DAPO's clip-higher (Yu et al. 2025, §3.1), which MiniMax-M1 reuses for
# CISPO. gspo: the sequence-ratio clip of the GSPO paper's experiments (Zheng et al. 2025), far tighter since a sequence
# ratio is a geometric mean of token ratios.
_EPS_DEFAULTS: dict[str, tuple[float, float]] = {
    "grpo": (0.2, 0.2),
    "ppo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "cispo": (0.2, 0.28),
    "gspo": (3e-4, 4e-4),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossSettings:
    """Settings of the policy losses; each field is also read, by name, from a run-level config."""

    eps_clip: float | None = None
    """Lower clip range: r is clipped below at 1 - eps_clip. None: the loss's own default."""
    eps_clip_high: float | None = None
    """Upper clip range: r is clipped above at 1 + eps_clip_high. None: the loss's own default."""
    dual_clip_c: float | None = None
    """dapo only: dual-clip constant c > 1 bounding the loss at -c*A when A < 0. None: off."""
    kl_beta: float = 0.001
    """grpo only: weight of the k3 KL penalty to the reference policy (0 disables it)."""
    dro_beta: float = 0.05
    """dro only: weight of the quadratic penalty 0.5*beta*(pi - old)^2."""
    tis_level: TisLevel = "token"
    """Truncated importance sampling of old vs rollout (sampler) logprobs: token, sequence or off."""
    tis_cap: float = 5.0
    """Upper bound of the TIS weight exp(old - inf)."""
    icepop_threshold: float | None = None
    """IcePop: when set (t > 1), tokens whose exp(old - inf) lies outside [1/t, t] get weight 0."""
    loss_agg_mode: AggMode = "token-mean"
    """How per-token losses become one scalar (see fleetrl.losses.aggregation)."""
    loss_agg_constant: float | None = None
    """Dr. GRPO normaliser for seq-mean-token-sum-norm; None: T, the padded length of the batch."""
    distill_weight: float = 0.0
    """On-policy distillation (a run's teacher_model): weight w in [0, 1] of the teacher's per-token signal; the
    loss's advantages become (1 - w) * A + w * (ref - old), ref holding the teacher's logprobs. 0: off."""

    def __post_init__(self) -> None:
        _validate(self)


def _number(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"loss setting {field} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"loss setting {field} must be finite, got {value!r}")
    return value


def _validate(s: LossSettings) -> None:
    """Check every set field; None fields are left for `resolve_loss_settings` to fill."""
    for field in ("eps_clip", "eps_clip_high", "kl_beta", "dro_beta"):
        value = getattr(s, field)
        if value is not None and _number(field, value) < 0:
            raise ValueError(f"loss setting {field} must be >= 0, got {value!r}")
    if not 0.0 <= _number("distill_weight", s.distill_weight) <= 1.0:
        raise ValueError(f"loss setting distill_weight must be in [0, 1], got {s.distill_weight!r}")
    if s.dual_clip_c is not None and _number("dual_clip_c", s.dual_clip_c) <= 1:
        raise ValueError(f"loss setting dual_clip_c must be > 1 (or None), got {s.dual_clip_c!r}")
    if _number("tis_cap", s.tis_cap) <= 0:
        raise ValueError(f"loss setting tis_cap must be > 0, got {s.tis_cap!r}")
    if s.icepop_threshold is not None and _number("icepop_threshold", s.icepop_threshold) <= 1:
        raise ValueError(f"loss setting icepop_threshold must be > 1 (or None), got {s.icepop_threshold!r}")
    if s.loss_agg_constant is not None and _number("loss_agg_constant", s.loss_agg_constant) <= 0:
        raise ValueError(f"loss setting loss_agg_constant must be > 0 (or None), got {s.loss_agg_constant!r}")
    if s.tis_level not in TIS_LEVELS:
        raise ValueError(f"loss setting tis_level={s.tis_level!r} is not one of {TIS_LEVELS}")
    if s.loss_agg_mode not in AGG_MODES:
        raise ValueError(f"loss setting loss_agg_mode={s.loss_agg_mode!r} is not one of {AGG_MODES}")


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(LossSettings))
_DEFAULTS = LossSettings()


def check_loss_name(name: str) -> None:
    """Raise a ValueError naming the supported losses when `name` is neither one of them nor reads as the import
    path of a custom loss (fleetrl.losses.custom; nothing is imported here)."""
    from fleetrl.losses.custom import is_loss_path

    if not isinstance(name, str) or not (name in LOSS_NAMES or is_loss_path(name)):
        raise ValueError(
            f"policy_loss: unknown policy loss {name!r}; supported: {', '.join(LOSS_NAMES)}, or a custom loss's "
            "import path ('package.module:function', 'package.module.function' or 'path/to/file.py:function')"
        )


def resolve_loss_settings(name: str, cfg: object | None = None) -> LossSettings:
    """The settings `policy_loss(name, ...)` runs with: `cfg`'s values, defaults for the rest.

    eps_clip / eps_clip_high come back filled with the loss's own defaults when unset (0.2 / 0.2 for a custom
    loss); every value is validated, so a bad config fails here with the field's name. A custom loss (an import
    path) is imported and given a trial call on tiny tensors once per process and settings
    (fleetrl.losses.custom.check_custom_loss): a bad one fails here with a ValueError naming `policy_loss`.
    """
    check_loss_name(name)
    values: dict[str, Any] = {}
    for field in _FIELD_NAMES:
        value = getattr(cfg, field, None) if cfg is not None else None
        values[field] = getattr(_DEFAULTS, field) if value is None else value
    eps_low, eps_high = _EPS_DEFAULTS.get(name, (0.2, 0.2))
    if values["eps_clip"] is None:
        values["eps_clip"] = eps_low
    if values["eps_clip_high"] is None:
        values["eps_clip_high"] = eps_high
    settings = LossSettings(**values)
    if name not in LOSS_NAMES:
        from fleetrl.losses.custom import check_custom_loss

        check_custom_loss(name, settings)
    return settings
