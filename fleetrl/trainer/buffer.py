"""The trainer's group buffer: groups received on the stream wait here until a step asks for them.

Thread-safe (the stream's receive thread adds, the training thread takes). A group's identity is
(row id, attempt): a row can be leased again (stale, expired, failed), so several attempts of it may arrive. A step
names the attempt it trains, with the lease's random tag (only the lease holder learned it), so a forged or stray
group is never trained; the controller names the attempts it superseded, which are evicted and refused if
they arrive later. A row is trained at most once: any group of a trained row is refused, and training a row
evicts its other attempts. A group no step has named for `max_age_steps` steps is evicted too (`end_step`): a
legitimate group is named within a few steps of arriving, so what stays is stray or forged (the run's token is in the
gateway's environment, so user code can send groups for rows never leased) and would otherwise hold the buffer full
for good; if a real one is ever evicted, the step that names it finds it lost and the controller leases the row again.

When the buffer holds `capacity` groups, a new group always gets in and an older one makes room (`_victim`): first a
group of a sender no step has ever named (a step names a group only with the tag the controller issued, so such a
sender is a stranger) when the new one's sender is one steps train; else the capacity is shared fairly between the
senders (gateway ids): one holding less than its share (capacity / senders buffering) takes the oldest group of the
sender holding the most, and one at its share replaces its own oldest. So a flood from one sender cannot crowd out
the others, and a one-off flood is churned out by the groups that follow it. Every group evicted (full, unclaimed)
is remembered by (row, attempt, tag): a step that names one fails at once (`RefusedGroupsError`, a
`MissingGroupsError`) instead of waiting out its timeout for a group that was sent once and will not come, and the
controller leases the row again at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from fleetrl.rollout_group import RolloutGroup

log = logging.getLogger(__name__)

GroupKey = tuple[int, int]
"""(row_id, attempt); attempt 0 in a step's request means whichever attempt of the row arrived."""
GroupRef = tuple[int, ...]
"""(row_id, attempt) or (row_id, attempt, lease_tag); 0 = any."""


def _stored(group: RolloutGroup) -> tuple[int, int, int]:
    return (group.row_id, group.attempt, group.lease_tag)


class MissingGroupsError(TimeoutError):
    """A step asked for groups that did not arrive in time."""

    def __init__(self, missing: Sequence[GroupKey], timeout_s: float) -> None:
        shown = ", ".join(str(r) if a == 0 else f"{r}#{a}" for r, a in list(missing)[:20])
        more = f" (+{len(missing) - 20} more)" if len(missing) > 20 else ""
        super().__init__(f"groups of rows [{shown}]{more} did not arrive within {timeout_s:.1f}s")
        self.missing = [r for r, _ in missing]


class RefusedGroupsError(MissingGroupsError):
    """A step asked for groups this buffer had refused or evicted: they will not arrive (a gateway sends once)."""

    def __init__(self, refused: Sequence[GroupKey], reasons: Sequence[str]) -> None:
        shown = ", ".join(str(r) if a == 0 else f"{r}#{a}" for r, a in list(refused)[:20])
        more = f" (+{len(refused) - 20} more)" if len(refused) > 20 else ""
        why = ", ".join(sorted(set(reasons)))
        TimeoutError.__init__(
            self, f"groups of rows [{shown}]{more} did not arrive: the trainer refused them ({why}); lease them again"
        )
        self.missing = [r for r, _ in refused]


MAX_REFUSED_REMEMBERED = 100_000
"""Refused groups remembered at most (the oldest forgotten first): a flood cannot grow the memory without bound."""


