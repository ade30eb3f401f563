"""Driving vLLM weight-transfer engines from the trainer: which engine, when its group is built, what falls back.

Pure logic (no socket, no process group, no vLLM import): the engine itself sits behind the `EngineTransport`
seam, which a real run fills with a vLLM trainer engine (vLLM's "nccl", "nccl_m2n" or "ipc" on GPUs; fleetrl's
"fleetrl_gloo" stand-in on CPU: fleetrl.weights.vllm_gloo) and the weight stream; tests fill it with scripted ones.

- `choose_engine(layout)`: "ipc" when trainer and replica share a GPU; "nccl_m2n" when the trainer is sharded
  (world size > 1) and the replica runs tensor parallel (the trainer sends its own shards and vLLM reshards them into
  its TP layout, no full gather); "nccl" (a packed broadcast of full tensors) for any other GPU replica; "fleetrl_gloo"
  for a CPU replica in the engine tests; "fleetrl_zmq" (the weight stream) for a LoRA adapter, and wherever no
  collective applies. A replica whose engine cannot join a group (hf: `ReplicaInfo.engine_group` False) is in the
  fleet but never in the group: it loads every version over the stream, which counts as no fallback.
- `EngineSync`: the replicas in the engine group and the version each serves. The group (one communicator) is
  built once, at the first push, and again only at the push after a replica joined or left, or after a transfer
  through it failed (it is unusable then); pushes in between reuse it. (A replica that joins mid-run is caught up
  over the weight stream by the controller at once, as before; it enters the group at the next push.) A failed
  build or transfer loads that version over the weight stream on every replica instead (`fallbacks`), and a replica
  that fails that too leaves the group for `probation`: named again (the same process), it is not let back into a
  group build (a dead one would hold the rendezvous until its timeout) but offered each version over the stream,
  and rejoins the group at the next push once a stream load succeeds; `leave` (a replica gone, or restarted at a new
  address) ends its probation. A version counts as served (`served_version`) only once every replica still in the
  fleet has loaded it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "ENGINES",
    "EngineLayout",
    "EnginePushCounts",
    "EngineSync",
    "EngineTransport",
    "PushOutcome",
    "ReplicaInfo",
    "choose_engine",
]

logger = logging.getLogger(__name__)

ENGINES = ("ipc", "nccl_m2n", "nccl", "fleetrl_gloo", "fleetrl_zmq")


@dataclass(frozen=True)
class EngineLayout:
    """Where the trainer and a replica run."""

    trainer_device: str  # "cuda" or "cpu"
    replica_device: str
    trainer_world_size: int = 1
    replica_tensor_parallel: int = 1
    colocated: bool = False  # the trainer and the replica share one GPU
    adapter: bool = False  # a LoRA run: only the adapter travels


def choose_engine(layout: EngineLayout) -> str:
    """The weight-transfer engine for `layout` (see the module docstring)."""
    if layout.trainer_world_size < 1 or layout.replica_tensor_parallel < 1:
        raise ValueError(f"trainer_world_size and replica_tensor_parallel must be >= 1: {layout}")
    if layout.adapter:
        return "fleetrl_zmq"
    on_gpu = layout.trainer_device == "cuda" and layout.replica_device == "cuda"
    if on_gpu and layout.colocated:
        return "ipc"
    if on_gpu and layout.trainer_world_size > 1 and layout.replica_tensor_parallel > 1:
        return "nccl_m2n"
    if on_gpu:
        return "nccl"
    if layout.trainer_device == "cpu" and layout.replica_device == "cpu":
        return "fleetrl_gloo"
    return "fleetrl_zmq"  # one end on a GPU, the other not: no collective links them


@dataclass(frozen=True)
class ReplicaInfo:
    """A replica in the fleet: its name, how many workers (tensor-parallel ranks) receive, and whether its engine
    can join a group at all (False: an hf replica, which always loads over the weight stream)."""

    name: str
    workers: int = 1
    engine_group: bool = True


class EngineTransport(Protocol):
    """What `EngineSync` drives. `build` and `send` raise on failure (any exception); `stream_load` loads one
    replica over the weight stream and raises on failure."""

    def build(self, replicas: Sequence[ReplicaInfo], rank_offsets: dict[str, int], world_size: int) -> None: ...

    def send(self, version: int) -> None:
        """Raises on failure; the exception's ``served`` attribute (names), if any, lists the replicas that
        received the version whole anyway."""
        ...

    def teardown(self) -> None: ...

    def stream_load(self, replica: str, version: int) -> None: ...


@dataclass
class PushOutcome:
    """How one version reached the replicas."""

    version: int
    engine: list[str] = field(default_factory=list)  # loaded through the engine group
    stream: list[str] = field(default_factory=list)  # loaded over the weight stream
    failed: list[str] = field(default_factory=list)  # neither: dropped from the group
    error: str = ""  # why the engine path was not used or failed

    @property
    def served_by_all(self) -> bool:
        return not self.failed


class EngineSync:
    """The engine group's membership and the push of each version (see the module docstring)."""

    def __init__(self, transport: EngineTransport) -> None:
        self.transport = transport
        self.replicas: dict[str, ReplicaInfo] = {}  # the fleet, in join order
        self.group: tuple[ReplicaInfo, ...] | None = None  # the replicas the live group was built for
        self.serves: dict[str, int] = {}  # replica -> the version it reported loaded
        self.probation: dict[str, ReplicaInfo] = {}  # failed both ways: kept out of builds until a stream load works
        self.builds = 0
        self.fallbacks = 0

    # -- membership ----------------------------------------------------------------------------

    def join(self, replica: ReplicaInfo) -> None:
        """A replica joins the fleet: it is in the group from the next build on (one on probation stays there)."""
        if replica.name not in self.probation:
            self.replicas[replica.name] = replica

    def leave(self, name: str) -> None:
        """A replica leaves (or died, or restarted elsewhere): the group is built again without it before the next
        engine transfer; its probation, if any, ends."""
        self.replicas.pop(name, None)
        self.serves.pop(name, None)
        self.probation.pop(name, None)

    @property
    def needs_build(self) -> bool:
        return self.group != self._capable()

    def _capable(self) -> tuple[ReplicaInfo, ...]:
        """The replicas the group is built for: those whose engine can join one."""
        return tuple(r for r in self.replicas.values() if r.engine_group)

    def rank_offsets(self, replicas: Sequence[ReplicaInfo]) -> tuple[dict[str, int], int]:
        """Each replica's first rank (the trainer is rank 0; a replica's workers take consecutive ranks) and the
        group's world size."""
        offsets, rank = {}, 1
        for replica in replicas:
            offsets[replica.name] = rank
            rank += replica.workers
        return offsets, rank

    # -- one version ---------------------------------------------------------------------------

    def push(self, version: int) -> PushOutcome:
        """Bring every replica in the fleet to `version`: through the engine group when it is (or can be made) up,
        else, and for those outside it, over the weight stream."""
        outcome = PushOutcome(version)
        fleet = list(self.replicas.values())
        on_probation = list(self.probation.values())  # before this push: those it drops wait for the next
        if not fleet and not on_probation:
            return outcome
        capable = self._capable()
        if capable and self.needs_build:
            self._build(outcome)
        elif not capable:
            self._drop_group()  # none left that can join one (the last vLLM replica left)
        members = [r.name for r in self.group or ()] if capable else []
        if members:
            try:
                self.transport.send(version)
            except Exception as exc:  # any failure of the engine path falls back to the stream
                outcome.error = f"transfer failed: {exc}"
                logger.warning("weights version %d through the engine group failed (%s): over the stream", version, exc)
                self._drop_group()
                # Replicas the engine says received the version whole anyway (their update finished) count as served.
                members = [name for name in getattr(exc, "served", []) if name in members]
            outcome.engine = members
        for replica in fleet:
            if replica.name in members:
                self.serves[replica.name] = version
                continue
            try:
                self.transport.stream_load(replica.name, version)
            except Exception as exc:  # a replica that cannot load is dropped, not fatal
                logger.warning("replica %s could not load weights version %d (%s): dropped", replica.name, version, exc)
                outcome.failed.append(replica.name)
                self.leave(replica.name)
                self.probation[replica.name] = replica
            else:
                outcome.stream.append(replica.name)
                self.serves[replica.name] = version
        for replica in on_probation:  # over the stream only; back in the group once it loads
            try:
                self.transport.stream_load(replica.name, version)
            except Exception as exc:  # still failing: still on probation
                logger.warning(
                    "replica %s (on probation) could not load weights version %d (%s)", replica.name, version, exc
                )
                outcome.failed.append(replica.name)
            else:
                del self.probation[replica.name]
                self.replicas[replica.name] = replica  # in the group from the next build (the next push)
                outcome.stream.append(replica.name)
                self.serves[replica.name] = version
        if outcome.stream and outcome.error:
            self.fallbacks += 1
        return outcome

    @property
    def served_version(self) -> int | None:
        """The newest version every replica in the fleet serves (None while one serves none yet)."""
        if not self.replicas or any(name not in self.serves for name in self.replicas):
            return None
        return min(self.serves[name] for name in self.replicas)

    def close(self) -> None:
        self._drop_group()

    # -- internals -----------------------------------------------------------------------------

    def _build(self, outcome: PushOutcome) -> None:
        self._drop_group()
        replicas = self._capable()
        offsets, world = self.rank_offsets(replicas)
        try:
            self.transport.build(replicas, offsets, world)
        except Exception as exc:  # no group: this version goes over the stream, the next one retries
            outcome.error = f"build failed: {exc}"
            logger.warning("building the weight-transfer group failed (%s): loading over the stream", exc)
            return
        self.group = replicas
        self.builds += 1

    def _drop_group(self) -> None:
        if self.group is not None:
            self.group = None
            try:
                self.transport.teardown()
            except Exception:  # teardown of a broken group
                logger.debug("engine group teardown failed", exc_info=True)


