"""Group assembly: G rollout results for one row -> a `RolloutGroup` to send, or the reason it is not sent.

Each result is a `RolloutSample`, a `RolloutRun` (one or more samples), None (the rollout chose to drop the
sample), or an exception; any other type raises `RolloutReturnTypeError` (the gateway stops: a bug, not a bad
sample). Invalid samples are dropped and counted with the validation message (`fleetrl.rollout_group.split_valid`); the
samples of a RolloutRun split into several get its member index (`RolloutSample.member`: one trajectory, one
advantage, counted once); a group with fewer than `min_samples` surviving trajectories, or one the dynamic filter
refuses (e.g. every reward equal: zero advantage, nothing to learn; fleetrl.gateway.dynamic_filter), is rejected.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fleetrl.gateway.dynamic_filter import DynamicFilter, PromptGroup
from fleetrl.rollout import InvalidSampleError, RolloutSample, rollout_result_samples
from fleetrl.rollout_group import RolloutGroup, split_valid

log = logging.getLogger(__name__)
DROP_REASONS: tuple[str, ...] = ("none", "error", "invalid", "too_long")
"""Why `assemble_group` drops a sample: the keys of `AssembledGroup.dropped` (and of RowReport.samples_dropped)."""


@dataclass
class AssembledGroup:
    group: RolloutGroup
    accepted: bool
    reason: str = ""
    dropped: Counter[str] = field(default_factory=Counter)

    @property
    def min_version(self) -> int:
        """Oldest policy version behind any trainable token (the submit version when unknown or newer)."""
        oldest = self.group.oldest_version()
        return self.group.submit_version if oldest is None else min(oldest, self.group.submit_version)


def assemble_group(
    row_id: int,
    submit_version: int,
    results: Sequence[Any],
    min_samples: int = 2,
    dynamic_filter: DynamicFilter | None = None,
    source: str = "",
    max_seq_len: int | None = None,
    attempt: int = 0,
    vocab_size: int | None = None,
    lease_tag: int = 0,
    row: dict[str, Any] | None = None,
) -> AssembledGroup:
    """Raises `RolloutReturnTypeError` when a result is of no known type (see the module docstring)."""
    candidates: list[RolloutSample] = []
    dropped: Counter[str] = Counter()
    for member, result in enumerate(results):
        if isinstance(result, BaseException):
            dropped["error"] += 1
            continue
        try:
            samples = rollout_result_samples(result)
        except InvalidSampleError as exc:  # a RolloutRun with a malformed segment
            dropped["invalid"] += 1
            log.warning("row %d: dropped an invalid RolloutRun: %s", row_id, exc)
            continue
        if samples is None:
            dropped["none"] += 1
        if samples is not None and len(samples) > 1:  # one trajectory as several samples: one advantage for all
            samples = [replace(sample, member=member) for sample in samples]
        for sample in samples or ():
            if max_seq_len is not None and isinstance(sample.tokens, list) and len(sample.tokens) > max_seq_len:
                dropped["too_long"] += 1
                log.warning(
                    "row %d: dropped a sample of %d tokens > max_seq_len %d", row_id, len(sample.tokens), max_seq_len
                )
            else:
                candidates.append(sample)
    group = split_valid(
        RolloutGroup(row_id, submit_version, candidates, source=source, attempt=attempt, lease_tag=lease_tag),
        vocab_size,
    )
    for bad in group.dropped:
        dropped["invalid"] += 1
        log.warning("dropped an invalid sample: %s", bad.message)
    out = AssembledGroup(group, accepted=True, dropped=dropped)
    # A trajectory split into several samples is one member: it alone carries no relative signal.
    members = len({("member", x.member) if x.member is not None else i for i, x in enumerate(group.samples)})
    if members < min_samples:
        split = "" if members == len(group.samples) else f" from {members} trajectories"
        out.accepted, out.reason = False, f"only {len(group.samples)} valid samples{split} (need {min_samples})"
    elif dynamic_filter is not None and not dynamic_filter(PromptGroup(list(group.samples), dict(row or {}), row_id)):
        out.accepted, out.reason = False, "dynamic filter"
    return out
