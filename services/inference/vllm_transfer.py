"""fleetrl's weight stream as a vLLM weight-transfer backend (`BACKEND` = "fleetrl_zmq").

vLLM 0.32 updates weights through one API whatever moves the bytes: `AsyncLLM.init_weight_transfer_engine` once,
then per version `start_weight_update`, `update_weights` (one or more chunks) and `finish_weight_update(version)`,
each a collective rpc to every worker, where a `WeightTransferEngine` registered in `WeightTransferEngineFactory`
does the work (nccl and ipc on GPU). This module registers fleetrl's ZeroMQ weight stream as such an engine, so a
CPU replica (and one on a machine without NCCL to the trainer) goes through the same calls a GPU run makes:

- `start_weight_update` starts vLLM's layerwise reload (`initialize_layerwise_reload`), `finish_weight_update`
  finalizes it (`finalize_layerwise_reload`: each layer's post-load processing, e.g. the CPU backend's oneDNN
  prepacking), as vLLM's own checkpoint-format engines do;
- `update_weights({"version", "load_id"})` loads the copy the worker staged for `load_id` while generation ran
  (fleetrl's worker extension fetches, verifies every tensor's checksum and checks names, shapes and dtypes against
  the served model first: services/inference/vllm_worker.py). Given `address` (and `auth_token`, `timeout_s`) and
  no `load_id`, it fetches the version from that weight stream itself, checked the same way: what a client that
  knows only vLLM's API sends. Given ``collective`` (the group a replica joined: ``weight_transport =
  "collective"``, fleetrl.weights.collective), every worker receives the version by broadcast in
  ``update_weights`` itself, checked the same way (fleetrl's engine stages it first instead, so that the broadcast
  runs while generation continues);
- an engine group (issue 39 item 3, fleetrl.weights.engine_sync): ``init_weight_transfer_engine({"engine": name,
  "engine_init": ...})`` creates that engine through vLLM's factory beside the stream ("nccl", "nccl_m2n", "ipc"
  on GPUs; "fleetrl_gloo", fleetrl.weights.vllm_gloo, on CPU) and initialises it (the group is joined once and
  kept); ``update_weights({"version", "engine_update": ...})`` receives the version through it, bucket by bucket.
  `LocalEngineClient` drives a `VLLMEngine` in this process through those calls (vLLM's ``VLLMWeightSyncClient``).

`update_weights` is overridden because the base class calls `torch.accelerator.synchronize()`, which raises on a
machine without an accelerator; here it synchronizes only when there is one. Registration happens when this module
is imported (with "fleetrl_gloo"): by the worker extension module in every worker process (imported before the
worker loads the model and creates its transfer engine) and by `VLLMEngine` in the front end.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from fleetrl.services.inference.vllm_worker import WeightSwapExtension
from fleetrl.weights.vllm_gloo import LayerwiseReceiver

__all__ = ["BACKEND", "LocalEngineClient", "StreamWeightTransferEngine", "WeightSwapExtension", "register"]

BACKEND = "fleetrl_zmq"


def engine_update_dict(update_info_cls: type, update: dict[str, Any]) -> dict[str, Any]:
    """The trainer's update dict as `update_info_cls` takes it: the "version" the trainer sends with every update
    (fleetrl's own engines read it) is left out for an engine whose update info has no such field (vLLM's "nccl"
    refuses unknown keys); any other key stays, so a wrong one is still refused by the engine's own parsing."""
    fields = getattr(update_info_cls, "__dataclass_fields__", None)
    if fields is not None and "version" not in fields:
        return {k: v for k, v in update.items() if k != "version"}
    return update


@dataclass
class StreamInitInfo(WeightTransferInitInfo):
    """Nothing to set up for the stream (each update names its stream or its staged copy). ``engine`` names a
    collective engine to set up beside it, created through vLLM's factory and initialised with ``engine_init`` (its
    own init info, e.g. the group's address and this replica's rank offset): the group is built here once and kept
    until the next init or a shutdown; updates that carry ``engine_update`` go through it."""

    engine: str = ""
    engine_init: dict[str, Any] | None = None


@dataclass
class StreamUpdateInfo(WeightTransferUpdateInfo):
    version: int
    load_id: str = ""  # a copy the worker staged (fleetrl_stage_weights); else fetch from `address`
    address: str = ""
    auth_token: str | None = None
    timeout_s: float = 120.0
    # The collective transport (fleetrl.weights.collective): the group's offer, manifest (JSON text), rank_offset and
    # world_size, as the replica's front end fills them after joining; every worker receives the version by
    # broadcast (rank_offset + its local rank) inside update_weights.
    collective: dict[str, Any] | None = None
    # The engine set up at init (``StreamInitInfo.engine``): its own update info; the version arrives through it.
    engine_update: dict[str, Any] | None = None


