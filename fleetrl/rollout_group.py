"""Rollout groups: the G samples of one dataset row, as the gateway sends them and the trainer trains them.

`RolloutGroup` is the domain object; `fleetrl.group_stream` carries it over ZeroMQ as the protobuf
`fleetrl.v1.RolloutGroup`, and recorded runs store it as JSONL (one group per line, the same field
names), which the trainer's standalone mode replays:

    {"row_id": 7, "submit_version": 0, "samples": [{"tokens": [...], "logprobs": [...],
     "loss_mask": [...], "reward": 1.0, "versions": [...], "metrics": {"correct": 1.0}}, ...]}

A sample's optional fields appear only when set ("member"; "turn_rewards" and "turn_ends", the per-turn rewards of
`RolloutSample`), so a record written before they existed reads as it always did.

Pure Python: no sockets.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetrl.rollout import InvalidSampleError, RolloutSample, validate_sample

_SAMPLE_FIELDS = (
    "tokens",
    "logprobs",
    "loss_mask",
    "reward",
    "finish_reason",
    "text",
    "versions",
    "metrics",
)
_OPTIONAL_SAMPLE_FIELDS = ("member", "turn_rewards", "turn_ends")  # written only when set (not None)


@dataclass(frozen=True)
class DroppedSample:
    """A sample removed from its group because it broke the rollout contract."""

    index: int
    field_name: str
    message: str


@dataclass
class RolloutGroup:
    """The samples of one row.

    Attributes:
        row_id: the dataset row (the controller's lease id); the trainer trains each row at most once.
        submit_version: policy version when the row was admitted by the off-policy gate.
        samples: the valid samples (invalid ones are dropped on arrival, see `split_valid`).
        dropped: the samples dropped from this group on arrival, and why.
        source: who sent it (a gateway id), for logs.
        attempt: the controller's lease attempt that produced it (1, 2, ...; 0 = unknown). A row can be
            leased again (stale, expired, failed), so a group's identity is `key` = (row_id, attempt): the
            controller names the attempt a step trains, and every other attempt of the row is evicted.
    """

    row_id: int
    submit_version: int
    samples: list[RolloutSample]
    dropped: list[DroppedSample] = field(default_factory=list)
    source: str = ""
    attempt: int = 0
    lease_tag: int = 0  # the controller's tag of the lease (0 = none): only the tagged group is trained

    @property
    def key(self) -> tuple[int, int]:
        return (self.row_id, self.attempt)

    @property
    def rewards(self) -> list[float]:
        return [float(s.reward) for s in self.samples]

    def oldest_version(self) -> int | None:
        """The oldest policy version that generated a trainable token of the group (None: unknown)."""
        versions = [
            v for s in self.samples if s.versions is not None for v, m in zip(s.versions, s.loss_mask, strict=True) if m
        ]
        return min(versions) if versions else None


def split_valid(group: RolloutGroup, vocab_size: int | None = None) -> RolloutGroup:
    """Validate every sample (token ids below `vocab_size` when given); return the group with the invalid ones
    dropped and their messages listed.

    Never raises for a bad sample: dropping and counting is the caller's business (a run goes on).
    """
    kept: list[RolloutSample] = []
    dropped = list(group.dropped)
    for i, sample in enumerate(group.samples):
        try:
            validate_sample(sample, vocab_size)
        except InvalidSampleError as exc:
            dropped.append(DroppedSample(i, exc.field_name, f"row {group.row_id} sample {i}: {exc}"))
            continue
        kept.append(sample)
    return RolloutGroup(group.row_id, group.submit_version, kept, dropped, group.source, group.attempt, group.lease_tag)


class GroupFormatError(ValueError):
    """A recorded group (JSON) that cannot be read; the message names the line and the field."""


def sample_to_dict(sample: RolloutSample) -> dict[str, Any]:
    out = {name: getattr(sample, name) for name in _SAMPLE_FIELDS}
    for name in _OPTIONAL_SAMPLE_FIELDS:  # older records have none of them
        if getattr(sample, name) is not None:
            out[name] = getattr(sample, name)
    return out


def group_to_dict(group: RolloutGroup) -> dict[str, Any]:
    """A JSON-ready dict of the group (the JSONL record format)."""
    out: dict[str, Any] = {
        "row_id": group.row_id,
        "submit_version": group.submit_version,
        "samples": [sample_to_dict(s) for s in group.samples],
    }
    if group.source:
        out["source"] = group.source
    if group.attempt:
        out["attempt"] = group.attempt
    return out


def sample_from_dict(data: Any, where: str = "sample") -> RolloutSample:
    """Build a RolloutSample from a dict (unvalidated: validation is `split_valid`'s job)."""
    if not isinstance(data, dict):
        raise GroupFormatError(f"{where}: expected an object, got {type(data).__name__}")
    unknown = set(data) - {*_SAMPLE_FIELDS, *_OPTIONAL_SAMPLE_FIELDS}
    if unknown:
        raise GroupFormatError(f"{where}: unknown field(s) {sorted(unknown)}")
    missing = [k for k in ("tokens", "logprobs", "loss_mask", "reward") if k not in data]
    if missing:
        raise GroupFormatError(f"{where}: missing field(s) {missing}")
    return RolloutSample(
        tokens=data["tokens"],
        logprobs=data["logprobs"],
        loss_mask=data["loss_mask"],
        reward=data["reward"],
        finish_reason=data.get("finish_reason", "stop"),
        text=data.get("text", ""),
        versions=data.get("versions"),
        member=data.get("member"),
        metrics=data.get("metrics") or {},
        turn_rewards=data.get("turn_rewards"),
        turn_ends=data.get("turn_ends"),
    )


def group_from_dict(data: Any, where: str = "group") -> RolloutGroup:
    if not isinstance(data, dict):
        raise GroupFormatError(f"{where}: expected an object, got {type(data).__name__}")
    for key in ("row_id", "submit_version"):
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise GroupFormatError(f"{where}: {key} must be an int, got {value!r}")
    attempt = data.get("attempt", 0)
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise GroupFormatError(f"{where}: attempt must be an int >= 0, got {attempt!r}")
    samples = data.get("samples")
    if not isinstance(samples, list):
        raise GroupFormatError(f"{where}: samples must be a list")
    return RolloutGroup(
        row_id=data["row_id"],
        submit_version=data["submit_version"],
        samples=[sample_from_dict(s, f"{where} sample {i}") for i, s in enumerate(samples)],
        source=str(data.get("source", "")),
        attempt=attempt,
    )


def read_groups_jsonl(path: str | Path) -> Iterator[RolloutGroup]:
    """Yield the groups recorded in a JSONL file (blank lines skipped); errors name the line."""
    path = Path(path)
    try:
        handle = path.open()
    except FileNotFoundError:
        raise GroupFormatError(f"groups file not found: {path}") from None
    with handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise GroupFormatError(f"{where}: not valid JSON: {exc}") from None
            yield group_from_dict(data, where)


def write_groups_jsonl(path: str | Path, groups: Iterable[RolloutGroup], append: bool = False) -> int:
    """Write groups as JSONL; return how many were written."""
    count = 0
    with Path(path).open("a" if append else "w") as handle:
        for group in groups:
            handle.write(json.dumps(group_to_dict(group)) + "\n")
            count += 1
    return count
