"""Turn-level credit (issue 44 item 1): per-turn rewards on a sample, the `turn_discounted` estimator against
hand-computed vectors, a user's turn-level estimator tried at start and refused naming the field, and the step's
batch training each turn's tokens with that turn's advantage."""

from __future__ import annotations

import textwrap

import pytest
import torch

from fleetrl.rollout import InvalidSampleError, RolloutSample, turn_spans, validate_sample
from fleetrl.rollout_group import RolloutGroup
from fleetrl.trainer.advantage_estimators import (
    discounted_returns,
    estimate_turns,
    load_estimator,
    turn_discounted,
)
from fleetrl.trainer.datum import samples_to_batch
from fleetrl.trainer.step_batch import build_step_batch


def two_turns(reward: float, turn_rewards: list[float] | None, member: int | None = None) -> RolloutSample:
    # prompt 10, turn 0 = [11, 12], observation 13, turn 1 = [14]
    return RolloutSample(
        tokens=[10, 11, 12, 13, 14],
        logprobs=[0.0, -0.5, -0.5, 0.0, -0.25],
        loss_mask=[0, 1, 1, 0, 1],
        reward=reward,
        turn_rewards=turn_rewards,
        member=member,
    )


def test_discounted_returns_by_hand():
    # G_2 = 4; G_1 = 0 + 0.5 * 4 = 2; G_0 = 1 + 0.5 * 2 = 2
    assert discounted_returns([1.0, 0.0, 4.0], 0.5) == [2.0, 2.0, 4.0]
    assert discounted_returns([1.0, 0.0, 4.0], 1.0) == [5.0, 4.0, 4.0]


def test_turn_discounted_normalises_each_turn_index_over_the_members_that_reach_it():
    # gamma 0.5, members' turn rewards [1, 1], [0, 1], [1, 0], [2] (one turn only)
    # returns: [1.5, 1], [0.5, 1], [1, 0], [2]
    # turn 0 over all four: mean (1.5 + 0.5 + 1 + 2) / 4 = 1.25 -> [0.25, -0.75, -0.25, 0.75]
    # turn 1 over the first three: mean 2/3 -> [1/3, 1/3, -2/3]
    out = turn_discounted([[[1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [2.0]], [[3.0]]], gamma=0.5, mode="center")
    assert out[1] is None  # a group of one
    assert out[0] == [
        pytest.approx([0.25, 1 / 3]),
        pytest.approx([-0.75, 1 / 3]),
        pytest.approx([-0.25, -2 / 3]),
        pytest.approx([0.75]),
    ]


def test_turn_discounted_standardizes_and_gives_a_lone_turn_no_credit():
    # turn 0 returns (gamma 1): [2, 0] -> standardized [0.7071, -0.7071]; turn 1 reached by member 0 alone -> 0
    out = turn_discounted([[[1.0, 1.0], [0.0]]], gamma=1.0)
    assert out[0] == [pytest.approx([0.70710678, 0.0]), pytest.approx([-0.70710678])]
    with pytest.raises(ValueError, match="turn_discount"):
        turn_discounted([[[1.0], [0.0]]], gamma=1.5)


def test_turns_are_trainable_runs_or_the_given_spans():
    assert turn_spans(two_turns(1.0, [0.0, 1.0])) == [(1, 3), (4, 5)]
    spans = RolloutSample(
        tokens=[10, 11, 12, 13, 14],
        logprobs=[0.0] * 5,
        loss_mask=[0, 1, 1, 0, 1],
        reward=1.0,
        turn_rewards=[0.5, 0.5],
        turn_ends=[2, 5],
    )
    validate_sample(spans)
    assert turn_spans(spans) == [(0, 2), (2, 5)]


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"turn_rewards": [1.0]}, "turn_rewards", "1 rewards for 2 turns"),
        ({"turn_rewards": [1.0, float("nan")]}, "turn_rewards", "turn 1 has nan"),
        ({"turn_rewards": [1.0, True]}, "turn_rewards", "turn 1 has True"),
        ({"turn_rewards": []}, "turn_rewards", "non-empty"),
        ({"turn_rewards": [1.0, 1.0], "turn_ends": [3, 4]}, "turn_ends", "span 1 \\[3, 4\\) has no trainable token"),
        ({"turn_rewards": [1.0, 1.0], "turn_ends": [3, 3]}, "turn_ends", "not past the previous one"),
        ({"turn_rewards": [1.0, 1.0], "turn_ends": [3, 4.5]}, "turn_ends", "not an int"),
        ({"turn_rewards": [1.0], "turn_ends": [3]}, "turn_ends", "ends at 3, not at len\\(tokens\\) 5"),
        ({"turn_rewards": [1.0, 1.0], "turn_ends": [5]}, "turn_ends", "1 span ends for 2 turn_rewards"),
        ({"turn_rewards": None, "turn_ends": [5]}, "turn_ends", "without turn_rewards"),
    ],
)
def test_bad_turn_fields_make_the_sample_invalid_naming_the_field(changes, field, message):
    sample = two_turns(1.0, None)
    for name, value in changes.items():
        setattr(sample, name, value)
    with pytest.raises(InvalidSampleError, match=message) as info:
        validate_sample(sample)
    assert info.value.field_name == field


