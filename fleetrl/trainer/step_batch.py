"""From a step's rollout groups to its batch: advantages per group, the samples kept, and the step's statistics.

A step is P groups. Each group's rewards become advantages (fleetrl.trainer.advantages), one per group member: the
samples of a trajectory split into several (`RolloutSample.member`) share their member's advantage; a group with
fewer than two valid members carries no relative signal and is skipped. Samples too far off-policy or with token
ids outside the vocabulary are refused and counted first. How the batch is then split for the optimizer is
fleetrl.trainer.minibatches.

A turn-level estimator (`turn_discounted`, or a user's taking `turn_rewards`) gives one advantage per turn of each
member instead (a member's turns are its samples' turns in order, `fleetrl.rollout.turn_spans`). A sample whose
turns got different advantages is trained as one sequence per turn: the sample up to the end of turn k, trainable
only on turn k's tokens, with turn k's advantage. The model is causal, so each turn's logprobs are those of the whole
sample and the loss and gradient are as if each token carried its own turn's advantage (with a token-level
loss_agg_mode; a per-sequence mean weighs each turn as a sequence of its own); the cost is the prefixes
computed again (a two-turn sample costs about 1.5 times its tokens). The losses take one advantage per sequence,
which is why the split happens here rather than as per-token advantages.

Pure logic: no sockets, no process groups, no torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

from fleetrl.rollout import RolloutSample, turn_spans
from fleetrl.rollout_group import RolloutGroup
from fleetrl.step_metrics import sample_metrics
from fleetrl.trainer.advantage_estimators import estimate, estimate_turns, is_turn_level


@dataclass
class StepBatch:
    """The samples of one step with their advantages, and what was left out."""

    samples: list[RolloutSample]
    advantages: list[float]
    row_ids: list[int]  # rows whose samples are in `samples`
    skipped_row_ids: list[int] = field(default_factory=list)  # fewer than 2 valid samples
    stats: dict[str, float] = field(default_factory=dict)
    sample_row_ids: list[int] = field(default_factory=list)  # the row of each of `samples`
    sample_offsets: list[int] = field(default_factory=list)  # the version offset of each of `samples`

    @property
    def num_samples(self) -> int:
        return len(self.samples)


def build_step_batch(
    groups: Sequence[RolloutGroup],
    *,
    advantage_mode: str = "standardize",
    advantage_estimator: str = "grpo",
    train_version: int = 0,
    max_offpolicy: int | None = None,
    vocab_size: int | None = None,
    turn_discount: float = 1.0,
) -> StepBatch:
    """Advantages per group and the step's data statistics.

    train_version: the policy version this step trains against (the version offset of a sample is
    train_version minus the oldest version that generated one of its trainable tokens).
    max_offpolicy: when set (stale_policy "requeue"), a sample more than this many versions behind is refused
    and counted (`train/samples_refused_stale`) before advantages are computed. The controller already keeps
    stale groups out; this is defence in depth, so the bound holds for every trained sample whatever a
    sender claims.
    vocab_size: the model's embedding rows; a sample with a token id at or above it is refused and counted
    (`train/samples_refused_vocab`) instead of failing the step in the embedding lookup.
    advantage_estimator: how the groups' rewards become advantages (fleetrl.trainer.advantage_estimators): it sees
    every group of the step at once, one reward per member (a turn-level one: rewards per turn, see above).
    turn_discount: gamma of the `turn_discounted` estimator.
    """
    samples: list[RolloutSample] = []
    advantages: list[float] = []
    row_ids: list[int] = []
    sample_row_ids: list[int] = []
    sample_offsets: list[int] = []
    skipped: list[int] = []
    refused = {"stale": 0, "vocab": 0}
    kept_groups: list[RolloutGroup] = []
    for group in groups:
        kept = group.samples
        if vocab_size is not None:
            kept = [s for s in kept if max(s.tokens) < vocab_size]
            refused["vocab"] += len(group.samples) - len(kept)
        if max_offpolicy is not None:
            fresh = [s for s in kept if _sample_offset(s, group.submit_version, train_version) <= max_offpolicy]
            refused["stale"] += len(kept) - len(fresh)
            kept = fresh
        if len(kept) != len(group.samples):
            group = replace(group, samples=kept)
        kept_groups.append(group)
    members_G = [_members(group) for group in kept_groups]
    rewards_GM = [list(member_reward.values()) for member_reward, _ in members_G]
    split_turns = 0
    if is_turn_level(advantage_estimator):
        turns_GMK = [
            _member_turn_rewards(group, member_reward, keys)
            for group, (member_reward, keys) in zip(kept_groups, members_G, strict=True)
        ]
        per_group = estimate_turns(advantage_estimator, rewards_GM, turns_GMK, advantage_mode, turn_discount)
    else:
        per_group = estimate(advantage_estimator, rewards_GM, advantage_mode)
    for group, (member_reward, keys), group_adv in zip(kept_groups, members_G, per_group, strict=True):
        if group_adv is None:
            skipped.append(group.row_id)
            continue
        by_member = dict(zip(member_reward, group_adv, strict=True))
        group_samples: list[RolloutSample] = list(group.samples)
        group_advantages: list[float] = [by_member[key] for key in keys]  # type: ignore[misc]
        if group_samples and isinstance(group_advantages[0], list):
            group_samples, group_advantages = _split_by_turn(group.samples, keys, by_member)  # type: ignore[arg-type]
            split_turns += len(group_samples) - len(group.samples)
        samples.extend(group_samples)
        advantages.extend(group_advantages)
        row_ids.append(group.row_id)
        sample_row_ids.extend([group.row_id] * len(group_samples))
        sample_offsets.extend(_sample_offset(s, group.submit_version, train_version) for s in group_samples)
    batch = StepBatch(
        samples, advantages, row_ids, skipped, sample_row_ids=sample_row_ids, sample_offsets=sample_offsets
    )
    batch.stats = step_stats(kept_groups, batch, train_version)
    if max_offpolicy is not None:
        batch.stats["train/samples_refused_stale"] = float(refused["stale"])
    if vocab_size is not None:
        batch.stats["train/samples_refused_vocab"] = float(refused["vocab"])
    if split_turns:
        batch.stats["data/turn_sequences_added"] = float(split_turns)
    return batch


def _member_turn_rewards(
    group: RolloutGroup, member_reward: dict[Hashable, float], keys: list[Hashable]
) -> list[list[float]]:
    """Each member's rewards per turn: its samples' `turn_rewards` in order (0 for the turns of a sample without
    them); a member none of whose samples has any gets its reward on its last turn, 0 on the others."""
    turns: dict[Hashable, list[float]] = {key: [] for key in member_reward}
    given: set[Hashable] = set()
    for key, sample in zip(keys, group.samples, strict=True):
        if sample.turn_rewards is not None:
            turns[key].extend(float(r) for r in sample.turn_rewards)
            given.add(key)
        else:
            turns[key].extend([0.0] * len(turn_spans(sample)))
    for key, reward in member_reward.items():
        if key not in given and turns[key]:
            turns[key][-1] = float(reward)
    return [turns[key] for key in member_reward]


def _split_by_turn(
    group_samples: Sequence[RolloutSample], keys: list[Hashable], by_member: dict[Hashable, list[float]]
) -> tuple[list[RolloutSample], list[float]]:
    """The group's samples with one advantage each: a sample whose turns share one advantage stays whole; any other
    becomes one sequence per turn (its tokens up to the turn's end, trainable on the turn's tokens only)."""
    used: dict[Hashable, int] = {}
    out_samples: list[RolloutSample] = []
    out_advantages: list[float] = []
    for key, sample in zip(keys, group_samples, strict=True):
        spans = turn_spans(sample)
        first = used.get(key, 0)
        turn_advantages = by_member[key][first : first + len(spans)]
        used[key] = first + len(spans)
        if len(set(turn_advantages)) == 1:
            out_samples.append(sample)
            out_advantages.append(turn_advantages[0])
            continue
        for (start, end), advantage in zip(spans, turn_advantages, strict=True):
            mask = [m if start <= i else 0 for i, m in enumerate(sample.loss_mask[:end])]
            out_samples.append(
                replace(
                    sample,
                    tokens=sample.tokens[:end],
                    logprobs=sample.logprobs[:end],
                    loss_mask=mask,
                    versions=None if sample.versions is None else sample.versions[:end],
                    turn_rewards=None,
                    turn_ends=None,
                )
            )
            out_advantages.append(advantage)
    return out_samples, out_advantages


def _members(group: RolloutGroup) -> tuple[dict[Hashable, float], list[Hashable]]:
    """The group's members with their rewards (a member's reward is its first sample's; a sample with no member
    is a member of its own), and each sample's member key."""
    keys: list[Hashable] = [
        ("sample", i) if s.member is None else ("member", s.member) for i, s in enumerate(group.samples)
    ]
    member_reward: dict[Hashable, float] = {}
    for key, reward in zip(keys, group.rewards, strict=True):
        member_reward.setdefault(key, reward)
    return member_reward, keys


