"""The dynamic filter: which assembled groups are worth training on (`fn(PromptGroup) -> keep?`).

The filter receives a `PromptGroup` (the cookbook's shape: `.rewards`, `.samples`, `.row`); a filter written for a
bare list of samples keeps working, since a `PromptGroup` iterates, indexes and measures as its samples.
`drop_uniform_rewards` (the config's `dynamic_filter = "uniform"`) drops a group whose rewards are all equal: zero
advantage, nothing to learn.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetrl.rollout import RolloutSample


@dataclass
class PromptGroup(Sequence[RolloutSample]):
    """What the dynamic filter sees: the valid samples of one row, their rewards and the row itself."""

    samples: list[RolloutSample]
    row: dict[str, Any] = field(default_factory=dict)
    row_id: int = -1

    @property
    def rewards(self) -> list[float]:
        return [float(s.reward) for s in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[RolloutSample]:
        return iter(self.samples)

    def __getitem__(self, index):  # type: ignore[no-untyped-def, override]
        return self.samples[index]


DynamicFilter = Callable[[PromptGroup], bool]


def drop_uniform_rewards(group: PromptGroup | Sequence[RolloutSample]) -> bool:
    """Keep a group only if its rewards differ (the DAPO dynamic-sampling filter)."""
    return len({float(s.reward) for s in group}) > 1


def load_dynamic_filter(spec: str | None) -> DynamicFilter | None:
    """The filter a config names: None, 'uniform' (`drop_uniform_rewards`) or a 'module:fn' / 'file.py:fn' spec."""
    from fleetrl.user_code import load_object

    if spec is None:
        return None
    return drop_uniform_rewards if spec == "uniform" else load_object(spec)
