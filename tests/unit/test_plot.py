import json

import pytest

from fleetrl.plot import main, read_metrics, rolling_mean


def write(tmp_path, lines):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_plot_writes_a_png_with_eval_lines(tmp_path):
    steps = [
        {
            "step": i,
            "reward/mean": i / 10,
            "entropy": 1 - i / 20,
            "kl_sample_train_v1": 0.01 * i,
            "async/version_offset_mean": 0.5,
            "async/version_offset_max": 1,
        }
        for i in range(1, 11)
    ]
    write(tmp_path, [{"step": 0, "eval/accuracy": 0.2}, *steps, {"step": 10, "eval/accuracy": 0.6}])
    assert main([str(tmp_path)]) == 0
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    train, evals = read_metrics(tmp_path / "metrics.jsonl")
    assert len(train) == 10 and [e["eval/accuracy"] for e in evals] == [0.2, 0.6]


def test_plot_reports_missing_or_bad_metrics(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    assert "metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ValueError, match=":2: not valid JSON"):
        read_metrics(tmp_path / "metrics.jsonl")


def test_rolling_mean():
    assert rolling_mean([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]


def test_a_resumed_record_plots_one_curve(tmp_path):
    # A record from before resumes cut it back: steps 3-4 trained, lost, trained again after a resume.
    first = [{"step": i, "reward/mean": 0.1 * i} for i in (1, 2, 3, 4)]
    again = [{"step": i, "reward/mean": 0.5 + 0.1 * i} for i in (3, 4, 5)]
    write(tmp_path, [*first, {"step": 4, "eval/accuracy": 0.1}, *again, {"step": 4, "eval/accuracy": 0.3}])
    train, evals = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in train] == [1, 2, 3, 4, 5]
    assert [m["reward/mean"] for m in train][2:] == [0.8, 0.9, 1.0]  # the retrained lines won
    assert [e["eval/accuracy"] for e in evals] == [0.3]
