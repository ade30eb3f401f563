"""vLLM worker extension: versioned in-place weight loads from the fleetrl weight stream.

`VLLMEngine` passes ``worker_extension_cls=WORKER_EXTENSION`` to vLLM, which mixes `WeightSwapExtension` into
its worker class in every worker process (one per tensor-parallel rank); the engine then calls the
``fleetrl_*`` methods below through ``AsyncLLM.collective_rpc``. Only a small handle (weight-stream address,
version, auth token) crosses the rpc: tensors do not travel well as rpc arguments, so each worker fetches the
bytes itself.

A load is three rpcs, so that the expensive part never blocks generation:
1. ``fleetrl_stage_weights(handle)`` starts a background thread in the worker and returns at once (rpcs run
   inside vLLM's engine-core loop, between two model steps, so a long rpc would stall generation). The thread
   opens the stream, checks the manifest (version, names, shapes, dtypes) against the model's expected state
   dict before any tensor byte moves, then receives every tensor into CPU memory, each verified against its
   checksum by the stream.
2. ``fleetrl_stage_status(load_id)`` is polled until every rank reports "ready" or one reports "failed".
3. ``fleetrl_apply_staged(load_id)``, called by the engine under ``pause_generation(mode="keep")``, loads the
   staged tensors in place with the worker's ``reload_weights`` (vLLM's layerwise reload: it re-runs each
   layer's post-load processing, which the CPU backend needs because it prepacks linear weights for
   oneDNN and drops the originals, so a plain ``model.load_weights`` would not reach the kernels).

One copy per replica: under tensor parallelism (more than one worker on this host), only the host's local rank 0
fetches. It writes each verified tensor into a file in shared memory (/dev/shm, ``FLEETRL_SHM_DIR``) as it
arrives, then an index (names, shapes, dtypes, offsets, checksum) that tells the other ranks the copy is complete;
every rank, rank 0 included, maps that file and loads its shards from the mapping. The host then holds the version
once (page cache shared by the mappings) instead of once per rank, and the weight stream serves it once per replica.
Rank 0 unlinks the files when its copy is applied or discarded (the mappings stay valid until dropped). A handle with
``"shared": False`` (or a one-worker replica) keeps a private copy per rank, as before.

Everything that can reject a load runs in step 1, before the model is touched, so a rejected load leaves the
previous version serving. ``fleetrl_discard_staged`` drops a staged copy that will not be applied.

The expected state dict is the one ``AutoModelForCausalLM`` has for the served config (names as the trainer's
``model.state_dict()`` gives them, built on the meta device so nothing is allocated), every floating tensor in
the served dtype; tied aliases (``lm_head.weight`` of a tied model) may be missing and are never loaded twice.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Named through vllm_transfer, which re-exports it: importing that module in each worker process (vLLM does, to find
# the extension, before the worker loads the model) registers the "fleetrl_zmq" weight-transfer backend there.
WORKER_EXTENSION = "fleetrl.services.inference.vllm_transfer.WeightSwapExtension"

# The load staged in this worker process (one worker per process): filled by the extension's rpcs, taken by the
# weight-transfer backend (services/inference/vllm_transfer.py) when vLLM's update_weights applies it.
_STAGING: dict[str, _Staged] = {}

STAGE_FETCHING = "fetching"
STAGE_READY = "ready"
STAGE_FAILED = "failed"

SHM_DIR_ENV = "FLEETRL_SHM_DIR"  # where shared staged copies go (default /dev/shm)
_ALIGN = 64  # each tensor's offset in the shared file: any element size divides it
_READER_LIMIT_S = 3600.0  # a rank waiting for rank 0's copy gives up after this (the engine discards sooner)
_READER_POLL_S = 0.02


def shared_paths(load_id: str) -> tuple[Path, Path]:
    """The shared copy of `load_id`: its data file and its index (written last: the copy is complete)."""
    base = Path(os.environ.get(SHM_DIR_ENV) or "/dev/shm") / f"fleetrl-weights-{load_id}"
    return base.with_suffix(".bin"), base.with_suffix(".json")


@dataclass(frozen=True)
class WeightSpec:
    """What a load must contain: name -> (shape, dtype name), and names that may be left out."""

    tensors: dict[str, tuple[tuple[int, ...], str]]
    optional: frozenset[str] = frozenset()  # tied aliases: accepted, never loaded twice


def spec_from_state_dict(state_dict: dict[str, Any], served_dtype: str) -> WeightSpec:
    """The spec of a (possibly meta) state dict, floating tensors in `served_dtype` (e.g. "float32").

    Tensors sharing storage with an earlier one (tied embeddings) become optional aliases.
    """
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    seen: dict[tuple[int, int], str] = {}
    optional = set()
    for name, tensor in state_dict.items():
        dtype = served_dtype if tensor.is_floating_point() else str(tensor.dtype).removeprefix("torch.")
        tensors[name] = (tuple(tensor.shape), dtype)
        # Meta tensors have no storage to compare; tied weights are the same Parameter object.
        key = (id(tensor), 0) if tensor.is_meta else (tensor.untyped_storage().data_ptr(), 1)
        if seen.setdefault(key, name) != name:
            optional.add(name)
    return WeightSpec(tensors, frozenset(optional))


def expected_weight_spec(hf_config: Any, served_dtype: str, model_dir: str | None = None) -> WeightSpec:
    """The state dict a trainer's ``AutoModelForCausalLM`` publishes for `hf_config`.

    Built on the meta device (no memory). If transformers cannot build the architecture, falls back to the
    tensor names and shapes in the checkpoint's safetensors headers under `model_dir`.
    """
    import torch

    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        # keep_vars: tied names map to the same Parameter object, which is how meta aliases show.
        return spec_from_state_dict(model.state_dict(keep_vars=True), served_dtype)
    except (ValueError, KeyError, TypeError, ImportError, RuntimeError) as exc:
        if model_dir is None or not Path(model_dir).is_dir():
            raise RuntimeError(
                f"cannot determine the model's expected weights: transformers cannot build "
                f"{type(hf_config).__name__} ({exc}) and there is no local checkpoint to read"
            ) from exc
        logger.warning("building the weight spec from checkpoint headers: %s", exc)
        return _spec_from_checkpoint(Path(model_dir), served_dtype)


def _spec_from_checkpoint(model_dir: Path, served_dtype: str) -> WeightSpec:
    from safetensors import safe_open

    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise RuntimeError(f"no *.safetensors checkpoint in {model_dir} to build the weight spec from")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open objects are not iterable)
                piece = f.get_slice(name)
                dtype = piece.get_dtype()
                is_float = dtype.startswith(("F", "BF"))
                tensors[name] = (tuple(piece.get_shape()), served_dtype if is_float else dtype)
    return WeightSpec(tensors)


def check_manifest(manifest: Any, version: int, spec: WeightSpec) -> None:
    """Reject (WeightLoadError naming the problem) a manifest that is not `version` or does not match `spec`."""
    from fleetrl.services.inference.engine import WeightLoadError, check_state_dict_matches

    if manifest.version != version:
        raise WeightLoadError(f"asked for weights version {version}, the stream sent {manifest.version}")
    if manifest.is_adapter:  # the engine loads adapters itself when LoRA is on, so LoRA is off here
        raise WeightLoadError(
            f"weights version {version} is a LoRA adapter but this replica serves full weights only; start it "
            "with --max-lora-rank R (R >= the adapter's rank) to serve adapters"
        )
    check_state_dict_matches(spec.tensors, {entry.name: entry for entry in manifest.tensors}, optional=spec.optional)


@dataclass(eq=False)
class _Staged:
    load_id: str
    version: int
    state: str = STAGE_FETCHING
    error: str = ""
    checksum: str = ""
    nbytes: int = 0
    transfer_s: float = 0.0
    tensors: list[tuple[str, Any]] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    owned_files: tuple[Path, ...] = ()  # the shared copy's files, when this rank wrote them

    def release(self) -> None:
        """Drop this rank's tensors and, where it wrote the shared copy, its files (mappings stay valid)."""
        self.tensors = []
        for path in self.owned_files:
            path.unlink(missing_ok=True)

    def status(self) -> dict[str, Any]:
        return {
            "load_id": self.load_id,
            "version": self.version,
            "state": self.state,
            "error": self.error,
            "checksum": self.checksum,
            "nbytes": self.nbytes,
            "transfer_s": self.transfer_s,
        }


