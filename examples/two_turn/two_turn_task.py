"""A two-turn task for turn-level credit (issue 44): the policy answers, sees whether it was right, answers again.

Turn 1: the prompt is a digit token p; the right answer is (p + 1) mod K. The environment then shows one of two
observation tokens, RIGHT or WRONG. Turn 2: after RIGHT the right answer is 0, after WRONG it is 1 (so a policy
that learned turn 2 can finish both kinds of episodes). The episode succeeds when both turns are right.

Two ways to reward it, both built by `episode_run`:
- one final reward: `reward` = 1 if both turns are right, else 0 (no turn_rewards): a turn is learned only in the
  episodes where the other one happened to be right too;
- per turn: `turn_rewards` = [turn 1 right, turn 2 right] beside the same total, for `advantage_estimator =
  "turn_discounted"`, which credits each turn with what it and the turns after it earned.

bench/turn_credit.py trains a tiny policy on it both ways (docs/benchmarks.md, docs/losses.md); rollout.py is the
task as a rollout function for `fleetrl up examples/two_turn/run.toml` (tests/integration/examples/test_two_turn_up.py).
"""

from __future__ import annotations

from fleetrl.rollout import RolloutRun, RolloutSegment

K = 32
"""Answers per turn: a uniform policy gets a turn right 1 time in K and an episode 1 time in K * K."""
RIGHT, WRONG = K, K + 1
VOCAB = K + 2


def turn1_target(prompt: int) -> int:
    return (prompt + 1) % K


def turn2_target(observation: int) -> int:
    return 0 if observation == RIGHT else 1


def observe(prompt: int, answer1: int) -> int:
    """The environment's reply to the first answer."""
    return RIGHT if answer1 == turn1_target(prompt) else WRONG


def episode_run(
    prompt: int, answer1: int, logprob1: float, answer2: int, logprob2: float, *, per_turn: bool, version: int = 0
) -> RolloutRun:
    """The episode as the cookbook's multi-segment return: segment 1 = prompt + first answer, segment 2 extends it
    with the observation and the second answer (one sample), rewarded once or per turn."""
    observation = observe(prompt, answer1)
    right1 = float(answer1 == turn1_target(prompt))
    right2 = float(answer2 == turn2_target(observation))
    first = RolloutSegment(
        tokens=[prompt, answer1], logprobs=[0.0, logprob1], loss_mask=[0, 1], versions=[version, version]
    )
    second = RolloutSegment(
        tokens=[prompt, answer1, observation, answer2],
        logprobs=[0.0, logprob1, 0.0, logprob2],
        loss_mask=[0, 1, 0, 1],
        versions=[version] * 4,
    )
    return RolloutRun(
        segments=[first, second],
        reward=right1 * right2,
        turn_rewards=[right1, right2] if per_turn else None,
        metrics={"turn1_right": right1, "turn2_right": right2, "success": right1 * right2},
    )
