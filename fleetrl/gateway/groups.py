"""Group assembly: G rollout results for one row -> a validated group, or the reason it is not sent.

Each result is a `RolloutSample`, None (the rollout chose to drop the sample), or an exception. Invalid samples
are dropped and counted with the validation message; a group with fewer than `min_samples` survivors, or one
the dynamic filter refuses (e.g. every reward equal: zero advantage, nothing to learn), is rejected.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fleetrl.rollout import InvalidSampleError, RolloutSample

log = logging.getLogger(__name__)
DynamicFilter = Callable[[Sequence[RolloutSample]], bool]


def drop_uniform_rewards(samples: Sequence[RolloutSample]) -> bool:
    """Keep a group only if its rewards differ (the DAPO dynamic-sampling filter)."""
    return len({s.reward for s in samples}) > 1


@dataclass
class AssembledGroup:
    row_id: int
    submit_version: int
    samples: list[RolloutSample]
    accepted: bool
    reason: str = ""
    dropped: Counter[str] = field(default_factory=Counter)

    @property
    def min_version(self) -> int:
        """Oldest policy version behind any token of the group (the submit version when unknown)."""
        versions = [
            min(v for v, m in zip(s.versions, s.loss_mask, strict=True) if m) for s in self.samples if s.versions
        ]
        return min([self.submit_version, *versions])


def assemble_group(
    row_id: int,
    submit_version: int,
    results: Sequence[RolloutSample | BaseException | None],
    min_samples: int = 2,
    dynamic_filter: DynamicFilter | None = None,
) -> AssembledGroup:
    kept: list[RolloutSample] = []
    dropped: Counter[str] = Counter()
    for result in results:
        if result is None:
            dropped["none"] += 1
        elif isinstance(result, BaseException):
            dropped["error"] += 1
        else:
            try:
                kept.append(result.validate() if isinstance(result, RolloutSample) else _not_a_sample(result))
            except InvalidSampleError as exc:
                dropped["invalid"] += 1
                log.warning("row %d: dropped an invalid sample: %s", row_id, exc)
    group = AssembledGroup(row_id, submit_version, kept, accepted=True, dropped=dropped)
    if len(kept) < min_samples:
        group.accepted, group.reason = False, f"only {len(kept)} valid samples (need {min_samples})"
    elif dynamic_filter is not None and not dynamic_filter(kept):
        group.accepted, group.reason = False, "dynamic filter"
    return group


def _not_a_sample(value: object) -> RolloutSample:
    raise InvalidSampleError("<type>", f"rollout returned {type(value).__name__}, expected RolloutSample or None")