def _fetch_into(staged: _Staged, handle: dict[str, Any], spec: WeightSpec) -> None:
    """Fetch, verify and validate one version into CPU memory (runs in a background thread)."""
    from fleetrl.services.inference.engine import WeightLoadError
    from fleetrl.weights import WeightTransferError, iter_weights

    start = time.perf_counter()
    try:
        with iter_weights(
            handle["address"],
            staged.version,
            timeout_s=float(handle.get("timeout_s", 120.0)),
            auth_token=handle.get("auth_token"),
            verify=True,
            budget_floor_s=float(handle.get("timeout_s", 120.0)),  # the whole fetch: + its bytes at a low rate
        ) as stream:
            # Reject a mismatched version before a single tensor byte moves.
            check_manifest(stream.manifest, staged.version, spec)
            staged.nbytes = stream.manifest.total_bytes  # the engine sizes its wait for the load from it
            tensors = []
            for name, tensor in stream:
                if staged.cancelled.is_set():
                    raise WeightLoadError("the load was cancelled")
                if name not in spec.optional:
                    tensors.append((name, tensor))
            manifest = stream.manifest
    except (WeightTransferError, WeightLoadError, ValueError) as exc:
        staged.error, staged.state = str(exc), STAGE_FAILED
        return
    except Exception as exc:  # a background thread must report every failure, not die silently
        logger.exception("staging weights version %d failed", staged.version)
        staged.error, staged.state = f"unexpected error while fetching: {exc!r}", STAGE_FAILED
        return
    staged.tensors = tensors
    staged.checksum = manifest.checksum
    staged.nbytes = manifest.total_bytes
    staged.transfer_s = time.perf_counter() - start
    staged.state = STAGE_READY


