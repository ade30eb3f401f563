"""Trainer checkpoints with torch.distributed.checkpoint (DCP), and resume.

A checkpoint is a folder `<checkpoint_dir>/step-<version>` holding:
- the DCP shards of the model and optimizer state (each rank writes its own shards, so FSDP2 runs
  save and load without gathering; a checkpoint can be loaded by a different world size),
- `trainer_state.json`: steps done, version, optimizer steps, published version, the data position
  the coordinator told us, the trained row ids (deduplication survives a restart), the LR scheduler
  state, the last steps' results (fleetrl.trainer.step_records),
- `rng-rank<r>.json`: each rank's RNG states (torch, cuda, python `random`),
- `manifest.json`, written last: every other file's size and SHA-256.

A LoRA run (`trainable_only=True`) saves only the parameters that train (the adapter) and their optimizer
state: the frozen base is the base model on disk, loaded again at resume.

A checkpoint is written into `step-<version>.partial` and becomes `step-<version>` by one rename once every rank
has written its files and rank 0 its manifest; then `<checkpoint_dir>/latest` is replaced atomically to name it.
A crash mid-save leaves a `.partial` folder (never loaded, removed by the next save) and the previous checkpoint as
latest.

A resume trusts nothing it has not checked (`resume_checkpoint`, in fleetrl.checkpoint_manifest, free of torch):
the checkpoint `latest` names is verified against its manifest (every file there, of its size and checksum); a
damaged one (a file truncated, zeroed or deleted, by a disk, a copy or a hand) is passed over for the newest whole
one before it, with the reason logged, and the controller's journal then aligns to that older version (its later
steps are trained again). With none whole, `CheckpointDamaged` names the damaged file: `fleetrl up --resume`
checks this before any service starts (exit 2).
JSON everywhere we choose the format (no pickle of our own state).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import random
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from fleetrl.checkpoint_manifest import (
    LATEST,
    MANIFEST,
    PARTIAL,
    STATE_FILE,
    CheckpointDamaged,
    ResumePoint,
    checkpoint_path,
    fsync_dir,
    latest_checkpoint,
    resume_checkpoint,
    verify_checkpoint,
    write_atomic,
    write_manifest,
)
from fleetrl.trainer.distributed import DistContext, barrier

__all__ = [  # the checkpoint's files (fleetrl.checkpoint_manifest), with the code that writes and loads them
    "LATEST",
    "MANIFEST",
    "STATE_FILE",
    "CheckpointDamaged",
    "ResumePoint",
    "TrainerState",
    "checkpoint_path",
    "latest_checkpoint",
    "load_checkpoint",
    "resume_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
    "write_manifest",
]

logger = logging.getLogger(__name__)


@dataclass
class TrainerState:
    """The trainer's progress, saved with every checkpoint."""

    steps_done: int = 0  # optimizer batches trained = the policy version
    optimizer_steps: int = 0  # inner-loop steps (num_minibatches per batch)
    published_version: int = -1
    data_position: Any = None  # opaque JSON from the coordinator (e.g. the dataset cursor)
    # The trained rows as `RowIdSet.to_json()` ({"floor", "ranges"}): bounded, not one entry per row of the run.
    trained_rows: dict[str, Any] = field(default_factory=dict)
    trained_row_ids: list[int] = field(default_factory=list)  # checkpoints written before trained_rows; read only
    scheduler: dict[str, Any] = field(default_factory=dict)
    base_model: str = ""
    # The newest steps' results (fleetrl.trainer.step_records), so a resumed trainer can give a controller that
    # never heard back about a step that step's metrics line and samples.
    step_records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def version(self) -> int:
        return self.steps_done


@contextlib.contextmanager
def _single_process_ok(ctx: DistContext) -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process; that is what we mean. Saving a
    version again (a Finish after a periodic save) overwrites it on purpose, which DCP also warns about."""
    with warnings.catch_warnings():
        if not ctx.enabled:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        yield


def _options(trainable_only: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # strict=False only with trainable_only: the frozen parameters are absent from the checkpoint on purpose.
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def _json_safe(obj: Any) -> Any:
    """The LR scheduler's state as JSON: numbers, strings, lists, dicts (callables dropped)."""
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items() if not callable(v)}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return None


def _encode_tensor(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _decode_byte_tensor(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": _encode_tensor(torch.get_rng_state()),
        "python": _json_safe(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_encode_tensor(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_decode_byte_tensor(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_decode_byte_tensor(s) for s in state["cuda"]])


def save_checkpoint(
    root: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: TrainerState,
    ctx: DistContext,
    trainable_only: bool = False,
) -> Path:
    """Write a checkpoint of `state.version`; every rank must call it. Returns its folder.

    The files go to `step-<version>.partial`; once all are written (each rank's shards and RNG, rank 0's state
    and manifest), one rename makes it `step-<version>` (replacing an earlier save of that version) and `latest`
    is pointed at it. `trainable_only`: leave out frozen parameters (a LoRA run's base model)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = checkpoint_path(root, state.version)
    partial = path.with_name(path.name + PARTIAL)
    if ctx.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f"step-*{PARTIAL}"):  # saves cut short (one save at a time: none is live)
            shutil.rmtree(stale, ignore_errors=True)
        partial.mkdir()
    barrier(ctx)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(trainable_only))
    with _single_process_ok(ctx):
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial))
    write_atomic(partial / f"rng-rank{ctx.rank}.json", json.dumps(rng_state()))
    barrier(ctx)  # every rank's files are written
    if ctx.is_main:
        state.scheduler = _json_safe(scheduler.state_dict())
        write_atomic(partial / STATE_FILE, json.dumps(asdict(state)))
        write_manifest(partial)
        _replace_folder(partial, path)
        write_atomic(Path(root) / LATEST, path.name + "\n")
        fsync_dir(Path(root))
        logger.info("checkpoint of version %d saved to %s", state.version, path)
    barrier(ctx)
    return path


def _replace_folder(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`; an existing `dst` (this version saved before) is moved aside first and removed
    after. A crash between the two renames leaves no `dst`: a resume then takes the checkpoint before it."""
    old = None
    if dst.exists():
        old = dst.with_name(dst.name + ".replaced")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dst, old)
    os.rename(src, dst)
    fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    ctx: DistContext,
    trainable_only: bool = False,
) -> TrainerState:
    """Restore model, optimizer, scheduler and this rank's RNG from `path`; return the state.

    `trainable_only`: the checkpoint holds only the trainable parameters (see `save_checkpoint`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    state_file = path / STATE_FILE
    if not state_file.exists():
        raise FileNotFoundError(f"not a trainer checkpoint (no {STATE_FILE}): {path}")
    data = json.loads(state_file.read_text())
    state = TrainerState(**data)
    options = _options(trainable_only)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    loaded = {"model": model_sd, "optim": optim_sd}
    with _single_process_ok(ctx):
        dcp.load(loaded, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"], options=options
    )
    scheduler.load_state_dict(state.scheduler)
    rng_file = path / f"rng-rank{ctx.rank}.json"
    if rng_file.exists():
        set_rng_state(json.loads(rng_file.read_text()))
    else:
        logger.warning("%s missing (saved with another world size?): RNG not restored", rng_file)
    logger.info("resumed from %s at version %d", path, state.version)
    return state
