"""The member registry: who is in the run, who is alive, which inference replicas may be routed to.

A member registers with a kind and an address and heartbeats; one silent for longer than
`heartbeat_timeout_s` is dead. Registering again at the same address refreshes the entry; at another address it
is a restarted process and replaces the entry (an inference replica then serves the base model again). An
inference replica that fails or times out a weight push, stops answering, or serves an older version than the run's
is fenced: no rollouts are routed to it until it serves the current version (the controller pushes it). A replica's
Status names its weight relay and the version that relay holds, so a replica that joins later fetches from a peer
(`relay_source`). Time comes from the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MemberKind = Literal["gateway", "inference", "trainer", "reference"]
MEMBER_KINDS: tuple[str, ...] = ("gateway", "inference", "trainer", "reference")


@dataclass
class Member:
    kind: str
    member_id: str
    address: str
    last_seen: float
    version: int = 0
    fenced: bool = False
    fence_reason: str = ""
    missed_polls: int = 0  # Status polls in a row it did not answer (a hung or stopped process)
    relay_address: str = ""  # an inference replica's weight relay, from its Status ("" = none known)
    relay_version: int = 0  # the version that relay holds complete (0 = none), as of its last Status
    last_error: str = ""  # the gRPC code of its last missed Status poll ("" once it answers)

    def alive(self, now: float, timeout_s: float) -> bool:
        return now - self.last_seen <= timeout_s


class MemberRegistry:
    def __init__(self, heartbeat_timeout_s: float = 30.0) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.members: dict[str, Member] = {}

    def register(self, kind: str, member_id: str, address: str, now: float, version: int = 0) -> Member:
        if kind not in MEMBER_KINDS:
            raise ValueError(f"unknown member kind {kind!r}; expected one of {MEMBER_KINDS}")
        if not member_id:
            raise ValueError("member_id must not be empty")
        if kind in ("inference", "trainer", "reference") and not address:
            raise ValueError(f"a {kind} member must give the address it serves at")
        existing = self.members.get(member_id)
        if existing is not None and existing.kind == kind and existing.address == address:
            existing.last_seen = now
            return existing
        # New, or back at another address: a restarted process, which starts from the base model (`version`)
        # and has answered no poll yet, whatever the entry it replaces knew.
        member = Member(kind, member_id, address, now, version=version)
        self.members[member_id] = member
        return member

    def heartbeat(self, member_id: str, now: float) -> bool:
        member = self.members.get(member_id)
        if member is None:
            return False
        member.last_seen = now
        return True

    def alive(self, kind: str, now: float) -> list[Member]:
        return [m for m in self.members.values() if m.kind == kind and m.alive(now, self.heartbeat_timeout_s)]

    def routable_replicas(self, now: float) -> list[Member]:
        """Live inference replicas that are not fenced."""
        return [m for m in self.alive("inference", now) if not m.fenced]

    def fence(self, member_id: str, reason: str) -> None:
        member = self.members[member_id]
        member.fenced, member.fence_reason = True, reason

    def loaded(self, member_id: str, version: int) -> None:
        """A weight push to this replica succeeded: it serves `version` and is routable again."""
        member = self.members[member_id]
        member.version, member.fenced, member.fence_reason = version, False, ""

    def relay_source(self, version: int, now: float, exclude: str = "") -> Member | None:
        """A routable replica (not `exclude`) whose relay holds `version`: a joining or fenced replica fetches
        that version from it instead of from the trainer. None when there is none."""
        for member in self.routable_replicas(now):
            if member.member_id != exclude and member.relay_address and member.relay_version == version:
                return member
        return None

    def missed_poll(self, member_id: str, error: str = "") -> int:
        """The member did not answer a Status poll (`error`: the gRPC code); returns how many in a row."""
        member = self.members[member_id]
        member.missed_polls += 1
        member.last_error = error
        return member.missed_polls

    def answered_poll(self, member_id: str, now: float) -> None:
        member = self.members[member_id]
        member.missed_polls, member.last_seen, member.last_error = 0, now, ""

    def remove(self, member_id: str) -> None:
        self.members.pop(member_id, None)

    def dead(self, now: float) -> list[Member]:
        return [m for m in self.members.values() if not m.alive(now, self.heartbeat_timeout_s)]
