"""Advantage estimators for a step's groups: built-in ones by name, or a user's function by import path.

    advantage_estimator = "grpo"          # group normalisation (advantage_mode: standardize or center), the default
    advantage_estimator = "rloo"          # leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024)
    advantage_estimator = "reinforce_pp"  # group-centred, then normalised over the whole batch (REINFORCE++, Hu 2025)
    advantage_estimator = "my_pkg.adv:estimate"   # or "path/to/file.py:estimate"

An estimator sees the whole step: `estimate(rewards_GM: list[list[float]]) -> list[list[float] | None]`, one list of
member rewards per group (a member is a trajectory: the samples of a split RolloutRun share it) and returns, per
group, one advantage per member, or None to skip the group (no relative signal). A user's estimator is imported and
given a trial call when the trainer starts (`check_estimator`): an exception, a result of the wrong shape or a
non-finite advantage fails the run at start with a ValueError naming `advantage_estimator`; the same checks run on
every step's result. Pure logic: no torch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

from fleetrl.config import ADVANTAGE_ESTIMATORS
from fleetrl.trainer.advantages import STD_EPS, group_advantages

Estimator = Callable[[list[list[float]]], list[list[float] | None]]
BUILT_IN: tuple[str, ...] = ADVANTAGE_ESTIMATORS
TRIAL_REWARDS: list[list[float]] = [[1.0, 0.0, 0.5, 0.0], [0.2, 0.9], [1.0]]


def grpo(rewards_GM: list[list[float]], mode: str = "standardize") -> list[list[float] | None]:
    return [group_advantages(group, mode) for group in rewards_GM]  # type: ignore[arg-type]


def rloo(rewards_GM: list[list[float]]) -> list[list[float] | None]:
    """A_i = r_i - mean of the other members' rewards (an unbiased baseline), None for a group of one."""
    out: list[list[float] | None] = []
    for group in rewards_GM:
        n = len(group)
        if n < 2:
            out.append(None)
            continue
        total = math.fsum(group)
        out.append([r - (total - r) / (n - 1) for r in group])
    return out


def reinforce_pp(rewards_GM: list[list[float]]) -> list[list[float] | None]:
    """Group-centred rewards normalised by the mean and std over every member of the step (groups of one skipped)."""
    centred = [None if len(g) < 2 else [r - math.fsum(g) / len(g) for r in g] for g in rewards_GM]
    flat = [a for g in centred if g is not None for a in g]
    if not flat:
        return centred
    mean = math.fsum(flat) / len(flat)
    std = math.sqrt(math.fsum((a - mean) ** 2 for a in flat) / max(1, len(flat) - 1))
    if std < STD_EPS:
        return [None if g is None else [0.0] * len(g) for g in centred]
    return [None if g is None else [(a - mean) / (std + STD_EPS) for a in g] for g in centred]


def check_result(name: str, rewards_GM: Sequence[Sequence[float]], result: Any) -> list[list[float] | None]:
    """`result` as advantages for `rewards_GM`, or a ValueError naming `advantage_estimator` and what is wrong."""
    where = f"advantage_estimator {name!r}"
    if not isinstance(result, list | tuple) or len(result) != len(rewards_GM):
        got = f"{type(result).__name__} of {len(result)}" if isinstance(result, list | tuple) else type(result).__name__
        raise ValueError(f"{where} must return one entry per group ({len(rewards_GM)}), got {got}")
    out: list[list[float] | None] = []
    for g, (group, advantages) in enumerate(zip(rewards_GM, result, strict=True)):
        if advantages is None:
            out.append(None)
            continue
        if not isinstance(advantages, list | tuple) or len(advantages) != len(group):
            size = len(advantages) if isinstance(advantages, list | tuple) else type(advantages).__name__
            raise ValueError(f"{where}: group {g} has {len(group)} members but {size} advantages")
        values = []
        for i, a in enumerate(advantages):
            if isinstance(a, bool) or not isinstance(a, int | float) or not math.isfinite(a):
                raise ValueError(f"{where}: group {g} member {i} has advantage {a!r}, not a finite number")
            values.append(float(a))
        out.append(values)
    return out


@functools.cache
def load_estimator(name: str) -> Estimator:
    """A user's estimator from its import path ('pkg.module:fn' or 'path/to/file.py:fn'), checked by a trial call on
    TRIAL_REWARDS (three groups, one of a single member); ValueError naming `advantage_estimator` if anything fails."""
    from fleetrl.user_code import load_object

    if ":" not in name:
        raise ValueError(
            f"advantage_estimator {name!r} is not one of {list(BUILT_IN)} nor an import path "
            "('package.module:function' or 'path/to/file.py:function')"
        )
    try:
        fn = load_object(name)
    except Exception as exc:  # importing the user's module may raise anything
        raise ValueError(f"advantage_estimator {name!r}: cannot load it ({type(exc).__name__}: {exc})") from None
    if not callable(fn):
        raise ValueError(f"advantage_estimator {name!r} names a {type(fn).__name__}, not a function")
    trial = [list(g) for g in TRIAL_REWARDS]
    try:
        result = fn(trial)
    except Exception as exc:  # whatever the user's code raises is reported, naming the field
        raise ValueError(
            f"advantage_estimator {name!r}: a trial call at start raised {type(exc).__name__}: {exc}"
        ) from None
    check_result(name, TRIAL_REWARDS, result)
    return fn


def estimate(name: str, rewards_GM: list[list[float]], mode: str = "standardize") -> list[list[float] | None]:
    """Advantages per member of each group by the estimator `name` (`mode`: grpo's advantage_mode)."""
    if name == "grpo":
        return grpo(rewards_GM, mode)
    if name == "rloo":
        return rloo(rewards_GM)
    if name == "reinforce_pp":
        return reinforce_pp(rewards_GM)
    return check_result(name, rewards_GM, load_estimator(name)([list(g) for g in rewards_GM]))
