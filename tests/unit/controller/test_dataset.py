import pytest

from fleetrl.controller.dataset import CursorPosition, DatasetCursor, load_jsonl_rows, load_rows

ROWS = [{"q": i} for i in range(5)]


def drain(cursor):
    out = []
    while (item := cursor.next()) is not None:
        out.append(item)
    return out


def test_epochs_shuffle_and_stable_row_ids():
    items = drain(DatasetCursor(ROWS, epochs=2, shuffle=True, seed=3))
    assert len(items) == 10
    ids = [rid for rid, _ in items]
    assert len(set(ids)) == 10  # an occurrence id per (epoch, row)
    first, second = [r["q"] for _, r in items[:5]], [r["q"] for _, r in items[5:]]
    assert sorted(first) == sorted(second) == list(range(5))
    for rid, row in items:
        assert row["q"] == rid % 5


def test_same_seed_same_order_and_resume_from_position():
    a = drain(DatasetCursor(ROWS, epochs=2, seed=7))
    cursor = DatasetCursor(ROWS, epochs=2, seed=7)
    head = [cursor.next() for _ in range(3)]
    resumed = DatasetCursor(ROWS, epochs=2, seed=7, position=cursor.position)
    assert head + drain(resumed) == a
    assert resumed.exhausted()


def test_no_shuffle_is_file_order():
    items = drain(DatasetCursor(ROWS, shuffle=False))
    assert [r["q"] for _, r in items] == [0, 1, 2, 3, 4]
    assert DatasetCursor(ROWS, position=CursorPosition(1, 0)).next() is None


def test_load_jsonl_names_bad_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\nnot json\n')
    with pytest.raises(ValueError, match=r"d.jsonl:4"):
        load_jsonl_rows(path)
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": 3}\n')
    assert load_jsonl_rows(path, max_rows=2) == [{"a": 1}, {"a": 2}]
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="JSON object"):
        load_jsonl_rows(path)


def test_parquet_rows_as_verl_writes_them(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        {
            "data_source": "gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"index": i},
        }
        for i in range(5)
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert load_rows(path) == rows
    assert load_rows(path, max_rows=2) == rows[:2]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text('{"a": 1}\n')
    assert load_rows(jsonl) == [{"a": 1}]
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet: not a readable Parquet file"):
        load_rows(tmp_path / "bad.parquet")
