"""Advantage estimators for a step's groups: built-in ones by name, or a user's function by import path.

    advantage_estimator = "grpo"          # group normalisation (advantage_mode: standardize or center), the default
    advantage_estimator = "rloo"          # leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024)
    advantage_estimator = "reinforce_pp"  # group-centred, then normalised over the whole batch (REINFORCE++, Hu 2025)
    advantage_estimator = "turn_discounted"  # per turn: discounted return-to-go, normalised per turn index
    advantage_estimator = "my_pkg.adv:estimate"   # or "path/to/file.py:estimate"

An estimator sees the whole step: `estimate(rewards_GM: list[list[float]]) -> list[list[float] | None]`, one list of
member rewards per group (a member is a trajectory: the samples of a split RolloutRun share it) and returns, per
group, one advantage per member, or None to skip the group (no relative signal). A user's estimator is imported and
given a trial call when the trainer starts (`check_estimator`): an exception, a result of the wrong shape or a
non-finite advantage fails the run at start with a ValueError naming `advantage_estimator`; the same checks run on
every step's result.

Turn-level estimators see each member's rewards per turn (`RolloutSample.turn_rewards`; a member without them has
its turns at 0 but the last, which has its total reward) and return, per member, one advantage per turn, which the
trainer puts on that turn's trainable tokens (fleetrl.trainer.step_batch). `turn_discounted` is built in; a user's
estimator is turn-level when it takes a `turn_rewards` keyword: `estimate(rewards_GM, *, turn_rewards)` with
`turn_rewards[g][m]` member m's list of per-turn rewards, returning per group None or per member a number (every turn
the same) or a list of one advantage per turn. Only turns with trainable tokens exist (a span without one is refused
on the sample), so a result with more advantages than turns (one for a masked stretch) is refused as the wrong shape.

Pure logic: no torch.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

from fleetrl.config import ADVANTAGE_ESTIMATORS
from fleetrl.trainer.advantages import STD_EPS, group_advantages

Estimator = Callable[..., list[Any]]
BUILT_IN: tuple[str, ...] = ADVANTAGE_ESTIMATORS
TURN_LEVEL_BUILT_IN: frozenset[str] = frozenset({"turn_discounted"})
TRIAL_REWARDS: list[list[float]] = [[1.0, 0.0, 0.5, 0.0], [0.2, 0.9], [1.0]]
TRIAL_TURN_REWARDS: list[list[list[float]]] = [
    [[0.0, 1.0], [0.5], [0.0, 0.0, 0.5], [0.0, 0.0]],
    [[0.2], [0.4, 0.5]],
    [[1.0]],
]
TURN_REWARDS_ARG = "turn_rewards"


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


def discounted_returns(turn_rewards: Sequence[float], gamma: float) -> list[float]:
    """G_k = r_k + gamma * G_{k+1}: each turn's reward and the discounted rewards of the turns after it."""
    returns = [0.0] * len(turn_rewards)
    following = 0.0
    for k in range(len(turn_rewards) - 1, -1, -1):
        following = float(turn_rewards[k]) + gamma * following
        returns[k] = following
    return returns


