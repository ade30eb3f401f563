"""Weight-stream manifests: what a published state dict holds, how it is checksummed and chunked.

Pure logic shared by both ends of the weight stream (no sockets, no zmq). A manifest names each
tensor with its dtype, shape, byte length and an xxh3_64 checksum of its raw bytes, plus an overall
checksum over those entries. It travels as canonical JSON (never pickle); tensor bytes travel raw,
so any dtype whose bytes can be viewed as uint8 works, bfloat16 and float8 included.

The overall checksum covers the tensor entries (names, dtypes, shapes, byte lengths, per-tensor
checksums) but not the version number, so it identifies the weights themselves: the same state
dict published as two versions has the same checksum.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from fleetrl.weights.errors import WeightTransferError

MANIFEST_FORMAT = "fleetrl.weights.manifest/1"
CHECKSUM_ALGORITHM = "xxh3_64"

# Dtypes whose storage is plain bytes in a fixed element size. Complex and quantized dtypes are
# left out on purpose: their tensors carry extra state (conj bits, scales) that raw bytes lose.
_DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
)
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) is not dtype:
        raise ValueError(f"dtype {dtype} cannot travel on the weight stream; supported: {', '.join(DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a manifest dtype name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} in weight manifest; supported: {', '.join(DTYPES)}") from None


def checksum_bytes(data: Any) -> str:
    """xxh3_64 of a bytes-like object, as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


def new_hasher() -> xxhash.xxh3_64:
    """An incremental hasher whose ``hexdigest()`` equals ``checksum_bytes`` of all updates."""
    return xxhash.xxh3_64()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor as a flat uint8 memoryview, without copying."""
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor_bytes needs a CPU tensor, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous tensor")
    # reshape(-1) turns a 0-dim tensor into one element so that view(uint8) is allowed.
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def tensor_checksum(tensor: torch.Tensor) -> str:
    """The manifest checksum of a tensor's raw bytes (copied to contiguous CPU first if needed)."""
    cpu = tensor.detach().to("cpu").contiguous()
    return checksum_bytes(tensor_bytes(cpu))


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a manifest: its name, dtype name, shape, byte length and checksum."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tensor name must be a non-empty string, got {self.name!r}")
        dtype = torch_dtype(self.dtype)
        if not isinstance(self.shape, tuple) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in self.shape
        ):
            raise ValueError(f"tensor {self.name!r}: shape must be a tuple of non-negative ints, got {self.shape!r}")
        expected = math.prod(self.shape) * dtype.itemsize
        if self.nbytes != expected:
            raise ValueError(
                f"tensor {self.name!r}: nbytes {self.nbytes} does not match shape {self.shape} "
                f"of {self.dtype} ({expected} bytes)"
            )
        if not isinstance(self.checksum, str) or not self.checksum:
            raise ValueError(f"tensor {self.name!r}: checksum must be a non-empty string")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "checksum": self.checksum,
        }


def content_checksum(tensors: tuple[TensorSpec, ...], adapter: Mapping[str, Any] | None = None) -> str:
    """The overall checksum of a manifest: xxh3_64 over the canonical JSON of its entries.

    A LoRA manifest's adapter config is covered too (the same tensors under another rank or alpha
    are other weights); a full-model manifest's checksum is unchanged by the field's existence.
    """
    entries: Any = [spec.to_json() for spec in tensors]
    if adapter is not None:
        entries = {"tensors": entries, "adapter": adapter}
    canonical = json.dumps(entries, sort_keys=True, separators=(",", ":"))
    return checksum_bytes(canonical.encode())


@dataclass(frozen=True)
class Manifest:
    """A published weight version: its tensors in publish order and their overall checksum.

    ``adapter`` is None for a full model. For a LoRA run it is the PEFT adapter config (the JSON of
    ``adapter_config.json``: ``r``, ``lora_alpha``, ``target_modules``, ...) and the tensors are the
    adapter's only, named as PEFT saves them (``get_peft_model_state_dict``).
    """

    version: int
    tensors: tuple[TensorSpec, ...]
    checksum: str
    adapter: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 0:
            raise ValueError(f"weight version must be a non-negative int, got {self.version!r}")
        if not isinstance(self.tensors, tuple) or not all(isinstance(spec, TensorSpec) for spec in self.tensors):
            raise ValueError("Manifest.tensors must be a tuple of TensorSpec")
        seen: set[str] = set()
        for spec in self.tensors:
            if spec.name in seen:
                raise ValueError(f"tensor name {spec.name!r} appears twice in the manifest")
            seen.add(spec.name)
        if self.adapter is not None:
            if not isinstance(self.adapter, Mapping):
                raise ValueError(f"Manifest.adapter must be a JSON object or None, got {type(self.adapter).__name__}")
            try:
                json.dumps(self.adapter)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"Manifest.adapter is not JSON-serialisable: {exc}") from None
        expected = content_checksum(self.tensors, self.adapter)
        if self.checksum != expected:
            raise ValueError(f"manifest checksum {self.checksum!r} does not match its tensor entries ({expected!r})")

    @classmethod
    def build(cls, version: int, tensors: tuple[TensorSpec, ...], adapter: Mapping[str, Any] | None = None) -> Manifest:
        """A manifest for these entries (and LoRA adapter config, if any) with its checksum computed."""
        adapter = dict(adapter) if adapter is not None else None
        return cls(
            version=version, tensors=tuple(tensors), checksum=content_checksum(tensors, adapter), adapter=adapter
        )

    @property
    def is_adapter(self) -> bool:
        """True when this version is a LoRA adapter (to apply on the base weights), not a full model."""
        return self.adapter is not None

    @property
    def total_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.tensors)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.tensors)

    def spec(self, name: str) -> TensorSpec:
        """The entry for ``name``; KeyError naming the tensor if the manifest lacks it."""
        for spec in self.tensors:
            if spec.name == name:
                return spec
        raise KeyError(f"tensor {name!r} is not in weight manifest version {self.version}")