class GroupBuffer:
    """Groups by (row id, attempt), in arrival order."""

    def __init__(self, is_trained: Callable[[int], bool] = lambda row_id: False, capacity: int | None = None) -> None:
        self._is_trained = is_trained
        self.capacity = capacity  # groups held at most: a flood of stray groups cannot exhaust memory
        self._groups: OrderedDict[tuple[int, int, int], RolloutGroup] = OrderedDict()
        self._superseded: set[GroupKey] = set()
        self._cond = threading.Condition()
        self.duplicates = 0  # a second copy of a buffered attempt, or a group of a trained row
        self.superseded = 0  # groups evicted or refused because the controller superseded their attempt
        self.refused_full = 0  # groups evicted because the buffer held `capacity` groups (to make room for one)
        self.evicted_unclaimed = 0  # groups no step named for max_age_steps steps (stray, forged, lost track of)
        self.evicted_for_share = 0  # of those, groups of another sender (a stranger, or one over its share)
        self._refused: OrderedDict[tuple[int, int, int], str] = OrderedDict()  # stored key -> why refused
        self._refused_by_row: dict[int, set[tuple[int, int, int]]] = {}  # the same keys by row id
        self._per_source: dict[str, int] = {}  # buffered groups per source
        self._named_sources: set[str] = set()  # senders of groups a step has named (and so trusted: tag matched)
        self.steps = 0  # steps ended (`end_step`)
        self._arrived: dict[tuple[int, int, int], int] = {}  # stored key -> `steps` when it arrived

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def add(self, group: RolloutGroup) -> bool:
        """Keep `group` unless its row is trained, the same group is buffered or its attempt is superseded; False
        when refused. A full buffer makes room by evicting an older group (`_victim`). Groups claiming the same
        (row, attempt) with different lease tags are all kept: the step names the tag the controller issued, so a
        forged twin cannot take the real one's place."""
        with self._cond:
            if group.key in self._superseded:
                self.superseded += 1
                return False
            if _stored(group) in self._groups or self._is_trained(group.row_id):
                self.duplicates += 1
                return False
            if self.capacity is not None and len(self._groups) >= self.capacity:
                victim, reason = self._victim(group.source)
                self._drop(victim)
                self._refuse(victim, reason)
                self.refused_full += 1
            self._groups[_stored(group)] = group
            self._arrived[_stored(group)] = self.steps
            self._per_source[group.source] = self._per_source.get(group.source, 0) + 1
            self._forget_refusal(_stored(group))
            self._cond.notify_all()
            return True

    def _victim(self, source: str) -> tuple[tuple[int, int, int], str]:
        """With the buffer full, the group that makes room for one from `source`, and why: the oldest group of a
        sender no step has named yet when `source` is one a step has named; else, when `source` holds less than
        its fair share (capacity / senders buffering), the oldest of the sender holding the most; else its own
        oldest (a flood from one sender only churns through its own share)."""
        assert self.capacity is not None
        if source in self._named_sources:
            stranger = next((k for k, g in self._groups.items() if g.source not in self._named_sources), None)
            if stranger is not None:
                self.evicted_for_share += 1
                return stranger, "buffer full: evicted for a sender whose groups steps train"
        sources = set(self._per_source) | {source}
        share = max(self.capacity // len(sources), 1)
        if self._per_source.get(source, 0) >= share:
            oldest = next(k for k, g in self._groups.items() if g.source == source)
            return oldest, f"buffer full: its sender's share ({share} of {self.capacity}) taken by newer groups"
        biggest = max(self._per_source, key=lambda s: self._per_source[s])
        self.evicted_for_share += 1
        oldest = next(k for k, g in self._groups.items() if g.source == biggest)
        return oldest, f"buffer full: evicted for another sender's share ({share} of {self.capacity})"

    def _drop(self, key: tuple[int, int, int]) -> None:
        group = self._groups.pop(key, None)
        self._arrived.pop(key, None)
        if group is not None:
            left = self._per_source.get(group.source, 0) - 1
            if left > 0:
                self._per_source[group.source] = left
            else:
                self._per_source.pop(group.source, None)

    def _refuse(self, key: tuple[int, int, int], reason: str) -> None:
        self._refused[key] = reason
        self._refused.move_to_end(key)
        self._refused_by_row.setdefault(key[0], set()).add(key)
        while len(self._refused) > MAX_REFUSED_REMEMBERED:
            oldest, _ = self._refused.popitem(last=False)
            self._forget_refusal(oldest)

    def _forget_refusal(self, key: tuple[int, int, int]) -> None:
        self._refused.pop(key, None)
        keys = self._refused_by_row.get(key[0])
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._refused_by_row[key[0]]

    def _refusal(self, row_id: int, attempt: int, tag: int) -> str | None:
        """Why a group matching the row, attempt and tag (when set) was refused; None when none was."""
        for r, a, t in self._refused_by_row.get(row_id, ()):
            if (not attempt or a == attempt) and (not tag or t == tag):
                return self._refused[(r, a, t)]
        return None

    def end_step(self, max_age_steps: int) -> int:
        """A step ended: evict the groups that have waited more than `max_age_steps` steps without being named;
        returns how many."""
        with self._cond:
            self.steps += 1
            old = [k for k, arrived in self._arrived.items() if self.steps - arrived > max_age_steps]
            for key in old:
                self._drop(key)
                self._refuse(key, f"no step named it for {max_age_steps} steps")
            self.evicted_unclaimed += len(old)
        if old:
            log.warning(
                "evicted %d buffered groups no step named for %d steps (rows %s): stray or forged groups, or groups "
                "of rows the controller no longer leases",
                len(old),
                max_age_steps,
                sorted({k[0] for k in old})[:20],
            )
        return len(old)

    def evict(self, keys: Iterable[GroupKey]) -> int:
        """The controller will never train these attempts: drop them, and refuse them if they arrive later."""
        superseded = {(int(k[0]), int(k[1])) for k in keys}
        with self._cond:
            self._superseded |= superseded
            dropped = [k for k in self._groups if k[:2] in superseded]
            for key in dropped:
                self._drop(key)
            self.superseded += len(dropped)
        return len(dropped)

    def _find(self, row_id: int, attempt: int, tag: int) -> RolloutGroup | None:
        """The latest arrival matching the row, and the attempt and tag when they are set (non-zero)."""
        found = [
            g
            for (r, a, t), g in self._groups.items()
            if r == row_id and (not attempt or a == attempt) and (not tag or t == tag)
        ]
        return found[-1] if found else None

    def wait_for(self, refs: Sequence[GroupRef], timeout_s: float) -> list[RolloutGroup]:
        """The groups named by `refs` (row, attempt[, lease tag]; in that order), waiting up to `timeout_s` for
        late ones.

        Rows already trained are left out (the caller reports them as skipped). The groups stay
        buffered until `discard`, so a step that fails can be retried.
        """
        wanted = [(int(r[0]), int(r[1]), int(r[2]) if len(r) > 2 else 0) for r in refs]
        deadline = time.monotonic() + timeout_s
        said = False
        with self._cond:
            while True:
                live = [ref for ref in wanted if not self._is_trained(ref[0])]
                absent = [(r, a, t) for r, a, t in live if self._find(r, a, t) is None]
                missing = [(r, a) for r, a, _ in absent]
                if not missing:
                    found = [g for ref in live if (g := self._find(*ref)) is not None]
                    self._named_sources.update(g.source for g in found)
                    return found
                refused = [(ref[:2], why) for ref in absent if (why := self._refusal(*ref)) is not None]
                if refused:  # sent once and refused: waiting cannot bring them
                    raise RefusedGroupsError([key for key, _ in refused], [why for _, why in refused])
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MissingGroupsError(missing, timeout_s)
                if not said:  # once per wait: a step held by late groups shows in the log
                    log.info("waiting up to %.1f s for the groups of rows %s", left, sorted(r for r, _ in missing))
                    said = True
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
                self._drop(key)
            for row_id in rows & set(self._refused_by_row):
                for key in list(self._refused_by_row[row_id]):
                    self._forget_refusal(key)
            self._superseded = {k for k in self._superseded if k[0] not in rows}
