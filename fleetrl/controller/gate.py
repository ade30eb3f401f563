"""The off-policy gate: how many rows may be in flight given the policy version (pure, no I/O).

The AReaL / Fireworks `async_rl_loop` form, row-atomic and counted in samples. With B = P*G samples per
step, v the published policy version and O = `max_head_offpolicy_versions`:

    staleness capacity   = (v + O + 1) * B - (accepted + reserved)
    concurrency capacity = C - in_flight            (unbounded when C is None)

A row (G samples) is admitted only when min(both) >= G. Admission reserves G samples; resolving the row
releases them and, when the row was accepted, adds G to `accepted`. A rejected row's capacity is free for a
replacement. Publishing version v+1 adds B of headroom. O = 0 (or `synchronous`) is strict on-policy: no row
of step k+1 is admitted until step k is trained and its weights are published.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Admission:
    """An admitted row: which row and the policy version that was live when it was admitted."""

    row_id: int
    submit_version: int


class GateError(RuntimeError):
    """Misuse of the gate (resolving an unknown row, publishing out of order)."""


class OffPolicyGate:
    """Bounds the number of samples generated ahead of the trainer."""

    def __init__(
        self,
        prompt_groups_per_step: int,
        completions_per_prompt: int,
        max_head_offpolicy_versions: int,
        max_concurrency: int | None = None,
        synchronous: bool = False,
        version: int = 0,
    ) -> None:
        if prompt_groups_per_step < 1:
            raise ValueError(f"prompt_groups_per_step must be >= 1, got {prompt_groups_per_step}")
        if completions_per_prompt < 1:
            raise ValueError(f"completions_per_prompt must be >= 1, got {completions_per_prompt}")
        if max_head_offpolicy_versions < 0:
            raise ValueError(f"max_head_offpolicy_versions must be >= 0, got {max_head_offpolicy_versions}")
        if max_concurrency is not None and max_concurrency < completions_per_prompt:
            raise ValueError(
                f"max_concurrency ({max_concurrency}) must be >= completions_per_prompt "
                f"({completions_per_prompt}) or no row could ever be admitted"
            )
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        self.group_size = completions_per_prompt
        self.batch_size = prompt_groups_per_step * completions_per_prompt
        self.max_offpolicy = 0 if synchronous else max_head_offpolicy_versions
        self.max_concurrency = max_concurrency
        self.synchronous = synchronous
        self.version = version
        # On resume the counters restart as if every earlier step had been filled.
        self.accepted = version * self.batch_size
        self._reserved: dict[int, int] = {}
        self._next_row_id = 0

    @property
    def reserved(self) -> int:
        return sum(self._reserved.values())

    @property
    def in_flight(self) -> int:
        return self.reserved

    def staleness_capacity(self) -> int:
        limit = (self.version + self.max_offpolicy + 1) * self.batch_size
        return limit - (self.accepted + self.reserved)

    def concurrency_capacity(self) -> int | None:
        if self.max_concurrency is None:
            return None
        return self.max_concurrency - self.in_flight

    def capacity(self) -> int:
        """Samples that may still be admitted now (min of both capacities)."""
        staleness = self.staleness_capacity()
        concurrency = self.concurrency_capacity()
        return staleness if concurrency is None else min(staleness, concurrency)

    def can_admit(self) -> bool:
        return self.capacity() >= self.group_size

    def try_admit(self, row_id: int | None = None) -> Admission | None:
        """Reserve G samples for one row if capacity allows; None when the gate is closed."""
        if not self.can_admit():
            return None
        if row_id is None:
            row_id = self._next_row_id
        if row_id in self._reserved:
            raise GateError(f"row {row_id} is already in flight")
        self._next_row_id = max(self._next_row_id, row_id + 1)
        self._reserved[row_id] = self.group_size
        return Admission(row_id=row_id, submit_version=self.version)

    def resolve(self, row_id: int, accepted: bool) -> None:
        """Release a row's reservation; an accepted row counts toward its step."""
        if row_id not in self._reserved:
            raise GateError(f"row {row_id} is not in flight")
        samples = self._reserved.pop(row_id)
        if accepted:
            self.accepted += samples

    def publish(self, version: int | None = None) -> int:
        """Advance the live policy version (v+1 by default; a larger jump when weights are pushed every N
        steps adds N*B of headroom). Returns the new version."""
        new_version = self.version + 1 if version is None else version
        if new_version <= self.version:
            raise GateError(f"publish version {new_version} after {self.version}; versions only move forward")
        self.version = new_version
        return new_version

    def snapshot(self) -> dict[str, int]:
        """Counters for status pages and metrics."""
        return {
            "version": self.version,
            "accepted": self.accepted,
            "reserved": self.reserved,
            "in_flight_rows": len(self._reserved),
            "capacity": self.capacity(),
        }