def spec_for_tensor(name: str, tensor: torch.Tensor) -> TensorSpec:
    """The manifest entry of one contiguous CPU tensor."""
    if not isinstance(name, str):
        raise TypeError(f"state dict keys must be strings, got {type(name).__name__}: {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"state dict entry {name!r} is a {type(tensor).__name__}, not a tensor")
    if tensor.layout != torch.strided:
        raise ValueError(f"tensor {name!r} has layout {tensor.layout}; only dense tensors travel")
    try:
        dtype = dtype_name(tensor.dtype)
    except ValueError as exc:
        raise ValueError(f"tensor {name!r}: {exc}") from None
    return TensorSpec(
        name=name,
        dtype=dtype,
        shape=tuple(tensor.shape),
        nbytes=tensor.numel() * tensor.element_size(),
        checksum=tensor_checksum(tensor),
    )


def build_manifest(
    version: int, state_dict: Mapping[str, torch.Tensor], adapter: Mapping[str, Any] | None = None
) -> Manifest:
    """The manifest of a state dict (any device; copies to contiguous CPU only where needed)."""
    specs = tuple(spec_for_tensor(name, tensor) for name, tensor in state_dict.items())
    return Manifest.build(version, specs, adapter)


def encode_manifest(manifest: Manifest) -> bytes:
    """The wire form of a manifest: UTF-8 JSON."""
    obj: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "version": manifest.version,
        "tensors": [spec.to_json() for spec in manifest.tensors],
        "checksum": manifest.checksum,
    }
    if manifest.adapter is not None:
        obj["adapter"] = manifest.adapter
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_manifest(data: bytes) -> Manifest:
    """Parse and check a wire manifest; WeightTransferError naming the problem if it is bad."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightTransferError(f"weight manifest is not valid JSON: {exc}", reason="protocol") from exc
    if not isinstance(obj, dict):
        raise WeightTransferError("weight manifest is not a JSON object", reason="protocol")
    if obj.get("format") != MANIFEST_FORMAT:
        raise WeightTransferError(
            f"weight manifest format {obj.get('format')!r} is not {MANIFEST_FORMAT!r}",
            reason="protocol",
        )
    if obj.get("checksum_algorithm") != CHECKSUM_ALGORITHM:
        raise WeightTransferError(
            f"weight manifest checksum algorithm {obj.get('checksum_algorithm')!r} is not {CHECKSUM_ALGORITHM!r}",
            reason="protocol",
        )
    try:
        entries = obj["tensors"]
        if not isinstance(entries, list):
            raise TypeError("'tensors' is not a list")
        tensors = tuple(
            TensorSpec(
                name=entry["name"],
                dtype=entry["dtype"],
                shape=tuple(entry["shape"]),
                nbytes=entry["nbytes"],
                checksum=entry["checksum"],
            )
            for entry in entries
        )
        adapter = obj.get("adapter")
        if adapter is not None and not isinstance(adapter, dict):
            raise TypeError("'adapter' is not a JSON object")
        return Manifest(version=obj["version"], tensors=tensors, checksum=obj["checksum"], adapter=adapter)
    except (KeyError, TypeError, ValueError) as exc:
        raise WeightTransferError(f"bad weight manifest: {exc}", reason="protocol") from exc


@dataclass(frozen=True)
class Chunk:
    """One wire chunk: bytes ``[start, stop)`` of tensor number ``tensor_index``."""

    index: int
    tensor_index: int
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def plan_chunks(manifest: Manifest, chunk_bytes: int, *, split_bytes: int | None = None) -> tuple[Chunk, ...]:
    """The chunks a receiver asks for, in manifest order.

    A tensor of at most ``chunk_bytes`` (the largest message the publisher sends) travels as one
    chunk, which the receiver keeps as the tensor's memory without copying; a larger tensor is
    split into pieces of ``split_bytes`` (default ``chunk_bytes``) received into a preallocated
    tensor. A chunk never spans two tensors, so each tensor can be handed out as soon as its last
    chunk arrives; empty tensors have no chunks.
    """
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    split = chunk_bytes if split_bytes is None else split_bytes
    if not isinstance(split, int) or not 0 < split <= chunk_bytes:
        raise ValueError(f"split_bytes must be in [1, chunk_bytes={chunk_bytes}], got {split!r}")
    chunks: list[Chunk] = []
    for tensor_index, spec in enumerate(manifest.tensors):
        step = chunk_bytes if spec.nbytes <= chunk_bytes else split
        for start in range(0, spec.nbytes, step):
            stop = min(start + step, spec.nbytes)
            chunks.append(Chunk(len(chunks), tensor_index, start, stop))
    return tuple(chunks)
