"""From a step's rollout groups to its batch: advantages per group, the samples kept, and the step's statistics.

A step is P groups. Each group's rewards become advantages (fleetrl.trainer.advantages), one per group member: the
samples of a trajectory split into several (`RolloutSample.member`) share their member's advantage; a group with
fewer than two valid members carries no relative signal and is skipped. Samples too far off-policy or with token
ids outside the vocabulary are refused and counted first. How the batch is then split for the optimizer is
fleetrl.trainer.minibatches.

Pure logic: no sockets, no process groups, no torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

from fleetrl.rollout import RolloutSample
from fleetrl.rollout_group import RolloutGroup
from fleetrl.step_metrics import sample_metrics
from fleetrl.trainer.advantage_estimators import estimate


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
    every group of the step at once, one reward per member.
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
    for group, (member_reward, keys), group_adv in zip(
        kept_groups, members_G, estimate(advantage_estimator, rewards_GM, advantage_mode), strict=True
    ):
        if group_adv is None:
            skipped.append(group.row_id)
            continue
        by_member = dict(zip(member_reward, group_adv, strict=True))
        samples.extend(group.samples)
        advantages.extend(by_member[key] for key in keys)
        row_ids.append(group.row_id)
        sample_row_ids.extend([group.row_id] * len(group.samples))
        sample_offsets.extend(_sample_offset(s, group.submit_version, train_version) for s in group.samples)
    batch = StepBatch(
        samples, advantages, row_ids, skipped, sample_row_ids=sample_row_ids, sample_offsets=sample_offsets
    )
    batch.stats = step_stats(kept_groups, batch, train_version)
    if max_offpolicy is not None:
        batch.stats["train/samples_refused_stale"] = float(refused["stale"])
    if vocab_size is not None:
        batch.stats["train/samples_refused_vocab"] = float(refused["vocab"])
    return batch


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
