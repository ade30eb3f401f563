"""Where a run's rows come from: HF `datasets`, memory-mapped, so a dataset larger than memory starts in seconds and
the controller holds no copy of it.

    rows = open_rows("train.jsonl")          # also .parquet, a folder written by Dataset.save_to_disk, or a hub id
    len(rows); rows[17]                       # a dict, read from the Arrow file on demand

Sources (`run.dataset`, `run.eval_dataset`):
- a JSONL file of at most `IN_MEMORY_BYTES` (8 MiB): read into memory as written, without importing `datasets`
  (about 1 s of CPU at the controller's start, on the way to the first step); a top-level key missing from one row
  reads as None in it, as it does through Arrow;
- a larger JSONL file, a JSON or Parquet file: converted once to Arrow in the `datasets` cache (`HF_DATASETS_CACHE`, by
  default ~/.cache/huggingface/datasets), then memory-mapped; a later start reuses the conversion;
- a folder written by `Dataset.save_to_disk` (or a `DatasetDict` folder: its "train" split; `folder:split` picks
  another);
- a hub id (`owner/name` or `owner/name:split`, default split "train") that is already in the local `datasets`
  cache: nothing is downloaded when `HF_DATASETS_OFFLINE=1`.

Arrow keeps one schema per dataset: a key missing from one row reads as None in it. Values of mixed types in one
column (a number in one row, a list in another) read back as written (datasets' Json feature); a file datasets still
cannot convert is loaded into memory instead, as before, with a warning. A bad line in a JSONL file fails with its
line number; an unknown source fails naming it.
"""

from __future__ import annotations

import json
import logging
from array import array
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import Any, overload

log = logging.getLogger(__name__)

JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
JSONL_SUFFIXES = (".jsonl", ".ndjson")

IN_MEMORY_BYTES = 8 << 20
"""A JSONL file up to this size is read into memory rather than converted to Arrow: `import datasets` (with pandas
and pyarrow) costs about 1 s of CPU in the controller's start-up, which `fleetrl up` runs after the trainer is ready,
so on the way to the first step; 8 MiB of rows take tens of MB as Python objects."""


