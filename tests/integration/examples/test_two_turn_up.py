"""examples/two_turn under `fleetrl up` on the tiny model: multi-turn RolloutRuns with per-turn rewards go from the
rollout function through the gateway process and the group stream to the trainer service, whose turn-level
estimator sees every episode as its two turns and trains them as separate sequences. (The reward values along the
same path, assembly to stream to step batch, are checked in tests/unit/test_turn_rewards_path.py; a random tiny
model gets a turn right 1 time in ~500, so here they are nearly all 0.)"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.integration.examples.own_data_up import up_own_example

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# A turn-level estimator that records what it gets and gives a two-turn member's turns different advantages, so
# every two-turn sample is split (turn_discounted gives 0 to all when every reward is 0, and splits nothing).
ESTIMATOR = """
import json

def estimate(rewards, *, turn_rewards):
    with open({record!r}, "a") as f:
        f.write(json.dumps(turn_rewards) + "\\n")
    return [None if len(g) < 2 else [[1.0, -1.0] if len(m) == 2 else [0.0] * len(m) for m in g] for g in turn_rewards]
"""


def test_the_turns_of_each_episode_reach_the_trainer_service_and_train_apart(tiny_model_dir, tmp_path):
    record = tmp_path / "estimator_calls.jsonl"
    estimator = tmp_path / "turn_estimator.py"
    estimator.write_text(textwrap.dedent(ESTIMATOR.format(record=str(record))))
    sets = {
        "base_model": tiny_model_dir,
        "max_steps": 2,
        "advantage_estimator": f"{estimator}:estimate",
    }
    metrics = up_own_example("two_turn", tmp_path / "run", sets)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all("env/all/turn1_right" in m and "env/all/turn2_right" in m for m in metrics)
    # The steps' calls (groups of 8 members; the start-up trial calls have other shapes): two turns per member,
    # each a reward in {0, 1} as the task gives them.
    steps = [c for c in map(json.loads, record.read_text().splitlines()) if c and all(len(g) == 8 for g in c)]
    assert len(steps) == 2
    members = [m for call in steps for g in call for m in g]
    assert members and all(len(m) == 2 and set(m) <= {0.0, 1.0} for m in members)
    # Each two-turn sample trained as two sequences: the step's samples doubled.
    for m in metrics:
        assert m["data/turn_sequences_added"] == m["data/samples"] / 2
