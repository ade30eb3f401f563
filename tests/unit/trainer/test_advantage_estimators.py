"""Advantage estimators (issue 44 item 1): each built-in one against hand-computed vectors, the step's batch built
with them, and a user's estimator loaded by import path, tried at start and refused with the field named when it
returns the wrong shape or a non-finite value."""

from __future__ import annotations

import math
import textwrap

import pytest

from fleetrl import Config
from fleetrl.rollout import RolloutSample
from fleetrl.rollout_group import RolloutGroup
from fleetrl.trainer.advantage_estimators import check_result, estimate, load_estimator, reinforce_pp, rloo
from fleetrl.trainer.step_batch import build_step_batch


def test_rloo_subtracts_the_mean_of_the_others():
    # [1, 0, 0.5]: 1 - (0 + 0.5)/2 = 0.75; 0 - 0.75 = -0.75; 0.5 - 0.5 = 0
    assert rloo([[1.0, 0.0, 0.5], [2.0], [3.0, 1.0]]) == [[0.75, -0.75, 0.0], None, [2.0, -2.0]]


def test_reinforce_pp_centres_each_group_then_normalises_over_the_batch():
    # centred: [0.5, -0.5], [1.0, -1.0]; over the batch mean 0, std sqrt((0.25 + 0.25 + 1 + 1) / 3) = sqrt(5/6)
    std = math.sqrt(5 / 6)
    out = reinforce_pp([[1.0, 0.0], [3.0, 1.0], [7.0]])
    assert out[2] is None
    assert out[0] == pytest.approx([0.5 / std, -0.5 / std]) and out[1] == pytest.approx([1 / std, -1 / std])
    assert reinforce_pp([[1.0, 1.0], [2.0, 2.0]]) == [[0.0, 0.0], [0.0, 0.0]]  # no signal anywhere


def test_grpo_is_the_group_normalisation_it_always_was():
    assert estimate("grpo", [[1.0, 0.0]], "center") == [[0.5, -0.5]]
    out = estimate("grpo", [[1.0, 0.0, 0.0, 1.0]])[0]
    assert out == pytest.approx([0.866, -0.866, -0.866, 0.866], abs=1e-3)  # (r - 0.5) / std_unbiased(0.577)


def sample(reward: float, member: int | None = None) -> RolloutSample:
    return RolloutSample(
        tokens=[1, 2, 3], logprobs=[0.0, -1.0, -1.0], loss_mask=[0, 1, 1], reward=reward, member=member
    )


def test_a_batch_built_with_rloo_gives_split_members_one_advantage():
    groups = [
        RolloutGroup(row_id=0, submit_version=0, samples=[sample(1.0, 0), sample(1.0, 0), sample(0.0, 1)]),
        RolloutGroup(row_id=1, submit_version=0, samples=[sample(1.0)]),  # one member: no signal, skipped
    ]
    batch = build_step_batch(groups, advantage_estimator="rloo")
    assert batch.advantages == [1.0, 1.0, -1.0] and batch.skipped_row_ids == [1]


def write_estimator(tmp_path, body: str) -> str:
    path = tmp_path / "adv.py"
    path.write_text(textwrap.dedent(body))
    load_estimator.cache_clear()
    return f"{path}:estimate"


def test_a_users_estimator_is_loaded_tried_and_used(tmp_path):
    spec = write_estimator(
        tmp_path,
        """
        def estimate(rewards):
            return [None if len(g) < 2 else [2.0 * r for r in g] for g in rewards]
        """,
    )
    assert estimate(spec, [[1.0, 0.5], [3.0]]) == [[2.0, 1.0], None]
    assert Config(advantage_estimator=spec).advantage_estimator == spec


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("def estimate(rewards):\n    raise RuntimeError('boom')\n", "trial call at start raised RuntimeError: boom"),
        ("def estimate(rewards):\n    return [[0.0]]\n", "must return one entry per group"),
        ("def estimate(rewards):\n    return [[0.0] for g in rewards]\n", "group 0 has 4 members but 1 advantages"),
        ("def estimate(rewards):\n    return [[float('nan')] * len(g) for g in rewards]\n", "not a finite number"),
        ("estimate = 3\n", "not a function"),
    ],
)
def test_a_bad_estimator_is_refused_at_start_naming_the_field(tmp_path, body, message):
    spec = write_estimator(tmp_path, body)
    with pytest.raises(ValueError, match="advantage_estimator") as info:
        load_estimator(spec)
    assert message in str(info.value)


def test_results_are_checked_every_step():
    with pytest.raises(ValueError, match="group 1 member 0 has advantage inf"):
        check_result("x:y", [[1.0], [2.0]], [[0.0], [math.inf]])
    assert check_result("x:y", [[1.0, 2.0]], [(1, 2)]) == [[1.0, 2.0]]


def test_an_unknown_name_is_refused_by_the_config():
    with pytest.raises(ValueError, match="advantage_estimator"):
        Config(advantage_estimator="ppo_gae")


def test_fleetrl_up_refuses_a_bad_estimator_before_any_service_starts(tmp_path, capsys, monkeypatch):
    from fleetrl.up import run as up_run
    from tests.unit.up.test_up_config_checks import write_config

    spec = write_estimator(tmp_path, "def estimate(rewards):\n    return None\n")
    config = write_config(tmp_path, advantage_estimator=spec)
    monkeypatch.setattr(up_run, "launch", lambda *a, **k: pytest.fail("services were started"))
    assert up_run.main([str(config)]) == 2
    err = capsys.readouterr().err
    assert "run.advantage_estimator" in err and "one entry per group" in err