def _sample_offset(sample: RolloutSample, submit_version: int, train_version: int) -> int:
    if sample.versions is None:
        return train_version - submit_version
    versions = [v for v, m in zip(sample.versions, sample.loss_mask, strict=True) if m]
    return train_version - (min(versions) if versions else submit_version)


def step_stats(groups: Sequence[RolloutGroup], batch: StepBatch, train_version: int) -> dict[str, float]:
    """rollout/* (rewards, response lengths), env/all/<metric>, async/version_offset_mean|max|min
    (fleetrl.step_metrics), and batch sizes."""
    kept = set(batch.row_ids)
    samples: list[RolloutSample] = []
    offsets: list[int] = []
    for group in groups:
        if group.row_id not in kept:
            continue
        for s in group.samples:
            samples.append(s)
            offsets.append(_sample_offset(s, group.submit_version, train_version))
    stats: dict[str, float] = {
        "data/groups": float(len(batch.row_ids)),
        "data/groups_skipped": float(len(batch.skipped_row_ids)),
        "data/samples": float(len(batch.samples)),
        "data/tokens": float(sum(len(s.tokens) for s in batch.samples)),
        "data/trainable_tokens": float(sum(sum(s.loss_mask[1:]) for s in batch.samples)),
    }
    stats.update(sample_metrics(samples, offsets))
    return stats
