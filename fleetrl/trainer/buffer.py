"""The trainer's group buffer: groups received on the stream wait here until a step asks for them.

Thread-safe (the stream's receive thread adds, the training thread takes). A group's identity is
(row id, attempt): a row can be leased again (stale, expired, failed), so several attempts of it may arrive. A step
names the attempt it trains; the controller names the attempts it superseded, which are evicted and refused if
they arrive later. A row is trained at most once: any group of a trained row is refused, and training a row
evicts its other attempts.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from fleetrl.groups import RolloutGroup

GroupKey = tuple[int, int]
"""(row_id, attempt); attempt 0 in a step's request means whichever attempt of the row arrived."""


class MissingGroupsError(TimeoutError):
    """A step asked for groups that did not arrive in time."""

    def __init__(self, missing: Sequence[GroupKey], timeout_s: float) -> None:
        shown = ", ".join(str(r) if a == 0 else f"{r}#{a}" for r, a in list(missing)[:20])
        more = f" (+{len(missing) - 20} more)" if len(missing) > 20 else ""
        super().__init__(f"groups of rows [{shown}]{more} did not arrive within {timeout_s:.1f}s")
        self.missing = [r for r, _ in missing]


class GroupBuffer:
    """Groups by (row id, attempt), in arrival order."""

    def __init__(self, is_trained: Callable[[int], bool] = lambda row_id: False, capacity: int | None = None) -> None:
        self._is_trained = is_trained
        self.capacity = capacity  # groups held at most: a flood of stray groups cannot exhaust memory
        self._groups: OrderedDict[GroupKey, RolloutGroup] = OrderedDict()
        self._superseded: set[GroupKey] = set()
        self._cond = threading.Condition()
        self.duplicates = 0  # a second copy of a buffered attempt, or a group of a trained row
        self.superseded = 0  # groups evicted or refused because the controller superseded their attempt
        self.refused_full = 0  # groups refused because the buffer held `capacity` groups

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def add(self, group: RolloutGroup) -> bool:
        """Keep `group` unless its row is trained, its attempt is buffered or superseded; False when refused."""
        with self._cond:
            if group.key in self._superseded:
                self.superseded += 1
                return False
            if group.key in self._groups or self._is_trained(group.row_id):
                self.duplicates += 1
                return False
            if self.capacity is not None and len(self._groups) >= self.capacity:
                self.refused_full += 1
                return False
            self._groups[group.key] = group
            self._cond.notify_all()
            return True

    def evict(self, keys: Iterable[GroupKey]) -> int:
        """The controller will never train these attempts: drop them, and refuse them if they arrive later."""
        dropped = 0
        with self._cond:
            for key in keys:
                self._superseded.add(tuple(key))  # type: ignore[arg-type]
                if self._groups.pop(tuple(key), None) is not None:  # type: ignore[call-overload]
                    dropped += 1
            self.superseded += dropped
        return dropped

    def _find(self, row_id: int, attempt: int) -> RolloutGroup | None:
        if attempt:
            return self._groups.get((row_id, attempt))
        found = [g for (r, _), g in self._groups.items() if r == row_id]
        return found[-1] if found else None  # attempt unknown: the latest arrival

    def wait_for(self, refs: Sequence[GroupKey], timeout_s: float) -> list[RolloutGroup]:
        """The groups named by `refs` (in that order), waiting up to `timeout_s` for late ones.

        Rows already trained are left out (the caller reports them as skipped). The groups stay
        buffered until `discard`, so a step that fails can be retried.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                live = [(r, a) for r, a in refs if not self._is_trained(r)]
                missing = [(r, a) for r, a in live if self._find(r, a) is None]
                if not missing:
                    return [g for r, a in live if (g := self._find(r, a)) is not None]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MissingGroupsError(missing, timeout_s)
                self._cond.wait(left)

    def wait_for_count(self, count: int, timeout_s: float) -> list[RolloutGroup]:
        """The first `count` groups in arrival order (fewer if the wait times out)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._groups) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return list(self._groups.values())[:count]

    def discard(self, row_ids: Iterable[int]) -> None:
        """Drop every attempt of these rows (trained: later groups of them are refused as duplicates)."""
        rows = set(row_ids)
        with self._cond:
            for key in [k for k in self._groups if k[0] in rows]:
                del self._groups[key]
            self._superseded = {k for k in self._superseded if k[0] not in rows}
