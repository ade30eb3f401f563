"""Which weight version to push next when pushes overlap training: ``PushQueue``, pure logic (no sockets, no gRPC).

With `max_head_offpolicy_versions` O >= 1 the controller does not wait for a version to reach the replicas before it
sends the next TrainStep: samples of step k+1 may lawfully come from version k-1, so the trainer trains while version
k travels (PipelineRL, AReaL). At most one push is in flight. A version the trainer publishes while one is in flight
waits in one pending slot; a newer one published before that push started supersedes it (it is never pushed: the
replicas go straight to the newer one, and the gate jumps with them). The bound does not depend on any of this: the
controller checks each group's offset against the step it joins when it is accepted (fleetrl.controller.scheduler),
and the gate admits rows only against the version the replicas actually serve (published once a push ends).

With O = 0 (or `overlap_weight_push = false`) every push is awaited before the next TrainStep: strictly serial.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PushJob:
    """A published version to push: the trainer's weight stream it is fetched from, its bytes, and when the trainer
    published it (the controller's clock: the TrainStep reply)."""

    version: int
    source: str
    nbytes: int
    published_at: float


class PushQueue:
    """One push in flight, at most one pending; counts superseded versions and each version's publish-to-served time."""

    def __init__(self) -> None:
        self.in_flight: PushJob | None = None
        self.pending: PushJob | None = None
        self.superseded = 0  # versions published but never pushed: a newer one replaced them while they waited
        self.served: list[tuple[int, float]] = []  # (version, seconds from publish to served by every replica)
        self.last_version = 0  # the newest version published

    def published(self, job: PushJob) -> PushJob | None:
        """The trainer published `job`'s version. Returns the job to start now, or None when it waits (a push is in
        flight); a job already waiting is superseded by it."""
        if job.version <= self.last_version:
            raise ValueError(f"version {job.version} published after version {self.last_version}")
        self.last_version = job.version
        if self.in_flight is None:
            self.in_flight = job
            return job
        if self.pending is not None:
            self.superseded += 1
        self.pending = job
        return None

    def done(self, version: int, now: float) -> PushJob | None:
        """The push of `version` ended with every live replica serving it. Returns the next job to start (the
        pending one), or None."""
        if self.in_flight is None or self.in_flight.version != version:
            raise ValueError(f"push of version {version} ended, but {self.in_flight} is the one in flight")
        self.served.append((version, now - self.in_flight.published_at))
        self.in_flight, self.pending = self.pending, None
        return self.in_flight

    def failed(self) -> None:
        """The push in flight failed the run: nothing more is started."""
        self.in_flight = self.pending = None

    def idle(self) -> bool:
        return self.in_flight is None and self.pending is None

    def take_served(self) -> list[tuple[int, float]]:
        """The (version, publish-to-served seconds) of the pushes that ended since the last call."""
        out, self.served = self.served, []
        return out
