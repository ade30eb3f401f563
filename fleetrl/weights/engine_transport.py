"""`EngineGroupTransport`: `fleetrl.weights.engine_sync.EngineTransport` through any registered weight-transfer
engine: vLLM's "nccl" / "nccl_m2n" / "ipc" on GPUs, fleetrl's "fleetrl_gloo" on CPU (fleetrl.weights.vllm_gloo).

One flow for all of them: `build` makes vLLM's trainer init info for the engine (fleetrl.weights.engine_init) and
creates the trainer engine through vLLM's public ``WeightTransferTrainerFactory.trainer_init`` over a `FanoutClient`
of the group's replicas (which gives each replica its rank offset); `send` sends one version through it;
`stream_load` is the caller's load of one replica over the weight stream (EngineSync's fallback).

A failed send (a replica died mid-broadcast, a peer silent past the timeout; vLLM's NCCL sends run under a deadline,
`transfer_timeout_s` of the version's bytes, since a broadcast to a dead peer never returns) leaves the communicator
broken: under NCCL a collective on it would hang or the watchdog would abort the trainer. So the transport aborts it
at once, before it returns the failure (and so before EngineSync loads anyone over the stream), through what vLLM's
trainer engine offers: each communicator's ``destroy()`` (vLLM's `PyNcclCommunicator.destroy`: ``ncclCommAbort`` on
a daemon thread with a timeout, safe during an uncoordinated failure), not the engine's ``shutdown()`` (nccl_m2n's
synchronizes the device and joins the thread still blocked in the dead collective). The engine is then dropped:
nothing is ever sent on that group again, and EngineSync builds a new one at the next push. fleetrl's own gloo
engine has already shut its group down when it raises; its ``shutdown()`` is its abort.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fleetrl.weights.engine_init import EngineGroupPlan, free_port, trainer_init_info

__all__ = [
    "COMMUNICATOR_ATTRS",
    "WATCHED_ENGINES",
    "EngineGroupTransport",
    "OnDevice",
    "abort_engine",
    "engine_trainer_init",
]

logger = logging.getLogger(__name__)

# Where vLLM's trainer engines hold their communicator: NCCLTrainerWeightTransferEngine.model_update_group,
# M2NTrainerWeightTransferEngine.group (both PyNcclCommunicator; IPC holds none).
COMMUNICATOR_ATTRS = ("model_update_group", "group")
WATCHED_ENGINES = ("nccl", "nccl_m2n")  # sends that a dead peer blocks forever, so they run under a deadline


class OnDevice:
    """A weight source whose tensors are copied to `device` one at a time as they are sent (vLLM's NCCL engines pack
    and broadcast device memory; the published snapshot may be on the host): one tensor's copy at a time on the
    device, no copy of the whole version."""

    def __init__(self, source: Any, device: str) -> None:
        self.source = source
        self.device = device

    def metadata(self) -> Any:
        return self.source.metadata()

    @property
    def total_bytes(self) -> int:
        return int(self.source.total_bytes)

    def __iter__(self) -> Any:
        for name, tensor in self.source:
            yield name, tensor.to(self.device)


def engine_trainer_init(init_info: Any, *, client: Any, source: Any) -> Any:
    """vLLM's public trainer-engine factory (the default `trainer_init` of `EngineGroupTransport`)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import fleetrl.weights.vllm_gloo  # noqa: F401  (registers "fleetrl_gloo")

    return WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)


def abort_engine(engine: Any) -> None:
    """Tear a trainer engine's broken communicator down without touching it again (see the module docstring)."""
    from fleetrl.weights.vllm_gloo import GlooTrainerWeightTransferEngine

    if isinstance(engine, GlooTrainerWeightTransferEngine):
        engine.shutdown()
        return
    for attr in COMMUNICATOR_ATTRS:
        communicator = getattr(engine, attr, None)
        if communicator is None:
            continue
        try:
            communicator.destroy()
        except Exception:  # an abort that fails leaves nothing more to do: the engine is dropped either way
            logger.warning("aborting the engine group's communicator failed", exc_info=True)
        setattr(engine, attr, None)