def turn_discounted(
    turn_rewards_GMK: list[list[list[float]]], gamma: float = 1.0, mode: str = "standardize"
) -> list[list[list[float]] | None]:
    """Turn-level credit for multi-turn runs: member m's turn k gets its discounted return-to-go G_mk
    (`discounted_returns`), normalised against the group's other members at the same turn index by `mode` (grpo's
    group normalisation: standardize or center), so a turn is credited for what it and the turns after it earned,
    compared with how the other members did from that turn on (turn-level GRPO: Zeng et al. 2025, "Reinforcing
    multi-turn reasoning in LLM agents via turn-level credit assignment"; discounted turn-level returns as in
    IGPO, 2025). A turn index reached by only one member has no baseline: advantage 0. A group of one: None."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"turn_discount {gamma!r} must be in [0, 1]")
    out: list[list[list[float]] | None] = []
    for group in turn_rewards_GMK:
        if len(group) < 2:
            out.append(None)
            continue
        returns_MK = [discounted_returns(turns, gamma) for turns in group]
        advantages_MK = [[0.0] * len(turns) for turns in group]
        for k in range(max(len(turns) for turns in group)):
            reached = [m for m, turns in enumerate(returns_MK) if len(turns) > k]
            normalised = group_advantages([returns_MK[m][k] for m in reached], mode)  # type: ignore[arg-type]
            if normalised is None:
                continue
            for m, a in zip(reached, normalised, strict=True):
                advantages_MK[m][k] = a
        out.append(advantages_MK)
    return out


def _finite(where: str, g: int, i: int, a: Any) -> float:
    if isinstance(a, bool) or not isinstance(a, int | float) or not math.isfinite(a):
        raise ValueError(f"{where}: group {g} member {i} has advantage {a!r}, not a finite number")
    return float(a)


def check_turn_result(
    name: str, turn_rewards_GMK: Sequence[Sequence[Sequence[float]]], result: Any
) -> list[list[list[float]] | None]:
    """A turn-level `result` as one advantage per turn of every member (a number for a member: every turn that
    number), or a ValueError naming `advantage_estimator` and what is wrong (the wrong shape, a non-finite value,
    an advantage for a turn that does not exist: a stretch with no trainable token)."""
    where = f"advantage_estimator {name!r}"
    if not isinstance(result, list | tuple) or len(result) != len(turn_rewards_GMK):
        got = f"{type(result).__name__} of {len(result)}" if isinstance(result, list | tuple) else type(result).__name__
        raise ValueError(f"{where} must return one entry per group ({len(turn_rewards_GMK)}), got {got}")
    out: list[list[list[float]] | None] = []
    for g, (group, advantages) in enumerate(zip(turn_rewards_GMK, result, strict=True)):
        if advantages is None:
            out.append(None)
            continue
        if not isinstance(advantages, list | tuple) or len(advantages) != len(group):
            size = len(advantages) if isinstance(advantages, list | tuple) else type(advantages).__name__
            raise ValueError(f"{where}: group {g} has {len(group)} members but {size} advantages")
        members: list[list[float]] = []
        for i, (turns, member) in enumerate(zip(group, advantages, strict=True)):
            if not isinstance(member, list | tuple):
                members.append([_finite(where, g, i, member)] * len(turns))
                continue
            if len(member) != len(turns):
                raise ValueError(
                    f"{where}: group {g} member {i} has {len(turns)} turns (spans with trainable tokens) but "
                    f"{len(member)} advantages; advantages go on trainable turns only"
                )
            members.append([_finite(where, g, i, a) for a in member])
        out.append(members)
    return out


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
        out.append([_finite(where, g, i, a) for i, a in enumerate(advantages)])
    return out


@functools.cache
def load_estimator(name: str) -> Estimator:
    """A user's estimator from its import path ('pkg.module:fn' or 'path/to/file.py:fn'), checked by a trial call on
    TRIAL_REWARDS (three groups, one of a single member; a turn-level one also gets TRIAL_TURN_REWARDS, members of
    one to three turns); ValueError naming `advantage_estimator` if anything fails."""
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
    turn_level = _takes_turn_rewards(fn)
    trial_turns = [[list(m) for m in g] for g in TRIAL_TURN_REWARDS]
    try:
        if turn_level:
            result = fn([[math.fsum(m) for m in g] for g in trial_turns], **{TURN_REWARDS_ARG: trial_turns})
        else:
            result = fn([list(g) for g in TRIAL_REWARDS])
    except Exception as exc:  # whatever the user's code raises is reported, naming the field
        raise ValueError(
            f"advantage_estimator {name!r}: a trial call at start raised {type(exc).__name__}: {exc}"
        ) from None
    if turn_level:
        check_turn_result(name, TRIAL_TURN_REWARDS, result)
    else:
        check_result(name, TRIAL_REWARDS, result)
    return fn


def _takes_turn_rewards(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: the one-reward form
        return False
    param = params.get(TURN_REWARDS_ARG)
    return param is not None and param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD)


def is_turn_level(name: str) -> bool:
    """Whether the estimator `name` gives advantages per turn (`estimate_turns`) rather than per member."""
    return name in TURN_LEVEL_BUILT_IN or (name not in BUILT_IN and _takes_turn_rewards(load_estimator(name)))


def estimate_turns(
    name: str,
    rewards_GM: list[list[float]],
    turn_rewards_GMK: list[list[list[float]]],
    mode: str = "standardize",
    gamma: float = 1.0,
) -> list[list[list[float]] | None]:
    """Advantages per turn of each member of each group by the turn-level estimator `name` (see the module
    docstring): `rewards_GM` the members' total rewards, `turn_rewards_GMK` their rewards per turn, `gamma`
    turn_discount, `mode` advantage_mode."""
    if name == "turn_discounted":
        return turn_discounted(turn_rewards_GMK, gamma, mode)
    copy = [[list(m) for m in g] for g in turn_rewards_GMK]
    result = load_estimator(name)([list(g) for g in rewards_GM], **{TURN_REWARDS_ARG: copy})
    return check_turn_result(name, turn_rewards_GMK, result)


def estimate(name: str, rewards_GM: list[list[float]], mode: str = "standardize") -> list[list[float] | None]:
    """Advantages per member of each group by the estimator `name` (`mode`: grpo's advantage_mode)."""
    if name == "grpo":
        return grpo(rewards_GM, mode)
    if name == "rloo":
        return rloo(rewards_GM)
    if name == "reinforce_pp":
        return reinforce_pp(rewards_GM)
    if is_turn_level(name):
        raise ValueError(f"advantage_estimator {name!r} is turn-level: call estimate_turns")
    return check_result(name, rewards_GM, load_estimator(name)([list(g) for g in rewards_GM]))