class StreamWeightTransferEngine(LayerwiseReceiver, WeightTransferEngine[StreamInitInfo, StreamUpdateInfo]):
    """The worker side of the "fleetrl_zmq" backend (see the module docstring)."""

    init_info_cls = StreamInitInfo
    update_info_cls = StreamUpdateInfo
    supports_draft_weight_update = False

    inner: WeightTransferEngine | None = None

    def init_transfer_engine(self, init_info: StreamInitInfo) -> None:
        self.initialized = True
        if not init_info.engine:
            return
        from vllm.config.weight_transfer import WeightTransferConfig

        self._shutdown_inner()  # a rebuilt group replaces the one before
        inner = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend=init_info.engine), self.vllm_config, self.device, self.model
        )
        inner.init_transfer_engine(inner.parse_init_info(init_info.engine_init or {}))
        self.inner = inner

    def receive_weights(self, update_info: StreamUpdateInfo) -> None:
        from fleetrl.services.inference.vllm_worker import fetch_checked, take_staged

        if update_info.engine_update is not None:
            if self.inner is None:
                raise ValueError(
                    "update_info names the engine group, but none was set up (init_weight_transfer_engine)"
                )
            self.inner.set_weight_update_target(self.model, self.model_config)
            try:
                info = engine_update_dict(self.inner.update_info_cls, update_info.engine_update)
                self.inner.receive_weights(self.inner.parse_update_info(info))
            except BaseException:
                # The group broke mid-version (a peer died, a damaged bucket): finish the layerwise reload so the
                # model is whole again (layers not reached keep their weights) and the stream fallback's own update
                # can start; it loads the version whole.
                self.finish_weight_update()
                raise
            return
        if update_info.load_id:
            tensors = take_staged(update_info.load_id, update_info.version)
        elif update_info.collective:
            tensors = self._receive_collective(update_info)
        elif update_info.address:
            served = str(self.model_config.dtype).removeprefix("torch.")
            tensors = fetch_checked(
                self.model_config.hf_config,
                served,
                self.model_config.model,
                update_info.address,
                update_info.version,
                auth_token=update_info.auth_token,
                timeout_s=update_info.timeout_s,
            )
        else:
            raise ValueError("update_info needs a load_id (a staged copy) or the weight stream's address")
        self.model.load_weights(iter(tensors))

    def _receive_collective(self, update_info: StreamUpdateInfo) -> list[tuple[str, Any]]:
        """Receive the version by broadcast now, checked as a staged load is (ValueError if not)."""
        from fleetrl.services.inference.vllm_worker import (
            STAGE_READY,
            _receive_collective_into,
            _Staged,
            expected_weight_spec,
        )

        served = str(self.model_config.dtype).removeprefix("torch.")
        spec = expected_weight_spec(self.model_config.hf_config, served, self.model_config.model)
        staged = _Staged(load_id="direct", version=update_info.version)
        rank = int(update_info.collective["rank_offset"]) + int(self.parallel_config.rank)
        device = str(next(self.model.parameters()).device)  # under NCCL the version arrives on the model's GPU
        _receive_collective_into(staged, {"collective": update_info.collective}, spec, rank, False, device)
        if staged.state != STAGE_READY:
            raise ValueError(f"weights version {update_info.version} by collective push: {staged.error}")
        return staged.tensors

    def shutdown(self) -> None:
        """The stream holds nothing between updates; an engine group set up at init is left."""
        self._shutdown_inner()

    def _shutdown_inner(self) -> None:
        if self.inner is not None:
            self.inner.shutdown()
            self.inner = None


class LocalEngineClient:
    """vLLM's ``VLLMWeightSyncClient`` for a fleetrl `VLLMEngine` in this process (tests, a colocated replica): each
    of the four calls runs the engine's method on the engine's event loop (`loop`) and waits up to `timeout_s`. The
    trainer's engine (fleetrl.weights.vllm_gloo) calls it from its own threads."""

    def __init__(self, engine: Any, loop: Any, engine_name: str = "fleetrl_gloo", timeout_s: float = 120.0) -> None:
        self.engine = engine
        self.loop = loop
        self.engine_name = engine_name
        self.timeout_s = timeout_s

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._run(self.engine.join_engine_group(self.engine_name, init_info, self.timeout_s))

    def start_weight_update(self) -> None:
        self._run(self.engine.start_engine_update())

    def update_weights(self, update_info: Any) -> None:
        self._run(self.engine.engine_update(int(update_info["version"]), update_info, self.timeout_s))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self.engine.finish_engine_update(int(weight_version or -1)))

    def abort_weight_update(self) -> None:
        self._run(self.engine.abort_engine_update())

    def _run(self, coroutine: Any) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(self.timeout_s + 5.0)


def register() -> None:
    """Register the backend in this process's factory through the public ``register_engine`` (idempotent), and
    fleetrl's gloo engine beside it (fleetrl.weights.vllm_gloo registers itself on import)."""
    import fleetrl.weights.vllm_gloo  # noqa: F401  (registers "fleetrl_gloo" in this process)

    with contextlib.suppress(ValueError):  # registered already
        WeightTransferEngineFactory.register_engine(BACKEND, StreamWeightTransferEngine)


register()