def test_a_step_trains_each_turn_with_its_own_advantage():
    # Two members; turn rewards [0, 1] and [1, 1], gamma 1, center:
    # returns [1, 1] and [2, 1]; turn 0: mean 1.5 -> [-0.5, 0.5]; turn 1: [0, 0].
    group = RolloutGroup(row_id=4, submit_version=0, samples=[two_turns(1.0, [0.0, 1.0]), two_turns(2.0, [1.0, 1.0])])
    batch = build_step_batch([group], advantage_estimator="turn_discounted", advantage_mode="center", turn_discount=1.0)
    assert batch.advantages == [-0.5, 0.0, 0.5, 0.0]
    assert batch.sample_row_ids == [4, 4, 4, 4] and batch.stats["data/turn_sequences_added"] == 2.0
    first, second = batch.samples[0], batch.samples[1]
    assert first.tokens == [10, 11, 12] and first.loss_mask == [0, 1, 1]  # turn 0: up to its end, its tokens
    assert second.tokens == [10, 11, 12, 13, 14] and second.loss_mask == [0, 0, 0, 0, 1]  # turn 1 only
    # Every trainable token of the original samples is trained exactly once.
    assert sum(sum(s.loss_mask) for s in batch.samples) == 2 * 3


def test_split_turns_give_the_gradient_of_per_token_advantages():
    """The split is exact: the token-summed policy-gradient loss of the split sequences equals that of the whole
    sample with each token weighted by its own turn's advantage (a causal model sees the same prefix)."""
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)

    def logprobs(tokens_BT: torch.Tensor) -> torch.Tensor:  # causal: position t sees tokens <= t (cumulative mean)
        h = embed(tokens_BT).cumsum(1) / torch.arange(1, tokens_BT.shape[1] + 1)[None, :, None]
        return torch.log_softmax(head(h), -1)

    def pg_loss(samples: list[RolloutSample], advantages_BT: torch.Tensor) -> torch.Tensor:
        batch = samples_to_batch(samples)
        lp = logprobs(batch.input_tokens_BT).gather(-1, batch.target_tokens_BT[..., None])[..., 0]
        return -(lp * advantages_BT * batch.mask_BT).sum()

    other = two_turns(0.0, [1.0, -1.0])
    other.tokens = [10, 3, 4, 5, 6]  # different tokens, so the two samples' gradients do not cancel
    group = RolloutGroup(row_id=0, submit_version=0, samples=[two_turns(1.0, [0.0, 1.0]), other])
    batch = build_step_batch([group], advantage_estimator="turn_discounted", advantage_mode="center")
    assert len(batch.samples) == 4
    split = pg_loss(batch.samples, torch.tensor(batch.advantages)[:, None])
    grads_split = torch.autograd.grad(split, [*embed.parameters(), *head.parameters()])
    # returns [1, 1] and [0, -1]: turn 0 centred [0.5, -0.5], turn 1 [1, -1]; target-aligned per-token advantages
    per_token = torch.tensor([[0.5, 0.5, 0.0, 1.0], [-0.5, -0.5, 0.0, -1.0]])
    whole = pg_loss(group.samples, per_token)
    grads_whole = torch.autograd.grad(whole, [*embed.parameters(), *head.parameters()])
    assert float(split.detach()) == pytest.approx(float(whole.detach()), rel=1e-5)
    assert any(float(g.abs().max()) > 1e-3 for g in grads_whole)  # a real gradient, not two zeros
    for a, b in zip(grads_split, grads_whole, strict=True):
        torch.testing.assert_close(a, b)


def test_a_sample_without_turn_rewards_has_its_reward_on_its_last_turn():
    # Member 0 gives turn rewards [1, 0]; member 1 none, reward 1 -> turns [0, 1]. gamma 0.5, center:
    # returns [1, 0] and [0.5, 1]; turn 0: [0.25, -0.25]; turn 1: [-0.5, 0.5]
    group = RolloutGroup(row_id=0, submit_version=0, samples=[two_turns(1.0, [1.0, 0.0]), two_turns(1.0, None)])
    batch = build_step_batch([group], advantage_estimator="turn_discounted", advantage_mode="center", turn_discount=0.5)
    assert batch.advantages == [0.25, -0.5, -0.25, 0.5]


