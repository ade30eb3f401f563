"""The inference replica fleet as a state machine: which replica serves which version, which are fenced (no rollouts
routed to them), which need the run's version pushed (a push to every replica, or a catch-up of one that joined,
restarted or missed a push), from where, and what a reply means. Pure logic: no sockets, no gRPC, no asyncio.

The controller's orchestrator (`services/controller/orchestrator.py`) is its transport: it polls each replica's
Status and runs each LoadWeights, reports what came back here as an event, and carries out the decisions returned
(a `Load` to start). Time comes from the caller (`now`, monotonic seconds), so the races below are unit-tested
without sockets (tests/unit/controller/test_fleet.py):

- A reply from an old process: a replica restarted under the same member id is a new `Member` object (the registry
  replaces the entry, fleetrl.controller.members). Every event names the `Member` it was sent to; one that is no
  longer the registered entry is ignored, whatever it says (a late "serves version 3" must not put the restarted
  successor, at the base model, back in rotation; a late timeout must not count against it).
- A poll crossing a load: a Status reply sent before a LoadWeights to the same replica ended describes the replica
  as it was before (`poll_sent` gives a token; a load ending since makes the reply's version stale): it neither
  fences a replica the push just brought up to date nor un-fences one whose load just failed.
- A replica that keeps refusing catch-up: the first failed catch-up is retried at the next poll, as before; each
  further one in a row waits twice as long (from `catch_up_backoff_s`), at most `catch_up_backoff_max_s`. A load
  that succeeds, or a new process under the id, starts over.
- Members that never return: a replica that joined by itself (not one the controller was configured with) and has
  been silent for `forget_after_s` is dropped from the registry: no longer polled or pushed. Should it come back,
  its heartbeat is answered `known = false` and it registers again (fleetrl.inference.membership).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from fleetrl.controller.members import Member, MemberRegistry
from fleetrl.controller.push_plan import PushSource, push_sources

log = logging.getLogger(__name__)

UNRESPONSIVE_POLLS = 2  # a replica that misses this many Status polls in a row is fenced (hung, stopped)
# A load that failed with these did not reach a serving replica (it is down, restarting or hung), as opposed to one
# that answered and refused the weights (gRPC status code names; the transport gives the name).
GONE_CODE_NAMES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED")
CATCH_UP_BACKOFF_MAX_S = 60.0  # the longest a replica that keeps refusing catch-up waits between tries
FORGET_AFTER_TIMEOUTS = 10  # a joined replica silent for this many heartbeat timeouts is dropped

LoadKind = Literal["push", "catch-up"]


@dataclass(frozen=True)
class Load:
    """A decision: send LoadWeights(`version`) to `member` from `plan`'s source; report how it ended with
    `load_succeeded` or `load_failed` (or, for a push, `push_abandoned`)."""

    member: Member
    version: int
    plan: PushSource
    kind: LoadKind


@dataclass
class PushRound:
    """One version pushed to every live replica: the loads to start, and the replicas that answered and refused."""

    version: int
    loads: list[Load]
    refused: set[str] = field(default_factory=set)


@dataclass
class _Refusals:
    member: Member  # the process they were counted against (a new one starts over)
    count: int
    retry_at: float


class ReplicaFleet:
    def __init__(
        self,
        members: MemberRegistry,
        *,
        weight_fanout: str = "direct",
        unresponsive_polls: int = UNRESPONSIVE_POLLS,
        catch_up_backoff_s: float = 2.0,
        catch_up_backoff_max_s: float = CATCH_UP_BACKOFF_MAX_S,
        forget_after_s: float = 300.0,
        configured: Iterable[str] = (),
    ) -> None:
        """`members`: the registry (shared with the servicer, which registers members and records heartbeats).
        `weight_fanout`: how pushes are planned (fleetrl.controller.push_plan). `configured`: the member ids of the
        replicas the controller was started with, which are never forgotten."""
        if catch_up_backoff_s <= 0 or catch_up_backoff_max_s < catch_up_backoff_s:
            raise ValueError(
                f"catch_up_backoff_s ({catch_up_backoff_s}) must be > 0 and at most catch_up_backoff_max_s "
                f"({catch_up_backoff_max_s})"
            )
        if forget_after_s <= 0:
            raise ValueError(f"forget_after_s must be > 0, got {forget_after_s}")
        self.members = members
        self.weight_fanout = weight_fanout
        self.unresponsive_polls = unresponsive_polls
        self.catch_up_backoff_s = catch_up_backoff_s
        self.catch_up_backoff_max_s = catch_up_backoff_max_s
        self.forget_after_s = forget_after_s
        self.configured = set(configured)
        self.pushed_version = 0  # the version every replica must serve: the last one pushed (none yet)
        self.weights_source = ""  # where the replicas fetch it from (the trainer's weight stream)
        self.loading: dict[str, Member] = {}  # the load in flight per member id (one at a time), for that process
        self._loads_ended: dict[str, int] = {}  # per member id: loads ended, so a poll knows one crossed it
        self._refusals: dict[str, _Refusals] = {}

    # --- identity ------------------------------------------------------------------------------
    def current(self, member: Member) -> bool:
        """`member` is still the registered process under its id (not one that restarted or was dropped)."""
        return self.members.members.get(member.member_id) is member

    def load_in_flight(self, member: Member) -> bool:
        """A load to this very process is in flight (one to the process its id named before does not count)."""
        return self.loading.get(member.member_id) is member

    # --- joins and leaves ----------------------------------------------------------------------
    def joined(self, member: Member) -> None:
        """A member registered (new, or a restarted process): a replica behind the run's version is fenced until
        it serves it (a push, or the poll seeing it loaded)."""
        required = self.pushed_version
        if member.kind == "inference" and member.version < required:
            self.members.fence(member.member_id, f"joined serving version {member.version}, the run is at {required}")

    def forget_silent(self, now: float) -> list[Member]:
        """Drop the replicas that joined by themselves and have been silent for `forget_after_s`: they are no longer
        polled or pushed (the transport cancels any load still in flight to them). Returns them."""
        gone = [
            m
            for m in self.members.members.values()
            if m.kind == "inference" and m.member_id not in self.configured and now - m.last_seen > self.forget_after_s
        ]
        for member in gone:
            self.members.remove(member.member_id)
            self.loading.pop(member.member_id, None)
            self._refusals.pop(member.member_id, None)
            self._loads_ended.pop(member.member_id, None)
            log.warning(
                "replica %s has not been heard from for %.0f s: dropped from the run (it registers again if it "
                "comes back)",
                member.member_id,
                now - member.last_seen,
            )
        return gone

    # --- Status polls --------------------------------------------------------------------------
    def poll_sent(self, member: Member) -> int:
        """A Status poll is about to be sent to `member`: the token to give `status_answered` with its reply."""
        return self._loads_ended.get(member.member_id, 0)

    def status_answered(
        self, member: Member, token: int, loaded: int, relay_address: str, relay_version: int, now: float
    ) -> Load | None:
        """A replica answered Status: it serves `loaded`, its relay (if any) holds `relay_version`. Fences one
        behind the run, puts one that serves the run's version back in rotation, and returns the catch-up to start
        for one still behind (None: nothing to do now)."""
        if not self.current(member):
            return None  # the old process's reply: it says nothing of the new one
        member.relay_address, member.relay_version = relay_address, relay_version
        load = None
        if token == self._loads_ended.get(member.member_id, 0):  # else a load ended since it was sent: stale version
            if loaded < self.pushed_version and not member.fenced:
                self.members.fence(member.member_id, f"serves version {loaded}")
            elif member.fenced and loaded >= self.pushed_version:
                # It answers and serves the current version (caught up, came back, or joined and was pushed).
                log.info("replica %s serves version %d again: back in rotation", member.member_id, loaded)
                self.members.loaded(member.member_id, loaded)
            if member.fenced and loaded < self.pushed_version:
                load = self.catch_up(member, loaded, now)
        self.members.answered_poll(member.member_id, now)
        return load

    def status_missed(self, member: Member, code: str) -> None:
        """A replica did not answer Status (`code`: the gRPC code's name); enough misses in a row fence it."""
        if not self.current(member):
            return  # the old process's poll timing out: no miss against the new one
        missed = self.members.missed_poll(member.member_id, code)
        if missed >= self.unresponsive_polls and not member.fenced:
            reason = f"did not answer Status {missed} times in a row ({code})"
            self.members.fence(member.member_id, reason)
            log.warning("fenced replica %s: %s; its rollouts go to the other replicas", member.member_id, reason)
        else:
            log.debug("inference %s did not answer Status: %s", member.member_id, code)

    # --- catch-up ------------------------------------------------------------------------------
    def catch_up(self, member: Member, loaded: int, now: float) -> Load | None:
        """The load that brings a fenced replica serving `loaded`, older than the run's version, up to date; None
        while nothing has been pushed, a load to it is in flight, or it is backing off after refusals."""
        if not self.weights_source or self.load_in_flight(member):
            return None
        refusals = self._refusals.get(member.member_id)
        if refusals is not None and refusals.member is member and now < refusals.retry_at:
            return None
        version, trainer = self.pushed_version, self.weights_source
        plan = PushSource(trainer, False)
        if self.weight_fanout != "direct" and member.relay_address:
            # Relayed pushes: from a peer whose relay holds the version, else the trainer; through its own relay.
            peer = self.members.relay_source(version, now, exclude=member.member_id)
            plan = PushSource(trainer if peer is None else peer.relay_address, True)
        log.info(
            "replica %s serves version %d, the run is at %d: pushing it from %s",
            member.member_id,
            loaded,
            version,
            plan.source,
        )
        self.loading[member.member_id] = member
        return Load(member, version, plan, "catch-up")

    def catch_up_delay_s(self, refusals: int) -> float:
        """How long a replica waits for its next catch-up after `refusals` failed ones in a row: the first is
        retried at the next poll, then the wait doubles from `catch_up_backoff_s`, at most
        `catch_up_backoff_max_s`."""
        if refusals <= 1:
            return 0.0
        return min(self.catch_up_backoff_s * 2 ** (refusals - 2), self.catch_up_backoff_max_s)

    # --- loads ending ----------------------------------------------------------------------------
    def _ended(self, load: Load) -> bool:
        """Bookkeeping for a load that ended; whether its member is still the registered process."""
        member = load.member
        if self.loading.get(member.member_id) is member:
            del self.loading[member.member_id]
        if not self.current(member):
            return False  # it restarted meanwhile: the new process starts from the base model
        self._loads_ended[member.member_id] = self._loads_ended.get(member.member_id, 0) + 1
        return True

    def load_cancelled(self, load: Load) -> None:
        """`load` was cancelled (abandoned, its replica dropped, the run ending): nothing is known of its outcome."""
        self._ended(load)

    def load_succeeded(self, load: Load, version: int) -> bool:
        """`load` ended with the replica serving `version`. Returns whether it serves the run's version now (back
        in rotation); a catch-up overtaken by a newer push leaves it fenced (the next poll pushes that one)."""
        if not self._ended(load):
            return False
        self._refusals.pop(load.member.member_id, None)
        if load.plan.relay:  # its relay holds the version now (a catch-up may fetch it there before the next poll)
            load.member.relay_version = version
        if version >= self.pushed_version or load.kind == "push":
            self.members.loaded(load.member.member_id, version)
            return True
        load.member.version = version
        return False

    def load_failed(self, load: Load, code: str, details: str, now: float, push: PushRound | None = None) -> None:
        """`load` failed with gRPC code `code`. A push fences the replica (and counts a refusal when it answered);
        a failed catch-up leaves it fenced and backs off before the next."""
        if not self._ended(load):
            return
        member = load.member
        if load.kind == "push":
            reason = f"LoadWeights({load.version}) failed: {code}: {details}"
            self.members.fence(member.member_id, reason)
            log.warning("fenced replica %s: %s", member.member_id, reason)
            if push is not None and code not in GONE_CODE_NAMES:
                push.refused.add(member.member_id)
            return
        refusals = self._refusals.get(member.member_id)
        count = refusals.count + 1 if refusals is not None and refusals.member is member else 1
        delay = self.catch_up_delay_s(count)
        self._refusals[member.member_id] = _Refusals(member, count, now + delay)
        log.warning(
            "replica %s did not load version %d: %s: %s (%d in a row; %s)",
            member.member_id,
            load.version,
            code,
            details,
            count,
            f"next try in {delay:.0f} s" if delay else "tried again at the next poll",
        )

    # --- pushes ----------------------------------------------------------------------------------
    def start_push(self, version: int, source: str, now: float) -> PushRound:
        """Push `version` from `source` (the trainer's weight stream) to every live replica, fenced ones too (they
        may catch up). One not answering Status is skipped (it stays fenced; once it answers, a poll catches it
        up), and so is one still loading an older version (a poll pushes it this one after)."""
        self.weights_source = source
        replicas = [
            m
            for m in self.members.alive("inference", now)
            if m.missed_polls < self.unresponsive_polls and not self.load_in_flight(m)
        ]
        # "direct": each fetches from the trainer; "chain"/"tree": relayed, planned in registration order
        # (fleetrl.controller.push_plan), all started at once (each relay pipelines from its upstream).
        plans = push_sources([(m.member_id, m.relay_address) for m in replicas], self.weight_fanout, source)
        loads = [Load(m, version, plans[m.member_id], "push") for m in replicas]
        for load in loads:
            self.loading[load.member.member_id] = load.member
        return PushRound(version, loads)

    def unresponsive(self, load: Load) -> bool:
        """The replica of a push's load stopped answering Status (hung, SIGSTOP): abandon that load."""
        return load.member.missed_polls >= self.unresponsive_polls

    def push_abandoned(self, load: Load) -> None:
        """A push's load is being cancelled because its replica stopped answering: it is fenced (the cancelled
        load reports `load_cancelled` as it ends)."""
        if not self.current(load.member):
            return
        self.members.fence(load.member.member_id, f"stopped answering during the push of version {load.version}")
        log.warning(
            "fenced replica %s: stopped answering during the push of version %d", load.member.member_id, load.version
        )

    def finish_push(self, push: PushRound, now: float) -> str | None:
        """Every load of `push` ended: fence the replicas still behind it (e.g. a catch-up to the previous version
        ended meanwhile), and make its version the run's. Returns why the run fails (every replica answered and
        refused the weights), else None; with no replica serving it yet, the run waits for one."""
        version = push.version
        for member in self.members.alive("inference", now):
            if member.version < version and not member.fenced:
                self.members.fence(member.member_id, f"serves version {member.version}, the run is at {version}")
        if not self.members.routable_replicas(now):
            if push.refused and len(push.refused) == len(push.loads):
                return f"every inference replica failed to load version {version}"
            log.warning(
                "no replica serves version %d yet: rollouts wait until one answers again and has loaded it", version
            )
        self.pushed_version = version
        return None
