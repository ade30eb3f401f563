"""Group assembly: G rollout results for one row -> a `RolloutGroup` to send, or the reason it is not sent.

Each result is a `RolloutSample`, None (the rollout chose to drop the sample), or an exception. Invalid samples
are dropped and counted with the validation message (`fleetrl.groups.split_valid`); a group with fewer than
`min_samples` survivors, or one the dynamic filter refuses (e.g. every reward equal: zero advantage, nothing to
learn), is rejected.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fleetrl.groups import RolloutGroup, split_valid
from fleetrl.rollout import RolloutSample

log = logging.getLogger(__name__)
DynamicFilter = Callable[[Sequence[RolloutSample]], bool]
DROP_REASONS: tuple[str, ...] = ("none", "error", "invalid", "too_long")
"""Why `assemble_group` drops a sample: the keys of `AssembledGroup.dropped` (and of RowReport.samples_dropped)."""


def drop_uniform_rewards(samples: Sequence[RolloutSample]) -> bool:
    """Keep a group only if its rewards differ (the DAPO dynamic-sampling filter)."""
    return len({s.reward for s in samples}) > 1


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
    results: Sequence[RolloutSample | BaseException | None],
    min_samples: int = 2,
    dynamic_filter: DynamicFilter | None = None,
    source: str = "",
    max_seq_len: int | None = None,
    attempt: int = 0,
    vocab_size: int | None = None,
    lease_tag: int = 0,
) -> AssembledGroup:
    candidates: list[RolloutSample] = []
    dropped: Counter[str] = Counter()
    for result in results:
        if result is None:
            dropped["none"] += 1
        elif isinstance(result, BaseException):
            dropped["error"] += 1
        elif not isinstance(result, RolloutSample):
            dropped["invalid"] += 1
            log.warning("row %d: rollout returned %s, expected RolloutSample or None", row_id, type(result).__name__)
        elif max_seq_len is not None and len(result.tokens) > max_seq_len:
            dropped["too_long"] += 1
            log.warning(
                "row %d: dropped a sample of %d tokens > max_seq_len %d", row_id, len(result.tokens), max_seq_len
            )
        else:
            candidates.append(result)
    group = split_valid(
        RolloutGroup(row_id, submit_version, candidates, source=source, attempt=attempt, lease_tag=lease_tag),
        vocab_size,
    )
    for bad in group.dropped:
        dropped["invalid"] += 1
        log.warning("dropped an invalid sample: %s", bad.message)
    out = AssembledGroup(group, accepted=True, dropped=dropped)
    if len(group.samples) < min_samples:
        out.accepted, out.reason = False, f"only {len(group.samples)} valid samples (need {min_samples})"
    elif dynamic_filter is not None and not dynamic_filter(group.samples):
        out.accepted, out.reason = False, "dynamic filter"
    return out