def test_a_split_member_takes_its_turns_across_its_samples_in_order():
    # Member 0 is two samples (a rewritten history), one turn each: turn rewards [1] then [0] -> member turns [1, 0].
    one_turn = dict(tokens=[10, 11], logprobs=[0.0, -0.1], loss_mask=[0, 1], reward=1.0, member=0)
    group = RolloutGroup(
        row_id=0,
        submit_version=0,
        samples=[
            RolloutSample(**one_turn, turn_rewards=[1.0]),
            RolloutSample(**one_turn, turn_rewards=[0.0]),
            two_turns(0.0, [0.0, 0.0], member=1),
        ],
    )
    # returns (gamma 1): member 0 [1, 0], member 1 [0, 0]; center: turn 0 [0.5, -0.5], turn 1 [0, 0]
    batch = build_step_batch([group], advantage_estimator="turn_discounted", advantage_mode="center")
    assert batch.advantages == [0.5, 0.0, -0.5, 0.0]
    assert [len(s.tokens) for s in batch.samples] == [2, 2, 3, 5]


def test_one_turn_samples_reduce_to_grpo():
    group = RolloutGroup(
        row_id=0,
        submit_version=0,
        samples=[RolloutSample(tokens=[1, 2], logprobs=[0.0, -1.0], loss_mask=[0, 1], reward=r) for r in (1.0, 0.0)],
    )
    turn = build_step_batch([group], advantage_estimator="turn_discounted")
    grpo = build_step_batch([group], advantage_estimator="grpo")
    assert turn.advantages == pytest.approx(grpo.advantages) and len(turn.samples) == 2


def write_estimator(tmp_path, body: str) -> str:
    path = tmp_path / "turn_adv.py"
    path.write_text(textwrap.dedent(body))
    load_estimator.cache_clear()
    return f"{path}:estimate"


def test_a_users_turn_level_estimator_gets_the_turn_rewards(tmp_path):
    spec = write_estimator(
        tmp_path,
        """
        def estimate(rewards, *, turn_rewards):
            return [None if len(g) < 2 else [[10.0 * r for r in m] for m in g] for g in turn_rewards]
        """,
    )
    group = RolloutGroup(row_id=0, submit_version=0, samples=[two_turns(1.0, [0.0, 1.0]), two_turns(2.0, [1.0, 1.0])])
    batch = build_step_batch([group], advantage_estimator=spec)
    assert batch.advantages == [0.0, 10.0, 10.0]  # the second sample's turns share 10: it stays whole
    assert estimate_turns(spec, [[1.0, 2.0]], [[[0.5], [1.0]]]) == [[[5.0], [10.0]]]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "return [None if len(g) < 2 else [[1.0] * (len(m) + 1) for m in g] for g in turn_rewards]",
            "has 2 turns \\(spans with trainable tokens\\) but 3 advantages; advantages go on trainable turns only",
        ),
        (
            "return [None if len(g) < 2 else [[float('inf')] * len(m) for m in g] for g in turn_rewards]",
            "has advantage inf, not a finite number",
        ),
        (
            "return [None if len(g) < 2 else [[1.0] * len(m) for m in g[1:]] for g in turn_rewards]",
            "has 4 members but 3 advantages",
        ),
        ("return [[]]", "must return one entry per group \\(3\\), got list of 1"),
        ("raise KeyError('turn')", "a trial call at start raised KeyError"),
    ],
)
def test_a_bad_turn_level_estimator_is_refused_at_start_naming_the_field(tmp_path, body, message):
    spec = write_estimator(tmp_path, f"def estimate(rewards, *, turn_rewards):\n    {body}\n")
    with pytest.raises(ValueError, match=f"advantage_estimator '.*turn_adv.py:estimate'.*{message}"):
        load_estimator(spec)


def test_a_turn_level_result_is_checked_every_step(tmp_path):
    # Passes the trial (members of at most three turns) but gives a four-turn member only three advantages.
    spec = write_estimator(
        tmp_path,
        """
        def estimate(rewards, *, turn_rewards):
            return [None if len(g) < 2 else [[0.0] * min(len(m), 3) for m in g] for g in turn_rewards]
        """,
    )
    four = [[0.0, 0.0, 0.0, 1.0], [1.0]]
    with pytest.raises(ValueError, match=r"group 0 member 0 has 4 turns .* but 3 advantages"):
        estimate_turns(spec, [[1.0, 1.0]], [four])
