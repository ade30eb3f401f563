"""Step building: advantages per group, the samples refused (off-policy, vocabulary) and the step's statistics
(fleetrl.trainer.step_batch)."""

from __future__ import annotations

from fleetrl.rollout import RolloutSample
from fleetrl.rollout_group import RolloutGroup
from fleetrl.trainer.step_batch import build_step_batch


def _sample(reward: float, versions: list[int] | None = None, metrics: dict | None = None) -> RolloutSample:
    return RolloutSample(
        tokens=[1, 2, 3, 4],
        logprobs=[0.0, 0.0, -1.0, -1.0],
        loss_mask=[0, 0, 1, 1],
        reward=reward,
        versions=versions,
        metrics=metrics or {},
    )


def test_advantages_per_group_and_groups_of_one_skipped():
    groups = [
        RolloutGroup(7, 3, [_sample(r) for r in (1.0, 0.0, 0.0, 1.0)]),
        RolloutGroup(8, 3, [_sample(1.0)]),
    ]
    batch = build_step_batch(groups, train_version=4)
    assert [round(a, 3) for a in batch.advantages] == [0.866, -0.866, -0.866, 0.866]
    assert batch.row_ids == [7] and batch.skipped_row_ids == [8] and batch.num_samples == 4
    assert batch.stats["rollout/filtered_reward"] == 0.5 and batch.stats["data/groups_skipped"] == 1
    assert batch.stats["async/version_offset_max"] == 1.0  # no per-token versions: submit_version


def test_a_trajectory_split_into_samples_counts_once_and_its_samples_share_its_advantage():
    unsplit = build_step_batch([RolloutGroup(7, 3, [_sample(r) for r in (1.0, 0.0, 0.0, 1.0)])])
    pieces = [RolloutSample([1, 2, 3, 4], [0.0, 0.0, -1.0, -1.0], [0, 0, 1, 1], 0.0, member=1) for _ in range(3)]
    split = build_step_batch([RolloutGroup(7, 3, [_sample(1.0), *pieces, _sample(0.0), _sample(1.0)])])
    a = unsplit.advantages
    assert split.advantages == [a[0], a[1], a[1], a[1], a[2], a[3]] and split.num_samples == 6


def test_center_mode_and_version_offsets_from_trainable_tokens():
    samples = [
        _sample(2.0, versions=[0, 0, 5, 6], metrics={"correct": 1}),
        _sample(0.0, versions=[9, 9, 3, 4], metrics={"correct": 0}),
    ]
    batch = build_step_batch([RolloutGroup(1, 2, samples)], advantage_mode="center", train_version=6)
    assert batch.advantages == [1.0, -1.0]
    # Offsets count the oldest *generated* token: 6-5 and 6-3 (prompt versions are ignored).
    assert batch.stats["async/version_offset_mean"] == 2.0 and batch.stats["async/version_offset_max"] == 3.0
    assert batch.stats["env/all/correct"] == 0.5


def test_samples_beyond_the_bound_are_refused_before_advantages():
    # Defence in depth (stale_policy = requeue): whatever the controller decided, a sample more than O versions
    # behind the trained version is not trained, and is counted.
    fresh = [_sample(r, versions=[0, 0, 5, 5]) for r in (1.0, 0.0)]
    stale = _sample(1.0, versions=[0, 0, 3, 5])  # oldest generated token: version 3, offset 2 at version 5
    batch = build_step_batch([RolloutGroup(1, 5, [*fresh, stale])], train_version=5, max_offpolicy=1)
    assert batch.num_samples == 2 and batch.stats["train/samples_refused_stale"] == 1.0
    assert batch.stats["async/version_offset_max"] == 0.0
    assert [round(a, 3) for a in batch.advantages] == [0.707, -0.707]  # computed without the refused sample
    # A group left with fewer than two samples is skipped; stale_policy = "train" (None) keeps everything.
    only_stale = RolloutGroup(2, 3, [stale, _sample(0.0, versions=[0, 0, 3, 3])])
    assert build_step_batch([only_stale], train_version=5, max_offpolicy=1).skipped_row_ids == [2]
    kept = build_step_batch([only_stale], train_version=5)
    assert kept.num_samples == 2 and "train/samples_refused_stale" not in kept.stats
    assert kept.stats["async/version_offset_max"] == 2.0 and kept.stats["async/version_offset_min"] == 2.0


def test_samples_with_token_ids_beyond_the_vocabulary_are_refused_not_fatal():
    good = [_sample(r) for r in (1.0, 0.0)]
    bad = RolloutSample([1, 2, 100512, 4], [0.0, 0.0, -1.0, -1.0], [0, 0, 1, 1], 1.0)
    batch = build_step_batch([RolloutGroup(1, 0, [*good, bad])], vocab_size=1000)
    assert batch.num_samples == 2 and batch.stats["train/samples_refused_vocab"] == 1.0
