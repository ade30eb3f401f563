"""The agent session server's limits and the pure state behind them (no sockets): which sessions are open, when
each was last called, and which expired; and when a connection has stalled.

    limits = SessionLimits.of_run(run)                 # session_idle_timeout_s, session_max_body_bytes, ...
    registry = SessionRegistry(limits.idle_timeout_s, clock=time.monotonic)
    registry.add(session)
    session = registry.get(session_id)                 # None: registry.why_missing(session_id) says why
    with registry.calling(session_id): ...             # a call in flight never expires its session
    registry.sweep()                                   # expire sessions idle past the limit (and closed ones)

Sessions are held weakly, as before: a session lives as long as its rollout holds it. An agent may never close its
session and its rollout may hold it for a long time (waiting on an agent that hung): such a session expires once no
call has reached it for `idle_timeout_s`, so its endpoint answers 404 naming the limit, and the server keeps no
state for it. The rollout keeps what the session recorded (`to_rollout_run` still works).
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fleetrl.agent_session import AgentSession

DEFAULT_IDLE_TIMEOUT_S = 600.0
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_STALL_TIMEOUT_S = 30.0
_REMEMBERED_EXPIRED = 4096  # expired ids kept to say "expired" rather than "unknown" (bounded)


@dataclass(frozen=True)
class SessionLimits:
    """What one session server admits.

    Attributes:
        idle_timeout_s: a session no call has reached for this long expires (its endpoint answers 404); 0 = never.
        max_body_bytes: a request body over this is refused with 413 before it is parsed.
        max_connections: open connections at most; one more is closed as it is accepted (the gateway's file
            descriptors are shared with its gRPC and ZeroMQ sockets).
        stall_timeout_s: a connection that sends no complete request, a body that stops arriving, or a reader
            that takes none of its reply, for this long, is closed (408 for a body).
    """

    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("idle_timeout_s", "stall_timeout_s"):
            value = getattr(self, name)
            if not value >= 0 or value == float("inf"):  # NaN fails the first test
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        if self.stall_timeout_s == 0:
            raise ValueError("stall_timeout_s: must be > 0")
        for name in ("max_body_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)!r}")

    @classmethod
    def of_run(cls, run: Any) -> SessionLimits:
        """The limits a run's config sets (`session_idle_timeout_s`, `session_max_body_bytes`,
        `session_max_connections`); defaults for what it lacks."""
        return cls(
            idle_timeout_s=float(getattr(run, "session_idle_timeout_s", DEFAULT_IDLE_TIMEOUT_S)),
            max_body_bytes=int(getattr(run, "session_max_body_bytes", DEFAULT_MAX_BODY_BYTES)),
            max_connections=int(getattr(run, "session_max_connections", DEFAULT_MAX_CONNECTIONS)),
        )


class SessionRegistry:
    """The open sessions of one server, by id, held weakly, with when each was last called (see the module
    docstring). `clock` is a monotonic clock in seconds."""

    def __init__(self, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S, clock: Callable[[], float] = time.monotonic):
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self._sessions: weakref.WeakValueDictionary[str, AgentSession] = weakref.WeakValueDictionary()
        self._last_call: dict[str, float] = {}
        self._in_flight: dict[str, int] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self.expired_total = 0

    def add(self, session: AgentSession) -> None:
        """Keep `session`; it is idle from now."""
        self._sessions[session.session_id] = session
        self._last_call[session.session_id] = self.clock()

    def get(self, session_id: str) -> AgentSession | None:
        """The open session `session_id`, or None (unknown, closed, dropped by its rollout, or expired)."""
        session = self._sessions.get(session_id)
        if session is None or session.closed:
            return None
        return session

    def why_missing(self, session_id: str) -> str:
        """Why `session_id` has no endpoint, for the 404's message."""
        if session_id in self._expired:
            return (
                f"session {session_id} expired: no call reached it for {self.idle_timeout_s:g} s "
                "(session_idle_timeout_s)"
            )
        return f"no open session {session_id}"

    @contextmanager
    def calling(self, session_id: str) -> Iterator[None]:
        """A call to `session_id` in flight: its session does not expire meanwhile, and is idle from its end."""
        self._in_flight[session_id] = self._in_flight.get(session_id, 0) + 1
        self._last_call[session_id] = self.clock()
        try:
            yield
        finally:
            left = self._in_flight.pop(session_id) - 1
            if left:
                self._in_flight[session_id] = left
            if session_id in self._sessions:
                self._last_call[session_id] = self.clock()

    def sweep(self) -> int:
        """Forget closed sessions and those dropped by their rollout, and expire those idle past the limit with no
        call in flight. Returns how many expired."""
        now, expired = self.clock(), 0
        for session_id in list(self._last_call):
            session = self._sessions.get(session_id)
            if session is None or session.closed:
                self.pop(session_id)
                continue
            idle = now - self._last_call[session_id]
            if self.idle_timeout_s and idle >= self.idle_timeout_s and not self._in_flight.get(session_id):
                self.pop(session_id)
                self._expired[session_id] = None
                while len(self._expired) > _REMEMBERED_EXPIRED:
                    self._expired.popitem(last=False)
                expired += 1
        self.expired_total += expired
        return expired

    def pop(self, session_id: str, default: Any = None) -> AgentSession | None:
        """Forget `session_id` (its endpoint then answers 404)."""
        self._last_call.pop(session_id, None)
        return self._sessions.pop(session_id, default)

    def __contains__(self, session_id: object) -> bool:
        return isinstance(session_id, str) and self.get(session_id) is not None

    def __getitem__(self, session_id: str) -> AgentSession:
        return self._sessions[session_id]

    def __len__(self) -> int:
        return len(self._sessions)

    def tracked(self) -> int:
        """How many ids the registry keeps state for (bounded by the open sessions it has not swept yet)."""
        return len(self._last_call)
