import json

from fleetrl.metrics_jsonl import SUPERSEDED, cut_to_version, read_lines, steps_without_update


def write(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_cut_to_version_moves_later_steps_and_evals_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 0, "version": 0, "eval/accuracy": 0.1},
        {"step": 1, "version": 1, "loss": 1.0},
        {"step": 2, "version": 2, "loss": 0.9},
        {"step": 3, "version": 3, "loss": 0.8},
        {"step": 2, "version": 2, "eval/accuracy": 0.2},  # reported after step 3: kept, it is of version 2
        {"step": 4, "version": 4, "loss": 0.7},
        {"step": 4, "version": 4, "eval/accuracy": 0.3},
    ]
    write(path, lines)
    assert cut_to_version(path, 2) == 3
    assert read_lines(path) == [lines[0], lines[1], lines[2], lines[4]]
    assert read_lines(tmp_path / SUPERSEDED) == [lines[3], lines[5], lines[6]]
    assert cut_to_version(path, 2) == 0  # already cut: nothing moves, the file is left alone


def test_cut_keeps_the_last_line_of_a_step_written_twice(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write(path, [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}, {"step": 2, "loss": 2.5}])
    assert cut_to_version(path, 5) == 1
    assert read_lines(path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.5}]


def test_cut_of_a_missing_record_and_empty_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert cut_to_version(path, 3) == 0 and not path.exists()
    assert steps_without_update(path, 3) == 0
    write(path, [{"step": 1, "train/empty_step": 1.0}, {"step": 2, "loss": 1.0}, {"step": 3, "train/empty_step": 1.0}])
    assert steps_without_update(path, 2) == 1 and steps_without_update(path, 3) == 2