def _fetch_shared_into(staged: _Staged, handle: dict[str, Any], spec: WeightSpec) -> None:
    """Local rank 0 of a tensor-parallel replica: fetch, verify and validate one version into a shared-memory file
    the other ranks map (runs in a background thread), then map it too."""
    import torch

    from fleetrl.services.inference.engine import WeightLoadError
    from fleetrl.weights import WeightTransferError, iter_weights

    start = time.perf_counter()
    data_path, index_path = shared_paths(staged.load_id)
    partial = index_path.with_suffix(".json.partial")
    staged.owned_files = (index_path, partial, data_path)
    try:
        with iter_weights(
            handle["address"],
            staged.version,
            timeout_s=float(handle.get("timeout_s", 120.0)),
            auth_token=handle.get("auth_token"),
            verify=True,
            budget_floor_s=float(handle.get("timeout_s", 120.0)),
        ) as stream:
            check_manifest(stream.manifest, staged.version, spec)
            manifest = stream.manifest
            staged.nbytes = manifest.total_bytes
            # Every tensor's place in the file, from the manifest; the file is written through a shared mapping, so
            # its pages are this rank's mapping (and then every rank's) from the start, never a second copy.
            offsets, size = {}, 0
            for entry in manifest.tensors:
                if entry.name not in spec.optional:
                    offsets[entry.name] = size
                    size += -(-entry.nbytes // _ALIGN) * _ALIGN
            with open(data_path, "wb") as out:
                try:  # reserve the pages now: a full tmpfs is ENOSPC here, not SIGBUS on a write through the map
                    os.posix_fallocate(out.fileno(), 0, size)
                except OSError as exc:
                    data_path.unlink(missing_ok=True)
                    _write_index(partial, index_path, {"version": staged.version, "private": str(exc)})
                    logger.warning(
                        "no room for a shared copy of weights version %d (%d bytes) in %s (%s): every rank fetches "
                        "its own; give the replica more shared memory (docker --shm-size) or set %s",
                        staged.version,
                        size,
                        data_path.parent,
                        exc,
                        SHM_DIR_ENV,
                    )
                    staged.owned_files = (index_path,)
                    raise _PrivateCopy from exc
            flat = torch.from_file(str(data_path), shared=True, size=size, dtype=torch.uint8) if size else None
            entries = []
            for name, tensor in stream:
                if staged.cancelled.is_set():
                    raise WeightLoadError("the load was cancelled")
                if name in spec.optional:
                    continue
                raw = tensor.contiguous().reshape(-1).view(torch.uint8)
                offset = offsets[name]
                flat[offset : offset + raw.numel()].copy_(raw)
                dtype = str(tensor.dtype).removeprefix("torch.")
                entries.append({"name": name, "shape": list(tensor.shape), "dtype": dtype, "offset": offset})
            del flat
        index = {"version": staged.version, "checksum": manifest.checksum, "nbytes": manifest.total_bytes}
        index.update(size=size, tensors=entries)
        _write_index(partial, index_path, index)
        staged.tensors = _map_shared(data_path, index)
    except _PrivateCopy:
        _fetch_into(staged, handle, spec)
        return
    except (WeightTransferError, WeightLoadError, ValueError, OSError) as exc:
        staged.release()
        staged.error, staged.state = str(exc), STAGE_FAILED
        return
    except Exception as exc:  # a background thread must report every failure, not die silently
        logger.exception("staging weights version %d failed", staged.version)
        staged.release()
        staged.error, staged.state = f"unexpected error while fetching: {exc!r}", STAGE_FAILED
        return
    staged.checksum = manifest.checksum
    staged.transfer_s = time.perf_counter() - start
    staged.state = STAGE_READY


def _receive_collective_into(
    staged: _Staged, handle: dict[str, Any], spec: WeightSpec, rank: int, shared: bool, device: str = "cpu"
) -> None:
    """One receiving worker of a collective push (``weight_transport = "collective"``, weights/collective.py):
    build the trainer's group as `rank`, receive the version's buckets and verify every tensor (runs in a
    background thread, like a fetch). With `shared` (local rank 0 of a tensor-parallel replica) the buffer is the
    replica's shared-memory copy, which the other ranks map as they would a fetched one. A version that does not
    match the model is still received (the group's broadcast needs every member) and then reported failed.
    `device` is the worker's: under NCCL its buffer is there (``receive_device``) and the tensors it loads are views
    of it; under gloo host memory."""
    import torch

    from fleetrl.services.inference.engine import WeightLoadError
    from fleetrl.weights import WeightTransferError
    from fleetrl.weights.collective import GroupOffer, receive_into
    from fleetrl.weights.collective_plan import flat_layout, receive_device
    from fleetrl.weights.manifest import decode_manifest

    start = time.perf_counter()
    group = handle["collective"]
    offer = GroupOffer.from_json(group, decode_manifest(group["manifest"].encode()))
    manifest = offer.manifest
    staged.nbytes = manifest.total_bytes
    offsets, size = flat_layout([t.nbytes for t in manifest.tensors])
    data_path, index_path = shared_paths(staged.load_id)
    partial = index_path.with_suffix(".json.partial")
    try:
        mismatch = ""
        try:
            check_manifest(manifest, staged.version, spec)
        except (WeightLoadError, ValueError) as exc:
            mismatch = str(exc)
        if shared and offer.backend != "gloo":
            raise ValueError(f"a shared staged copy lives in host memory; the group broadcasts over {offer.backend}")
        if shared:
            staged.owned_files = (index_path, partial, data_path)
            with open(data_path, "wb") as out:
                os.posix_fallocate(out.fileno(), 0, size)
            flat = torch.from_file(str(data_path), shared=True, size=size, dtype=torch.uint8)
        else:
            flat = torch.empty(size, dtype=torch.uint8, device=receive_device(offer.backend, device))
        tensors = receive_into(offer, rank, int(group["world_size"]), flat, skip=spec.optional)
        if mismatch:
            raise WeightLoadError(mismatch)
        if shared:
            entries = [
                {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "offset": offset}
                for t, offset in zip(manifest.tensors, offsets, strict=True)
                if t.name not in spec.optional
            ]
            index = {"version": staged.version, "checksum": manifest.checksum, "nbytes": manifest.total_bytes}
            index.update(size=size, tensors=entries)
            del flat, tensors
            _write_index(partial, index_path, index)
            staged.tensors = _map_shared(data_path, index)
        else:
            staged.tensors = list(tensors.items())
    except (WeightTransferError, WeightLoadError, ValueError, OSError) as exc:
        staged.release()
        if shared:  # the other ranks stop waiting for a copy that will not come
            _write_index(partial, index_path, {"version": staged.version, "failed": str(exc)})
            staged.owned_files = (index_path,)
        staged.error, staged.state = str(exc), STAGE_FAILED
        return
    except Exception as exc:  # a background thread must report every failure, not die silently
        logger.exception("receiving weights version %d by collective push failed", staged.version)
        staged.release()
        staged.error, staged.state = f"unexpected error in the collective push: {exc!r}", STAGE_FAILED
        return
    staged.checksum = manifest.checksum
    staged.transfer_s = time.perf_counter() - start
    staged.state = STAGE_READY


class _PrivateCopy(Exception):
    """No room for the shared copy: every rank fetches its own."""


def _write_index(partial: Path, index_path: Path, index: dict[str, Any]) -> None:
    partial.write_text(json.dumps(index))
    partial.rename(index_path)  # the other ranks see a complete index or none


def _map_shared_from_rank0(staged: _Staged, handle: dict[str, Any], spec: WeightSpec) -> None:
    """Another rank of a tensor-parallel replica: wait for local rank 0's shared copy of the load and map it
    (runs in a background thread). Stops when the load is discarded (rank 0 failed or the engine gave up). Where rank
    0 found no room for the copy, the index says so and this rank fetches its own."""
    data_path, index_path = shared_paths(staged.load_id)
    start = time.perf_counter()
    try:
        while not index_path.exists():
            if staged.cancelled.is_set():
                raise RuntimeError("the load was cancelled")
            if time.perf_counter() - start > _READER_LIMIT_S:
                raise RuntimeError(f"rank 0's copy did not appear at {index_path} in {_READER_LIMIT_S:.0f} s")
            time.sleep(_READER_POLL_S)
        index = json.loads(index_path.read_text())
        if "failed" in index:
            raise RuntimeError(f"rank 0 could not receive the version: {index['failed']}")
        if "private" in index:
            _fetch_into(staged, handle, spec)
            return
        if index["version"] != staged.version:
            raise RuntimeError(f"the shared copy at {index_path} is version {index['version']}, not {staged.version}")
        staged.tensors = _map_shared(data_path, index)
    except Exception as exc:  # reported to the engine as a failed stage
        staged.error, staged.state = f"mapping the replica's shared copy failed: {exc}", STAGE_FAILED
        return
    staged.checksum = index["checksum"]
    staged.nbytes = int(index["nbytes"])
    staged.transfer_s = time.perf_counter() - start
    staged.state = STAGE_READY


def _map_shared(data_path: Path, index: dict[str, Any]) -> list[tuple[str, Any]]:
    """Tensors viewing the shared copy (a private, copy-on-write mapping: reading shares the pages)."""
    import torch

    size = int(index["size"])
    if size == 0:
        return []
    flat = torch.from_file(str(data_path), shared=False, size=size, dtype=torch.uint8)
    tensors = []
    for e in index["tensors"]:
        dtype = getattr(torch, e["dtype"])
        count = 1
        for dim in e["shape"]:
            count *= dim
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        piece = flat[e["offset"] : e["offset"] + nbytes].view(dtype).view(e["shape"])
        tensors.append((e["name"], piece))
    return tensors


def fetch_checked(
    hf_config: Any,
    served_dtype: str,
    model_dir: str,
    address: str,
    version: int,
    *,
    auth_token: str | None,
    timeout_s: float,
) -> list[tuple[str, Any]]:
    """Fetch `version` from the weight stream at `address` now, checked as a staged load is (ValueError if not)."""
    staged = _Staged(load_id="direct", version=version)
    spec = expected_weight_spec(hf_config, served_dtype, model_dir)
    _fetch_into(staged, {"address": address, "auth_token": auth_token, "timeout_s": timeout_s}, spec)
    if staged.state != STAGE_READY:
        raise ValueError(f"weights version {version} from {address}: {staged.error}")
    return staged.tensors


def take_staged(load_id: str, version: int) -> list[tuple[str, Any]]:
    """The staged tensors of `load_id` (fetched, verified and checked against the model), removed from the staging
    area; ValueError when that load is not staged and ready (nothing is touched then)."""
    staged = _STAGING.get("current")
    if staged is None or staged.load_id != load_id:
        raise ValueError(f"weights load {load_id} is not staged in this worker")
    if staged.state != STAGE_READY or staged.version != version:
        raise ValueError(f"staged load {load_id} is {staged.state} (version {staged.version}), not version {version}")
    _STAGING.pop("current", None)
    tensors = staged.tensors
    staged.release()  # the files go; the mapping lives as long as `tensors`
    return tensors


class WeightSwapExtension:
    """Mixed into vLLM's worker class (``self`` is the worker: ``self.model_config``, ``reload_weights``).

    Every method returns plain dicts (they cross vLLM's rpc); errors are reported in them, not raised, so the
    engine gets a clear message from each rank. Method names start with ``fleetrl_`` because vLLM refuses an
    extension whose attributes collide with the worker's.
    """

    def fleetrl_weight_spec(self) -> dict[str, Any]:
        """The expected weights (name -> [shape, dtype]) and the optional aliases, cached per worker."""
        spec = self._fleetrl_get_spec()
        return {
            "tensors": {k: [list(s), d] for k, (s, d) in spec.tensors.items()},
            "optional": sorted(spec.optional),
        }

    def _fleetrl_get_spec(self) -> WeightSpec:
        spec = getattr(self, "_fleetrl_spec", None)
        if spec is None:
            model_config = self.model_config  # type: ignore[attr-defined]
            served = str(model_config.dtype).removeprefix("torch.")
            spec = expected_weight_spec(model_config.hf_config, served, model_config.model)
            self._fleetrl_spec = spec
        return spec

    def fleetrl_stage_weights(self, handle: dict[str, Any]) -> dict[str, Any]:
        """Start fetching ``handle["version"]`` from ``handle["address"]`` in the background; return at once.

        handle: {"load_id", "address", "version", "auth_token" (or None), "timeout_s"}. A previous staged
        copy that was never applied is dropped.
        """
        self.fleetrl_discard_staged(None)
        staged = _Staged(load_id=str(handle["load_id"]), version=int(handle["version"]))
        try:
            spec = self._fleetrl_get_spec()
        except Exception as exc:  # reported to the engine as a failed stage
            staged.error, staged.state = str(exc), STAGE_FAILED
            _STAGING["current"] = staged
            return staged.status()
        _STAGING["current"] = staged
        target, args = _fetch_into, (staged, dict(handle), spec)
        shared = handle.get("shared", False) and self._fleetrl_ranks_here() > 1
        rank0 = self.local_rank == 0  # type: ignore[attr-defined]
        if shared:
            target = _fetch_shared_into if rank0 else _map_shared_from_rank0
        if handle.get("collective") and (rank0 or not shared):
            # Collective push: local rank 0 alone receives a shared copy; without one, every worker receives its own.
            within = 0 if shared else int(self.local_rank)  # type: ignore[attr-defined]
            rank = int(handle["collective"]["rank_offset"]) + within
            device = str(getattr(self, "device", "cpu"))  # the worker's device (vLLM's workers set it)
            target, args = _receive_collective_into, (staged, dict(handle), spec, rank, shared, device)
        threading.Thread(
            target=target,
            args=args,
            name=f"fleetrl-stage-v{staged.version}",
            daemon=True,
        ).start()
        return staged.status()

    def _fleetrl_ranks_here(self) -> int:
        """How many workers of this replica run on this host (they share one staged copy)."""
        parallel = self.parallel_config  # type: ignore[attr-defined]
        per_node = getattr(parallel, "local_world_size", None) or parallel.world_size
        return int(per_node)

    def fleetrl_stage_status(self, load_id: str) -> dict[str, Any]:
        staged = _STAGING.get("current")
        if staged is None or staged.load_id != load_id:
            return {"load_id": load_id, "state": STAGE_FAILED, "error": "no such staged load"}
        return staged.status()

    def fleetrl_apply_staged(self, load_id: str) -> dict[str, Any]:
        """Load the staged tensors in place (the engine has paused generation). Drops the staged copy."""
        staged = _STAGING.get("current")
        if staged is None or staged.load_id != load_id or staged.state != STAGE_READY:
            state = "missing" if staged is None or staged.load_id != load_id else staged.state
            return {"ok": False, "touched": False, "error": f"staged load {load_id} is {state}"}
        _STAGING.pop("current", None)
        for path in staged.owned_files:  # the files go; the mapping lives as long as staged.tensors
            path.unlink(missing_ok=True)
        start = time.perf_counter()
        try:
            # The worker's in-place reload (layerwise: re-runs post-load processing such as CPU prepacking).
            self.reload_weights(  # type: ignore[attr-defined]
                weights_iterator=iter(staged.tensors), is_checkpoint_format=True
            )
        except Exception as exc:  # validated beforehand, so this is a bug; the model may be half-updated
            logger.exception("in-place load of weights version %d failed", staged.version)
            return {"ok": False, "touched": True, "error": f"in-place load failed: {exc!r}"}
        finally:
            staged.tensors = []
        return {
            "ok": True,
            "version": staged.version,
            "checksum": staged.checksum,
            "apply_s": time.perf_counter() - start,
        }

    def fleetrl_discard_staged(self, load_id: str | None) -> bool:
        """Drop the staged copy (``load_id`` None: whatever is staged). True if something was dropped."""
        staged = _STAGING.get("current")
        if staged is None or (load_id is not None and staged.load_id != load_id):
            return False
        staged.cancelled.set()
        staged.release()
        _STAGING.pop("current", None)
        return True