class ArrowRows(Sequence[dict[str, Any]]):
    """A `datasets.Dataset` seen as a sequence of row dicts (an int index gives one dict; a slice a list of them)."""

    def __init__(self, dataset: Any, source: str) -> None:
        self.dataset = dataset
        self.source = source

    def __len__(self) -> int:
        return len(self.dataset)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            return [self.dataset[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows of {self.source}")
        return self.dataset[int(index)]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.dataset)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ArrowRows({self.source!r}, {len(self)} rows)"


def open_rows(
    source: str | Path, max_rows: int | None = None, in_memory_bytes: int = IN_MEMORY_BYTES
) -> Sequence[dict[str, Any]]:
    """The rows of `source` (see the module docstring; a JSONL file of at most `in_memory_bytes` is read into
    memory); ValueError names the source and what is wrong."""
    text = str(source)
    if not text:
        raise ValueError("no dataset given (run.dataset)")
    path = Path(text)
    if path.is_dir() or (not path.exists() and Path(text.rsplit(":", 1)[0]).is_dir()):
        rows: Sequence[dict[str, Any]] = _from_disk(text)
    elif path.is_file() and path.suffix.lower() in JSONL_SUFFIXES and path.stat().st_size <= in_memory_bytes:
        rows = _small_jsonl_rows(path, max_rows)
    elif path.is_file():
        rows = _from_file(path)
    elif path.suffix.lower() in (*JSON_SUFFIXES, ".parquet") or text.startswith(("/", ".", "~")):
        raise ValueError(f"{text}: no such dataset file")
    else:
        rows = _from_hub_cache(text)
    if max_rows is not None and max_rows < len(rows):
        if isinstance(rows, ArrowRows):
            rows = ArrowRows(rows.dataset.select(range(max_rows)), rows.source)  # an index mapping, not a copy
        else:
            rows = list(rows)[:max_rows]
    if len(rows) == 0:
        raise ValueError(f"{text}: the dataset has no rows")
    return rows


SCAN_BYTES = 64 << 20
"""How much of a local JSONL dataset `check_rows_source` reads line by line at start (all of a smaller file)."""


def check_rows_source(source: str | Path, scan_bytes: int = SCAN_BYTES) -> None:
    """A look at `source` before any service starts (`fleetrl up`'s config check): a local file that is missing,
    empty, not Parquet (by its magic bytes), or with a line in its first `scan_bytes` that is not a JSON object
    raises ValueError naming the file and line; so does a folder that is empty or was not written by
    `Dataset.save_to_disk` (or lacks the split named). A hub id is left to `open_rows`."""
    text = str(source)
    if not text:
        raise ValueError("no dataset given")
    path = Path(text)
    if path.is_dir() or (not path.exists() and Path(text.rsplit(":", 1)[0]).is_dir()):
        _check_saved_folder(text)
        return
    if not path.exists():
        if path.suffix.lower() in (*JSON_SUFFIXES, ".parquet") or text.startswith(("/", ".", "~")):
            raise ValueError(f"{text}: no such dataset file")
        return  # a hub id
    if not path.is_file():
        raise ValueError(f"{text}: not a file")
    rows = 0
    with open(path, "rb") as fh:
        head = fh.read(4)
        if path.suffix.lower() == ".parquet":
            if head != b"PAR1":
                raise ValueError(f"{text}: not a Parquet file (it does not start with PAR1)")
            return
        fh.seek(0)
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            if rows == 0 and path.suffix.lower() == ".json" and line.lstrip()[:1] == b"[":
                return  # one JSON document (a list of rows): open_rows reads it
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                if rows == 0 and path.suffix.lower() == ".json" and _is_one_document(path):
                    return  # one JSON document spread over lines ({"data": [...]})
                raise ValueError(
                    f"{text}:{lineno}: not valid JSON ({exc}): a JSONL file has one row object a line"
                ) from None
            if not isinstance(row, dict):
                raise ValueError(f"{text}:{lineno}: each row must be a JSON object")
            rows += 1
            if fh.tell() >= scan_bytes:
                return  # a big file: its start is checked; open_rows names a bad line found later
    if rows == 0:
        raise ValueError(f"{text}: the dataset has no rows")


def _check_saved_folder(text: str) -> None:
    """A folder source (`folder` or `folder:split`) must hold what `Dataset.save_to_disk` writes."""
    folder_text, _, split = text.partition(":") if not Path(text).is_dir() else (text, "", "")
    folder = Path(folder_text)
    if not any(folder.iterdir()):
        raise ValueError(f"{folder}: an empty folder, not a dataset (a folder written by Dataset.save_to_disk)")
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{folder}/dataset_dict.json: unreadable ({exc})") from None
        if (split or "train") not in splits:
            raise ValueError(
                f"{folder}: no split {split or 'train'!r} (splits: {', '.join(map(str, splits))}); use {folder}:SPLIT"
            )
        return
    if not (folder / "state.json").is_file():
        raise ValueError(
            f"{folder}: not a folder written by Dataset.save_to_disk (no state.json or dataset_dict.json); name a "
            "JSONL or Parquet file, or save the rows with Dataset.save_to_disk"
        )


def _from_file(path: Path) -> Sequence[dict[str, Any]]:
    import datasets

    builder = "parquet" if path.suffix.lower() == ".parquet" else "json"
    if path.suffix.lower() != ".json" and builder == "json" and not _first_line_is_an_object(path):
        check_jsonl_lines(path)  # a JSONL whose first row is not an object: name the line
    try:
        dataset = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # datasets wraps Arrow's errors in its own DatasetGenerationError
        if builder == "parquet":
            raise ValueError(f"{path}: not a readable Parquet file: {_cause(exc)}") from None
        check_jsonl_lines(path)  # names the bad line; datasets' own message does not
        log.warning("%s: datasets cannot convert it (%s); loading the rows into memory", path, _cause(exc))
        return load_jsonl_rows(path)
    if builder == "json" and dataset.num_columns == 0:
        check_jsonl_lines(path)
    return ArrowRows(dataset, str(path))


def _small_jsonl_rows(path: Path, max_rows: int | None) -> list[dict[str, Any]]:
    """A small JSONL file's rows in memory, as written; a top-level key some rows lack is None in them (Arrow's one
    schema per dataset does the same on the larger files' path). A bad line fails with its number."""
    rows = list(islice(_jsonl_rows(path), max_rows))
    keys = dict.fromkeys(key for row in rows for key in row)
    for row in rows:
        if len(row) != len(keys):
            for key in keys:
                row.setdefault(key, None)
    return rows


def _from_disk(text: str) -> ArrowRows:
    import datasets

    folder, _, split = text.partition(":") if not Path(text).is_dir() else (text, "", "")
    try:
        loaded = datasets.load_from_disk(folder)
    except FileNotFoundError as exc:
        raise ValueError(f"{folder}: not a folder written by Dataset.save_to_disk ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        split = split or "train"
        if split not in loaded:
            raise ValueError(f"{folder}: no split {split!r} (splits: {', '.join(loaded)}); use {folder}:SPLIT")
        loaded = loaded[split]
    return ArrowRows(loaded, text)


def _from_hub_cache(text: str) -> ArrowRows:
    import datasets

    name, _, split = text.partition(":")
    try:
        dataset = datasets.load_dataset(name, split=split or "train")
    except Exception as exc:
        raise ValueError(
            f"{text}: not a file, not a folder, and not a hub dataset in the local datasets cache ({_cause(exc)}); "
            "give a path, or fetch it once where the hub is reachable"
        ) from None
    return ArrowRows(dataset, text)


def _first_line_is_an_object(path: Path) -> bool:
    with open(path, "rb") as fh:
        for line in fh:
            if line.strip():
                return line.lstrip().startswith(b"{")
    return False


def _cause(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def check_jsonl_lines(path: Path) -> None:
    """Raise ValueError naming the first line of `path` that is not a JSON object (streams; keeps nothing)."""
    if path.suffix.lower() == ".json" and path.read_bytes()[:1].strip() in (b"[", b"{") and _is_one_document(path):
        return  # one JSON document (a list of rows, or datasets' {"data": [...]} form): datasets reads it
    if sum(1 for _ in _jsonl_rows(path)) == 0:
        raise ValueError(f"{path}: the dataset has no rows")


def _is_one_document(path: Path) -> bool:
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return True


def _jsonl_rows(path: str | Path) -> Iterator[dict[str, Any]]:
    """The rows of a JSONL file one at a time; a bad line fails with its line number."""
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {exc.msg}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: each row must be a JSON object")
            yield row


def load_jsonl_rows(path: str | Path, max_rows: int | None = None) -> list[dict[str, Any]]:
    """Read a JSONL dataset into memory (small files, and rows datasets cannot convert); a bad line fails with its
    line number."""
    rows = list(islice(_jsonl_rows(path), max_rows))
    if not rows:
        raise ValueError(f"{path}: the dataset has no rows")
    return rows


def shuffled_order(size: int, seed: int) -> array:
    """0..size-1 permuted exactly as `random.Random(seed).shuffle(list(range(size)))` would, in 8 bytes a row."""
    import random

    order = array("q", range(size))
    random.Random(seed).shuffle(order)  # type: ignore[arg-type]  # any mutable sequence
    return order
