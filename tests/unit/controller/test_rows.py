"""Rows through HF datasets, memory-mapped: every source kind, the same shuffle as before, no copy in the cursor."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

from fleetrl.controller.dataset import DatasetCursor, load_rows  # noqa: E402
from fleetrl.controller.rows import ArrowRows, open_rows, shuffled_order  # noqa: E402

ROWS = [{"question": f"{i}+1", "answer": str(i + 1), "meta": {"id": i}, "turns": [i, i + 1]} for i in range(20)]


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", Path(tmp_path / "hf-cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_is_memory_mapped_and_reads_back_the_rows(tmp_path: Path) -> None:
    rows = open_rows(write_jsonl(tmp_path / "train.jsonl", ROWS), in_memory_bytes=0)
    assert isinstance(rows, ArrowRows)
    assert rows.dataset.cache_files, "the rows are not backed by an Arrow file"
    assert len(rows) == 20 and rows[3] == ROWS[3] and rows[-1] == ROWS[-1]
    assert rows[2:4] == ROWS[2:4] and list(rows) == ROWS


def test_parquet_and_a_save_to_disk_folder(tmp_path: Path) -> None:
    table = datasets.Dataset.from_list(ROWS)
    table.to_parquet(str(tmp_path / "train.parquet"))
    assert list(open_rows(tmp_path / "train.parquet")) == ROWS
    table.save_to_disk(str(tmp_path / "saved"))
    assert list(open_rows(tmp_path / "saved")) == ROWS


def test_a_dataset_dict_folder_takes_train_or_the_named_split(tmp_path: Path) -> None:
    folder = tmp_path / "dd"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:5]), "test": datasets.Dataset.from_list(ROWS[5:7])}
    ).save_to_disk(str(folder))
    assert list(open_rows(folder)) == ROWS[:5]
    assert list(open_rows(f"{folder}:test")) == ROWS[5:7]
    with pytest.raises(ValueError, match="no split 'dev'"):
        open_rows(f"{folder}:dev")


def test_max_rows_selects_without_copying(tmp_path: Path) -> None:
    rows = open_rows(write_jsonl(tmp_path / "train.jsonl", ROWS), max_rows=4, in_memory_bytes=0)
    assert isinstance(rows, ArrowRows) and list(rows) == ROWS[:4]
    assert load_rows(tmp_path / "train.jsonl", max_rows=4) == ROWS[:4]  # a small file: in memory


def test_values_of_mixed_types_read_back_as_written(tmp_path: Path) -> None:
    mixed = [{"x": 1}, {"x": [1, 2]}, {"x": "three"}, {"x": {"nested": True}}]
    for in_memory_bytes in (0, 1 << 20):  # through Arrow, and in memory
        assert list(open_rows(write_jsonl(tmp_path / "mixed.jsonl", mixed), in_memory_bytes=in_memory_bytes)) == mixed


def test_a_small_jsonl_reads_as_the_arrow_path_does(tmp_path: Path) -> None:
    """In memory or through Arrow, the same rows: nested values, and a top-level key missing from a row as None."""
    ragged = [{"q": "1+1", "a": "2"}, {"q": "2+2"}, {"q": "3+3", "a": "6", "level": 3}]
    for name, rows in (("nested.jsonl", ROWS), ("ragged.jsonl", ragged)):
        path = write_jsonl(tmp_path / name, rows)
        in_memory, arrow = open_rows(path), open_rows(path, in_memory_bytes=0)
        assert isinstance(in_memory, list) and isinstance(arrow, ArrowRows)
        assert in_memory == list(arrow)
    assert open_rows(tmp_path / "ragged.jsonl")[1] == {"q": "2+2", "a": None, "level": None}


def test_bad_sources_fail_naming_what_is_wrong(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{"a": \n')
    for in_memory_bytes in (0, 1 << 20):
        with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
            open_rows(bad, in_memory_bytes=in_memory_bytes)
    with pytest.raises(ValueError, match="no such dataset file"):
        open_rows(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="not a hub dataset in the local datasets cache"):
        open_rows("nobody/no-such-dataset")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        open_rows(empty)


def test_the_shuffle_is_the_same_permutation_as_before(tmp_path: Path) -> None:
    for size, seed in ((1, 0), (20, 7), (1000, 12345)):
        before = list(range(size))
        random.Random(seed).shuffle(before)
        assert list(shuffled_order(size, seed)) == before


def test_the_cursor_keeps_the_dataset_on_disk(tmp_path: Path) -> None:
    rows = load_rows(write_jsonl(tmp_path / "train.jsonl", ROWS))
    cursor = DatasetCursor(rows, epochs=2, shuffle=True, seed=3)
    assert cursor.rows is rows  # no list copy of the dataset
    seen = [cursor.next() for _ in range(40)]
    assert cursor.next() is None
    assert sorted(r["meta"]["id"] for _, r in seen) == sorted(list(range(20)) * 2)
    assert all(cursor.row(row_id) == row for row_id, row in seen)
