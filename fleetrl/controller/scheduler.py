"""The row scheduler: leases rows against the off-policy gate, collects outcomes, and assembles steps.

Life of a row: the cursor (or the requeue queue) yields it, the gate admits it at `submit_version`, a gateway
holds it under a lease until it reports accepted (its group went to the trainer), rejected (dynamic filter, too
few samples) or failed. Accepted groups fill steps of P groups in arrival order. Step k trains against version
k-1; a group whose oldest token is more than O versions behind that is stale: with `stale_policy="requeue"` it is
not trained and its row is leased again. An expired lease (a dead or hung gateway) requeues the row: nothing is
lost. Each lease of a row is an attempt (1, 2, ...), and a group's identity is (row id, attempt): a gateway sends
its group before reporting it, so the trainer may hold a group the controller then refuses (stale) or stops waiting
for (expired, failed). Such attempts are *superseded*: the next step tells the trainer to evict them, and a step
names the exact attempt it trains, so only the attempt the controller accepted is ever trained, and a row at most
once.

All methods take `now` (seconds) from the caller, so the logic is testable without clocks or sockets.
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.journal import Journal
from fleetrl.controller.mixture import MixtureCursor
from fleetrl.controller.run_outcome import rejection_cause

log = logging.getLogger(__name__)
Outcome = Literal["accepted", "rejected", "failed"]
COUNTERS = (
    "rows_leased",
    "rows_accepted",
    "rows_rejected",
    "rows_failed",
    "rows_requeued_stale",
    "rows_requeued_expired",
    "rows_requeued_failed",
    "rows_failed_stale",
    "late_reports",
    "groups_lost",
)


@dataclass(frozen=True)
class Lease:
    row_id: int
    submit_version: int
    deadline: float
    gateway_id: str
    row: dict[str, Any]
    attempt: int
    tag: int = 0  # random, known to the holder only: the trainer trains a group only with this tag


@dataclass(frozen=True)
class StepAssignment:
    """Step `step` trains these rows (row_id, submit_version), each the attempt in `attempts`, against version
    `step - 1`."""

    step: int
    rows: tuple[tuple[int, int], ...]
    version_offsets: tuple[int, ...]
    attempts: tuple[int, ...] = ()
    tags: tuple[int, ...] = ()

    @property
    def row_ids(self) -> tuple[int, ...]:
        return tuple(r for r, _ in self.rows)

    @property
    def groups(self) -> tuple[tuple[int, int], ...]:
        """(row_id, attempt) of each group the step trains (attempt 0 = unknown)."""
        attempts = self.attempts or (0,) * len(self.rows)
        return tuple((r, a) for (r, _), a in zip(self.rows, attempts, strict=True))

    @property
    def refs(self) -> tuple[tuple[int, int, int], ...]:
        """(row_id, attempt, lease tag) of each group the step trains (0 = unknown)."""
        tags = self.tags or (0,) * len(self.rows)
        return tuple((r, a, t) for (r, a), t in zip(self.groups, tags, strict=True))


class RowScheduler:
    def __init__(
        self,
        cursor: DatasetCursor | MixtureCursor,
        gate: OffPolicyGate,
        *,
        prompt_groups_per_step: int,
        stale_policy: Literal["requeue", "train"] = "requeue",
        lease_timeout_s: float = 600.0,  # ControllerConfig.lease_timeout_s's default
        max_attempts: int = 3,
        journal: Journal | None = None,
        max_steps: int | None = None,
        max_stale_attempts: int | None = None,
    ) -> None:
        """`max_attempts`: leases of a row that keeps failing; `max_stale_attempts` (default: max_attempts): times
        a row's group may come back stale (slower than the off-policy bound allows) before it is dropped, counted
        in `rows_failed_stale` (its lost or failed attempts do not count)."""
        self.cursor = cursor
        self.gate = gate
        self.groups_per_step = prompt_groups_per_step
        self.max_offpolicy = gate.max_offpolicy
        self.stale_policy = stale_policy
        self.lease_timeout_s = lease_timeout_s
        self.max_attempts = max_attempts
        self.max_stale_attempts = max_stale_attempts or max_attempts
        self.journal = journal
        self.max_steps = max_steps
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.leases: dict[int, Lease] = {}
        self.queue: deque[int] = deque()  # row ids waiting to be leased again
        self.attempts: dict[int, int] = {}
        self.stale_reports: dict[int, int] = {}  # row id -> attempts whose group came back stale (max_stale_attempts)
        self.pending: list[tuple[int, int, int, int, int]] = []  # accepted: (row, submit_version, offset, attempt, tag)
        self.superseded: list[tuple[int, int]] = []  # (row_id, attempt) never to be trained; see take_superseded
        self.ready: deque[StepAssignment] = deque()
        self.next_step = gate.version + 1  # the step the next full set of groups becomes
        self.trained_steps = gate.version
        self.resumed = False  # built from a journal (resume); see align_to_trainer
        self.gate_factory: Any = None

    # --- leasing ---------------------------------------------------------------------------------
    def lease(self, gateway_id: str, max_rows: int, now: float) -> list[Lease]:
        """Up to `max_rows` rows the gate admits now, requeued rows first."""
        self.expire(now)
        out: list[Lease] = []
        while len(out) < max_rows and (self.max_steps is None or self._rows_committed() < self._row_budget()):
            if not self.gate.can_admit():
                break
            if self.queue:
                row_id = self.queue.popleft()
                row = self.cursor.row(row_id)
            else:
                nxt = self.cursor.next()
                if nxt is None:
                    break
                row_id, row = nxt
            admission = self.gate.try_admit(row_id)
            assert admission is not None  # can_admit() was checked above
            attempt = self.attempts.get(row_id, 0) + 1
            self.attempts[row_id] = attempt
            tag = secrets.randbits(62) + 1
            lease = Lease(row_id, admission.submit_version, now + self.lease_timeout_s, gateway_id, row, attempt, tag)
            self.leases[row_id] = lease
            self.counters["rows_leased"] += 1
            self._journal_row(row_id, "leased", lease.submit_version)
            out.append(lease)
        self._commit()
        return out

    def _row_budget(self) -> int:
        assert self.max_steps is not None
        return self.max_steps * self.groups_per_step

    def _rows_committed(self) -> int:
        """Rows in formed steps (ready, training or trained), waiting for a step, or leased."""
        return (self.next_step - 1) * self.groups_per_step + len(self.pending) + len(self.leases)

    def expire(self, now: float) -> list[int]:
        """Requeue every row whose lease deadline has passed."""
        return self._requeue_leases([rid for rid, lease in self.leases.items() if lease.deadline <= now])

    def leased_to(self, gateway_id: str) -> int:
        """Rows leased to `gateway_id` and not reported yet."""
        return sum(1 for lease in self.leases.values() if lease.gateway_id == gateway_id)

    def release_gateway(self, gateway_id: str) -> list[int]:
        """A gateway is dead (missed heartbeats): requeue its rows now instead of waiting for their deadlines."""
        return self._requeue_leases([rid for rid, lease in self.leases.items() if lease.gateway_id == gateway_id])

    def _requeue_leases(self, expired: list[int]) -> list[int]:
        for row_id in expired:
            lease = self.leases.pop(row_id)
            self.superseded.append((row_id, lease.attempt))
            self.gate.resolve(row_id, accepted=False)
            self.queue.append(row_id)
            self.counters["rows_requeued_expired"] += 1
            self._journal_row(row_id, "queued", -1)
        self._commit()
        return expired

    # --- outcomes --------------------------------------------------------------------------------
    def report(
        self,
        row_id: int,
        outcome: Outcome,
        now: float,
        gateway_id: str | None = None,
        min_version: int | None = None,
        attempt: int | None = None,
    ) -> str:
        """Record a row's outcome. Returns what happened: accepted, stale, rejected, retry, failed, late.

        A report for another holder or another attempt than the current lease's is late and changes nothing."""
        lease = self.leases.get(row_id)
        if (
            lease is None
            or (gateway_id is not None and lease.gateway_id != gateway_id)
            or (attempt and attempt != lease.attempt)
        ):
            self.counters["late_reports"] += 1
            return "late"
        del self.leases[row_id]
        if outcome == "accepted":
            result = self._accept(lease, min_version)
        elif outcome == "rejected":
            self.gate.resolve(row_id, accepted=False)
            self.counters["rows_rejected"] += 1
            self._journal_row(row_id, "rejected", lease.submit_version)
            self._close(row_id)
            result = "rejected"
        elif outcome == "failed":
            self.gate.resolve(row_id, accepted=False)
            self.superseded.append((row_id, lease.attempt))  # a send that timed out may still be delivered
            if lease.attempt < self.max_attempts:
                self.queue.append(row_id)
                self.counters["rows_requeued_failed"] += 1
                self._journal_row(row_id, "queued", lease.submit_version)
                result = "retry"
            else:
                self.counters["rows_failed"] += 1
                self._journal_row(row_id, "failed", lease.submit_version)
                self._close(row_id)
                result = "failed"
        else:
            raise ValueError(f"unknown outcome {outcome!r}; expected accepted, rejected or failed")
        self._commit()
        return result

    def count_dropped(self, why: str, count: int) -> None:
        """A gateway dropped `count` samples of a reported row for `why` (a key of RowReport.samples_dropped):
        counted under `samples_dropped_<why>`."""
        key = f"samples_dropped_{why}"
        self.counters[key] = self.counters.get(key, 0) + count

    def count_rejection(self, samples_dropped: Mapping[str, int], reason: str = "") -> None:
        """A row whose report was taken as rejected, counted once under its cause (`rows_rejected_<cause>`,
        fleetrl.controller.run_outcome.rejection_cause), so a run that trains nothing can say why."""
        key = f"rows_rejected_{rejection_cause(samples_dropped, reason)}"
        self.counters[key] = self.counters.get(key, 0) + 1

    def _accept(self, lease: Lease, min_version: int | None) -> str:
        # The step this group would join, and the version that step trains against.
        step = self.next_step + len(self.pending) // self.groups_per_step
        oldest = lease.submit_version if min_version is None else min(min_version, lease.submit_version)
        offset = (step - 1) - oldest
        if offset > self.max_offpolicy and self.stale_policy == "requeue":
            self.gate.resolve(lease.row_id, accepted=False)
            self.superseded.append((lease.row_id, lease.attempt))  # its group is at the trainer already
            stale = self.stale_reports[lease.row_id] = self.stale_reports.get(lease.row_id, 0) + 1
            if stale >= self.max_stale_attempts:
                # Stale on that many attempts: almost always a slow row (its rollouts take longer than O versions of
                # training; rarely, a rollout that does not pass the sampler's versions through). Requeuing forever
                # would hang the run, so the row is dropped, loudly, and counted for the run's summary. Only the
                # attempts that came back stale count: one lost or failed on the way does not make a row slow.
                self.counters["rows_failed_stale"] += 1
                self._journal_row(lease.row_id, "failed", lease.submit_version)
                self._close(lease.row_id)
                log.warning(
                    "row %d dropped as too slow: it came back stale on %d of its %d attempts (oldest token version "
                    "%d, step %d trains against %d, max_head_offpolicy_versions %d): slow, not wrong. Counted in "
                    "rows_failed_stale; raise max_head_offpolicy_versions or the controller's max_stale_attempts "
                    "(%d) to keep such rows, or speed its rollout up",
                    lease.row_id,
                    stale,
                    lease.attempt,
                    oldest,
                    step,
                    step - 1,
                    self.max_offpolicy,
                    self.max_stale_attempts,
                )
                return "failed"
            self.queue.append(lease.row_id)
            self.counters["rows_requeued_stale"] += 1
            self._journal_row(lease.row_id, "queued", lease.submit_version)
            return "stale"
        self.gate.resolve(lease.row_id, accepted=True)
        self.counters["rows_accepted"] += 1
        self.pending.append((lease.row_id, lease.submit_version, offset, lease.attempt, lease.tag))
        self._journal_row(lease.row_id, "accepted", lease.submit_version)
        self._form_steps()
        return "accepted"

    def _form_steps(self, final: bool = False) -> None:
        while len(self.pending) >= self.groups_per_step or (final and self.pending):
            take, self.pending = self.pending[: self.groups_per_step], self.pending[self.groups_per_step :]
            step = self.next_step
            self.next_step += 1
            assignment = StepAssignment(
                step,
                tuple((r, v) for r, v, *_ in take),
                tuple(o for _, _, o, _, _ in take),
                tuple(a for *_, a, _ in take),
                tuple(t for *_, t in take),
            )
            self.ready.append(assignment)
            for row_id, version, *_ in take:
                self._journal_row(row_id, "assigned", version, step=step)
            self._journal_state()

    # --- steps -----------------------------------------------------------------------------------
    def take_step(self) -> StepAssignment | None:
        """The next complete step, or a final partial one once the data is used up and nothing is in flight."""
        if not self.ready and self.pending and self._nothing_left_to_lease() and not self.leases:
            self._form_steps(final=True)
            self._commit()
        return self.ready.popleft() if self.ready else None

    def groups_lost(self, assignment: StepAssignment, lost_rows: set[int]) -> list[int]:
        """The trainer could not train `assignment`: the groups of `lost_rows` never reached it (too large for its
        socket, evicted, lost). A lost group is not a dead run: those attempts are superseded (evicted, refused if
        they arrive later) and their rows leased again, first (closed as failed after `max_attempts` leases,
        counted in `rows_failed`); the step's other groups, and those of steps formed after it, go back to the
        steps being formed, in order, so the step is formed again from the next groups accepted. Returns the rows
        requeued. Counted in `groups_lost`."""
        ready = [assignment, *self.ready]
        self.ready.clear()
        kept: list[tuple[int, int, int, int, int]] = []
        requeued: list[int] = []
        for step in ready:
            tags = step.tags or (0,) * len(step.rows)
            for (row_id, version), offset, (_, attempt), tag in zip(
                step.rows, step.version_offsets, step.groups, tags, strict=True
            ):
                if step is not assignment or row_id not in lost_rows:
                    kept.append((row_id, version, offset, attempt, tag))
                    continue
                self.counters["groups_lost"] += 1
                self.superseded.append((row_id, attempt))
                self.gate.accepted -= self.gate.group_size  # it no longer fills a step
                if self.attempts.get(row_id, attempt) >= self.max_attempts:
                    self.counters["rows_failed"] += 1
                    self._journal_row(row_id, "failed", version)
                    self._close(row_id)
                    continue
                self._journal_row(row_id, "queued", version)
                requeued.append(row_id)
        self.queue.extendleft(reversed(requeued))
        self.pending[:0] = kept
        self.next_step = assignment.step
        self._form_steps()
        self._commit()
        return requeued

    def take_superseded(self) -> list[tuple[int, int]]:
        """The (row_id, attempt) groups superseded since the last call: the trainer evicts them."""
        out, self.superseded = self.superseded, []
        return out

    def step_trained(self, assignment: StepAssignment) -> None:
        """The trainer finished this step: its rows are trained (once)."""
        self.trained_steps = max(self.trained_steps, assignment.step)
        for row_id, version in assignment.rows:
            self._journal_row(row_id, "trained", version, step=assignment.step, trained=1)
            self._close(row_id)
        self._journal_state()
        self._commit()

    def publish(self, version: int) -> None:
        """Version `version` is live on the inference replicas: the gate opens by one batch."""
        self.gate.publish(version)
        self._journal_state()
        self._commit()

    def _nothing_left_to_lease(self) -> bool:
        budget_hit = self.max_steps is not None and self._rows_committed() >= self._row_budget()
        return budget_hit or (self.cursor.exhausted() and not self.queue)

    def finished(self) -> bool:
        """Every row is resolved and every step handed out."""
        return self._nothing_left_to_lease() and not self.leases and not self.pending and not self.ready

    def snapshot(self) -> dict[str, Any]:
        return {
            **self.counters,
            **{f"gate_{k}": v for k, v in self.gate.snapshot().items()},
            "rows_in_flight": len(self.leases),
            "rows_queued": len(self.queue),
            "groups_pending": len(self.pending),
            "steps_ready": len(self.ready),
            "next_step": self.next_step,
            "trained_steps": self.trained_steps,
            "cursor_epoch": self.cursor.position.epoch,
            "cursor_index": self.cursor.position.index,
        }

    def _close(self, row_id: int) -> None:
        """A row is done (trained, rejected or failed; its journal row says so): forget its attempt count, so the
        controller's memory holds rows in flight only, not every row of the run."""
        self.attempts.pop(row_id, None)
        self.stale_reports.pop(row_id, None)

    # --- journal ---------------------------------------------------------------------------------
    def _journal_row(self, row_id: int, status: str, version: int, step: int = -1, trained: int = 0) -> None:
        if self.journal is not None:
            self.journal.put_row(row_id, status, version, self.attempts.get(row_id, 0), step, trained)

    def _journal_state(self) -> None:
        if self.journal is None:
            return
        self.journal.set_state("version", self.gate.version)
        self.journal.set_state("trained_steps", self.trained_steps)
        self.journal.set_state("cursor", self.cursor.journal_state())
        self.journal.set_state("counters", self.counters)

    def _commit(self) -> None:
        if self.journal is not None:
            self._journal_state()
            self.journal.commit()

    @classmethod
    def resume(
        cls,
        journal: Journal,
        rows: list[dict[str, Any]],
        gate_factory: Any,
        cursor_kwargs: dict[str, Any],
        cursor: DatasetCursor | MixtureCursor | None = None,
        **kwargs: Any,
    ) -> RowScheduler:
        """Rebuild from the journal: the published version, the cursor (a mixture's `cursor`, built by the caller,
        continues each source where it stopped), and every row not yet trained or closed goes back to the queue
        (steps restart after the last trained one). A row that was assigned to a step keeps that step in the
        journal (status queued) until `align_to_trainer` has seen whether the trainer trained it."""
        state = journal.state()
        version = int(state.get("version", 0))
        if cursor is None:  # one dataset
            cursor = DatasetCursor(rows, **cursor_kwargs)
        cursor.restore(state.get("cursor", [0, 0]))  # a mixture (`cursor`) continues each source where it stopped
        scheduler = cls(cursor, gate_factory(version), journal=journal, **kwargs)
        scheduler.gate_factory = gate_factory
        scheduler.resumed = True
        scheduler.trained_steps = int(state.get("trained_steps", 0))
        scheduler.next_step = scheduler.trained_steps + 1
        scheduler.counters.update(state.get("counters", {}))
        for row_id, info in journal.open_rows().items():  # closed rows stay on disk only
            scheduler.attempts[row_id] = int(info["attempts"])
            scheduler.queue.append(row_id)
            step = int(info["step"]) if info["status"] in ("assigned", "queued") else -1
            journal.put_row(row_id, "queued", int(info["submit_version"]), int(info["attempts"]), step, 0)
        journal.commit()
        return scheduler

    def align_to_trainer(self, trainer_version: int) -> dict[str, list[int]]:
        """Make the trainer's version the truth after a restart (steps count from 1; step k makes version k).

        The trainer resumes from its last checkpoint, which can be behind the journal (steps trained after the
        checkpoint are lost with the process) or one step ahead (it trained a step the controller never heard
        back about). Rows of steps after `trainer_version` go back to the queue; queued rows of steps up to it
        count as trained; the gate restarts at `trainer_version`. Returns the row ids moved each way."""
        if trainer_version == self.trained_steps == self.gate.version:
            return {"requeued": [], "counted_trained": []}
        if not self.resumed or self.journal is None:
            raise ValueError(
                f"the trainer is at version {trainer_version} but the controller starts at version "
                f"{self.gate.version}: restart both with --resume (controller journal and trainer checkpoint), "
                "or neither"
            )
        if trainer_version > self.trained_steps + 1:
            # The controller hands out one step at a time: a trainer further ahead resumed another run's checkpoint.
            raise ValueError(
                f"the trainer resumed version {trainer_version} but the controller's journal has only "
                f"{self.trained_steps} trained steps: the checkpoint belongs to another run (clear its "
                "checkpoint_dir, or resume the run it came from)"
            )
        requeued, counted, lost_steps = [], [], []
        for row_id, info in self.journal.rows_to_align(trainer_version).items():
            step, status = int(info["step"]), info["status"]
            if status == "trained" and step > trainer_version:
                self.attempts[row_id] = int(info["attempts"])  # open again (closed rows keep no attempt count)
                self._journal_row(row_id, "queued", int(info["submit_version"]))
                requeued.append(row_id)
                lost_steps.append((step, row_id))
            elif status == "queued" and step > trainer_version:
                self.queue.remove(row_id)
                lost_steps.append((step, row_id))
            elif status == "queued" and 0 < step <= trainer_version:
                self.queue.remove(row_id)
                self._journal_row(row_id, "trained", int(info["submit_version"]), step=step, trained=1)
                self._close(row_id)
                counted.append(row_id)
        # The rows of the steps the trainer lost come back first, step by step (in row order within a step), so
        # the resumed run forms the same steps again: resuming gives the weights an uninterrupted run gives.
        self.queue.extendleft(row_id for _, row_id in sorted(lost_steps, reverse=True))
        self.gate = self.gate_factory(trainer_version)
        self.trained_steps = trainer_version
        self.next_step = trainer_version + 1
        self._commit()
        log.warning(
            "aligned to the trainer's version %d: %d rows of later steps requeued, %d rows counted as trained",
            trainer_version,
            len(requeued),
            len(counted),
        )
        return {"requeued": requeued, "counted_trained": counted}
