import json

import pytest

from fleetrl import metric_names as mn
from fleetrl.commands.plot import figure, main, read_metrics, rolling_mean


def write(tmp_path, lines):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def step_lines(n, reward_scale=0.1):
    return [
        {
            mn.STEP: i,
            mn.RAW_REWARD: i * reward_scale,
            mn.ENTROPY: 1 - i / 20,
            mn.KL_SAMPLE_TRAIN: 0.0001 * i,  # tiny next to the reward: on a shared axis it would be a flat line
            mn.OFFSET_MEAN: 0.5,
            mn.OFFSET_MAX: 1,
        }
        for i in range(1, n + 1)
    ]


def test_plot_writes_a_png_with_eval_lines(tmp_path):
    write(tmp_path, [{"step": 0, "eval/accuracy": 0.2}, *step_lines(10), {"step": 10, "eval/accuracy": 0.6}])
    assert main([str(tmp_path)]) == 0
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    train, evals = read_metrics(tmp_path / "metrics.jsonl")
    assert len(train) == 10 and [e["eval/accuracy"] for e in evals] == [0.2, 0.6]


def panels(fig):
    """{subplot title: [(label, xs, ys) per line]} of the visible subplots."""
    return {
        ax.get_title(): [(ln.get_label(), list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()]
        for ax in fig.axes
        if ax.get_visible()
    }


def test_one_subplot_per_metric_each_with_its_own_curve_against_step(tmp_path):
    write(tmp_path, [{"step": 0, "eval/accuracy": 0.2}, *step_lines(10), {"step": 10, "eval/accuracy": 0.6}])
    fig = figure([tmp_path])
    drawn = panels(fig)
    keys = [mn.RAW_REWARD, mn.KL_SAMPLE_TRAIN, mn.ENTROPY, mn.OFFSET_MEAN, mn.OFFSET_MAX, "eval/accuracy"]
    assert list(drawn) == keys  # the default order; metrics the run lacks (loss here) get no empty subplot
    for key in keys:
        ((_label, xs, _ys),) = drawn[key]  # one curve in each
        assert xs == ([0, 10] if key.startswith("eval/") else list(range(1, 11)))
    assert drawn[mn.KL_SAMPLE_TRAIN][0][2] == [0.0001 * i for i in range(1, 11)]
    kl_axis = next(ax for ax in fig.axes if ax.get_title() == mn.KL_SAMPLE_TRAIN)
    low, high = kl_axis.get_ylim()
    assert high < 0.01 and low > -0.01  # its own y axis, scaled to it: not flattened by the reward's
    assert all(ax.get_xlabel() == "step" for ax in fig.axes[-2:])


def test_compare_runs_one_line_per_run_in_each_subplot_with_a_legend(tmp_path):
    a, b = tmp_path / "runA", tmp_path / "runB"
    a.mkdir(), b.mkdir()
    write(a, step_lines(5))
    write(b, step_lines(3, reward_scale=0.2))
    assert main([str(a), str(b), "--out", str(tmp_path / "cmp.png"), "--metrics", mn.RAW_REWARD, mn.ENTROPY]) == 0
    assert (tmp_path / "cmp.png").exists()
    fig = figure([a, b], [mn.RAW_REWARD, mn.ENTROPY])
    drawn = panels(fig)
    assert list(drawn) == [mn.RAW_REWARD, mn.ENTROPY]
    assert drawn[mn.RAW_REWARD] == [
        ("runA", [1, 2, 3, 4, 5], [0.1 * i for i in range(1, 6)]),
        ("runB", [1, 2, 3], [0.2 * i for i in range(1, 4)]),
    ]
    for ax in fig.axes:
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["runA", "runB"]


def test_smooth_draws_the_rolling_mean(tmp_path):
    write(tmp_path, step_lines(4))
    ((_, _, ys),) = panels(figure([tmp_path], [mn.RAW_REWARD], smooth=2))[mn.RAW_REWARD]
    assert ys == pytest.approx([0.1, 0.15, 0.25, 0.35])


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
    first = [{"step": i, mn.RAW_REWARD: 0.1 * i} for i in (1, 2, 3, 4)]
    again = [{"step": i, mn.RAW_REWARD: 0.5 + 0.1 * i} for i in (3, 4, 5)]
    write(tmp_path, [*first, {"step": 4, "eval/accuracy": 0.1}, *again, {"step": 4, "eval/accuracy": 0.3}])
    train, evals = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in train] == [1, 2, 3, 4, 5]
    assert [m[mn.RAW_REWARD] for m in train][2:] == [0.8, 0.9, 1.0]  # the retrained lines won
    assert [e["eval/accuracy"] for e in evals] == [0.3]