class EngineGroupTransport:
    """See the module docstring. `clients`: name -> the replica's ``VLLMWeightSyncClient`` (read at each build);
    `source`: the `WeightSource` sent (replaced between versions by the caller); `engine`: the registered engine's
    name; `trainer_init`: the factory (tests pass a scripted one)."""

    def __init__(
        self,
        clients: Mapping[str, Any],
        source: Any,
        stream_load: Callable[[str, int], None],
        *,
        engine: str = "fleetrl_gloo",
        host: str = "127.0.0.1",
        rank: int = 0,
        bucket_bytes: int = 64 << 20,
        timeout_s: float = 60.0,
        trainer_init: Callable[..., Any] = engine_trainer_init,
    ) -> None:
        self.clients = clients
        self.source = source
        self._stream_load = stream_load
        self.engine_name = engine
        self.host = host
        self.rank = rank
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._trainer_init = trainer_init
        self.engine: Any = None
        self.client: Any = None
        self.groups_built = 0
        self.aborts = 0

    def plan(self, replicas: Sequence[Any], rank_offsets: dict[str, int], world_size: int) -> EngineGroupPlan:
        """The group's plan for the next build (a fresh rendezvous port where the engine needs one told)."""
        port = free_port(self.host) if self.engine_name in ("nccl", "nccl_m2n") else 0
        return EngineGroupPlan(
            self.engine_name,
            self.host,
            port,
            dict(rank_offsets),
            world_size,
            trainer_rank=self.rank,
            replica_workers={r.name: r.workers for r in replicas},
            group_name=f"fleetrl-gloo-{self.groups_built + 1}",
            bucket_bytes=self.bucket_bytes,
            timeout_s=self.timeout_s,
        )

    def build(self, replicas: Sequence[Any], rank_offsets: dict[str, int], world_size: int) -> None:
        from fleetrl.weights.vllm_gloo import FanoutClient

        self.teardown()
        plan = self.plan(replicas, rank_offsets, world_size)
        self.groups_built += 1
        offsets, _ = plan.group_ranks()
        self.client = FanoutClient({r.name: self.clients[r.name] for r in replicas}, offsets, self.timeout_s + 10.0)
        self.engine = self._trainer_init(trainer_init_info(plan), client=self.client, source=self.source)

    def send(self, version: int) -> None:
        from fleetrl.weights.vllm_gloo import EngineTransferFailed

        if self.engine is None:
            raise EngineTransferFailed("no engine group is up")
        self.engine.source = self.source
        self.engine.version = version  # fleetrl_gloo labels the version itself
        self.client.version = version  # vLLM's engines call finish_weight_update() without one
        try:
            self._send_watched(self.engine)
        except Exception:
            self.abort()
            raise
        finally:
            if self.engine is not None:
                self.engine.source = None  # the version's tensors are not held past its send

    def _send_watched(self, engine: Any) -> None:
        """``send_weights`` under a deadline for vLLM's NCCL engines: their broadcast to a dead peer never returns
        (vLLM checks the replicas' ``update_weights`` only after it), so past the deadline the send is given up
        and the caller aborts the communicator, which fails the blocked collective. fleetrl's gloo engine bounds
        every broadcast itself."""
        if self.engine_name not in WATCHED_ENGINES:
            engine.send_weights()
            return
        from fleetrl.weights.timeouts import transfer_timeout_s
        from fleetrl.weights.vllm_gloo import EngineTransferFailed

        done = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                engine.send_weights()
            except BaseException as exc:  # handed to the caller's thread
                errors.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name="fleetrl-engine-send", daemon=True).start()
        deadline_s = transfer_timeout_s(self.timeout_s, int(getattr(engine.source, "total_bytes", 0) or 0))
        if not done.wait(deadline_s):
            raise EngineTransferFailed(
                f"the send through the {self.engine_name} group did not end in {deadline_s:.0f} s"
            )
        if errors:
            raise errors[0]

    def abort(self) -> None:
        """After a failed send: the communicator torn down, the engine dropped (never sent on again)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            self.aborts += 1
            abort_engine(engine)

    def teardown(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()

    def stream_load(self, replica: str, version: int) -> None:
        self._stream_load(replica, version)
