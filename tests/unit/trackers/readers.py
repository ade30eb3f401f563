"""Read back what each tracker wrote, with the backend's own reader where it has one: TensorBoard's
EventAccumulator, MLflow's client, and W&B's offline run file (`run-<id>.wandb`, records of wandb's protobuf
`Record` in a LevelDB-style log: 32 KiB blocks of checksummed chunks after a 7-byte header)."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_HEADER = 7  # the file's ":W&B" magic and version; each chunk's crc32c (4), length (2) and kind (1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> Iterator[Any]:
    """Every `wandb_internal_pb2.Record` of an offline run file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # a block's tail too short for a chunk header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if pos + _HEADER + length > len(data):  # a chunk still being written
            return
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0:  # zero padding to the end of the block
            pos += (_BLOCK - pos % _BLOCK) % _BLOCK
            continue
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


@dataclass
class WandbRun:
    run_id: str = ""
    project: str = ""
    name: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)


def read_wandb_run(path: Path, timeout_s: float = 60.0) -> WandbRun:
    """The run, config updates and history rows (`a/b` keys as logged, JSON values decoded) of an offline run,
    once its file is complete: wandb's writer process may still be flushing it after `finish()` returns, so this
    waits (up to `timeout_s`) for the run's exit record."""
    deadline = time.monotonic() + timeout_s
    records = list(wandb_records(path))
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s} s"
        time.sleep(0.1)
        records = list(wandb_records(path))
    run = WandbRun()
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.project = record.run.run_id, record.run.project
            run.name, run.tags = record.run.display_name, list(record.run.tags)
            run.config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            run.config.update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            run.history.append(
                {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
            )
    return run


def wandb_run_files(wandb_dir: Path) -> list[Path]:
    """The offline run files under a WANDB_DIR (or a log folder); a resumed run adds one with the same run id."""
    return sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))


def wandb_table(run_file: Path, history_row: dict[str, Any], key: str = "samples") -> dict[str, Any]:
    """The W&B table a history row logged under `key` (its JSON file beside the run file)."""
    return json.loads((run_file.parent / "files" / history_row[f"{key}/path"]).read_text())


def tensorboard_events(log_dir: Path) -> Any:
    """An EventAccumulator loaded with every event file in `log_dir` (scalars and text)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def tensorboard_scalars(accumulator: Any, tag: str) -> dict[int, float]:
    return {event.step: event.value for event in accumulator.Scalars(tag)}


def tensorboard_text(accumulator: Any, tag: str) -> dict[int, str]:
    """The text summaries (`add_text`) of `tag` by step; the text plugin stores them as string tensors."""
    return {
        event.step: event.tensor_proto.string_val[0].decode() for event in accumulator.Tensors(f"{tag}/text_summary")
    }