@dataclass
class EnginePushCounts:
    """A run's figures of the engine path, as the controller sees the trainer's PushEngine replies (its metrics
    line: `figures`). `builds` and `fallbacks` are the trainer's running totals; the replica counts are those of
    the last version pushed."""

    builds: int = 0
    fallbacks: int = 0
    call_failures: int = 0  # PushEngine calls that failed outright (every replica loaded over the stream)
    version: int = -1  # the last version pushed
    engine_replicas: int = 0
    stream_replicas: int = 0
    failed_replicas: int = 0

    def pushed(self, reply: object) -> None:
        """A PushEngine reply (anything with version, builds, fallbacks, engine, stream, failed)."""
        self.builds = int(getattr(reply, "builds", 0))
        self.fallbacks = int(getattr(reply, "fallbacks", 0))
        self.version = int(getattr(reply, "version", -1))
        self.engine_replicas = len(getattr(reply, "engine", ()))
        self.stream_replicas = len(getattr(reply, "stream", ()))
        self.failed_replicas = len(getattr(reply, "failed", ()))

    def call_failed(self, version: int) -> None:
        self.call_failures += 1
        self.version = version
        self.engine_replicas = self.stream_replicas = self.failed_replicas = 0

    def figures(self) -> dict[str, int]:
        return {
            "weights/engine_builds": self.builds,
            "weights/engine_fallbacks": self.fallbacks,
            "weights/engine_call_failures": self.call_failures,
            "weights/engine_version": self.version,
            "weights/engine_replicas": self.engine_replicas,
            "weights/stream_replicas": self.stream_replicas,
            "weights/engine_failed_replicas": self.failed_replicas,
        }
