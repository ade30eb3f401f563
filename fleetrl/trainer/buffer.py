"""The trainer's group buffer: groups received on the stream wait here until a step asks for them.

Thread-safe (the stream's receive thread adds, the training thread takes). A row is kept once: a second
group for a row already buffered or already trained (a gateway whose lease expired but still delivered)
is refused and counted, so no row is trained twice.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from fleetrl.groups import RolloutGroup


class MissingGroupsError(TimeoutError):
    """A step asked for rows whose groups did not arrive in time."""

    def __init__(self, missing: Sequence[int], timeout_s: float) -> None:
        shown = ", ".join(str(r) for r in list(missing)[:20])
        more = f" (+{len(missing) - 20} more)" if len(missing) > 20 else ""
        super().__init__(f"groups of rows [{shown}]{more} did not arrive within {timeout_s:.1f}s")
        self.missing = list(missing)


class GroupBuffer:
    """Groups by row id, in arrival order."""

    def __init__(self, is_trained: Callable[[int], bool] = lambda row_id: False) -> None:
        self._is_trained = is_trained
        self._groups: OrderedDict[int, RolloutGroup] = OrderedDict()
        self._cond = threading.Condition()
        self.duplicates = 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def add(self, group: RolloutGroup) -> bool:
        """Keep `group` unless its row is already buffered or trained; False when refused."""
        with self._cond:
            if group.row_id in self._groups or self._is_trained(group.row_id):
                self.duplicates += 1
                return False
            self._groups[group.row_id] = group
            self._cond.notify_all()
            return True

    def wait_for(self, row_ids: Sequence[int], timeout_s: float) -> list[RolloutGroup]:
        """The groups of `row_ids` (in that order), waiting up to `timeout_s` for late ones.

        Rows already trained are left out (the caller reports them as skipped). The groups stay
        buffered until `discard`, so a step that fails can be retried.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                missing = [r for r in row_ids if r not in self._groups and not self._is_trained(r)]
                if not missing:
                    return [self._groups[r] for r in row_ids if r in self._groups]
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

    def discard(self, row_ids: Sequence[int]) -> None:
        with self._cond:
            for r in row_ids:
                self._groups.pop(r, None)
