import io
import json

from fleetrl import metric_names as mn
from fleetrl.up.progress import Progress, eta_seconds, fmt_duration, planned_steps, step_numbers


def test_progress_shows_steps_and_evals_and_a_resumed_run_only_new_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "version": 1, mn.RAW_REWARD: 0.25}) + "\n")
    out = io.StringIO()
    Progress(path, 4, stream=out).update()
    assert "step 1/4  v1  reward 0.250" in out.getvalue()
    resumed = io.StringIO()
    progress = Progress(path, 4, stream=resumed, from_end=True)
    with open(path, "a") as fh:
        fh.write(json.dumps({"step": 2, "version": 2, "eval/accuracy": 0.5}) + "\n")
        fh.write(json.dumps({"step": 2, "version": 2, mn.RAW_REWARD: 0.5}) + '\n{"step": 3')  # a partial line
    progress.update()
    text = resumed.getvalue()
    assert "step 1/" not in text and "eval of version 2: accuracy 0.500" in text and "step 2/4" in text
    assert "step 3" not in text  # not complete yet


def test_a_resumed_run_shows_new_lines_after_the_record_is_cut_back(tmp_path):
    path = tmp_path / "metrics.jsonl"
    old = [{"step": i, "version": i, mn.RAW_REWARD: 0.1, "time": 1.0} for i in (1, 2, 3)]
    path.write_text("".join(json.dumps(m) + "\n" for m in old))
    out = io.StringIO()
    progress = Progress(path, 5, stream=out, from_end=True)
    # The controller resumes at version 1: the file is replaced by its first line, then step 2 is trained again.
    tmp = tmp_path / "metrics.jsonl.tmp"
    tmp.write_text(json.dumps(old[0]) + "\n" + json.dumps({"step": 2, "version": 2, mn.RAW_REWARD: 0.75}) + "\n")
    tmp.replace(path)
    progress.update()
    text = out.getvalue()
    assert "step 2/5  v2  reward 0.750" in text and "step 1/" not in text and "reward 0.100" not in text


def step_line(step, time_s, **metrics):
    return {mn.STEP: step, mn.VERSION: step, "time": time_s, **metrics}


def test_plain_lines_carry_the_watched_numbers_a_recent_samples_per_s_average_and_an_eta(tmp_path):
    path = tmp_path / "metrics.jsonl"
    figures = {mn.RAW_REWARD: 0.5, mn.LOSS: 0.0123, mn.KL_SAMPLE_TRAIN: 0.001, mn.ENTROPY: 1.25}
    figures |= {mn.OFFSET_MEAN: 0.5, mn.OFFSET_MAX: 1}
    lines = [step_line(i, 100.0 + 10 * i, **figures, **{mn.SAMPLES_PER_S: 10.0 * i}) for i in (1, 2, 3)]
    path.write_text("".join(json.dumps(m) + "\n" for m in lines))
    out = io.StringIO()
    Progress(path, 10, stream=out).update(final=True)
    rows = out.getvalue().splitlines()
    assert len(rows) == 3
    # step 3: samples/s is the mean of the recent steps (10, 20, 30), the ETA 7 steps x 10 s.
    assert rows[2] == (
        "step 3/10  v3  reward 0.500  loss 0.0123  kl 0.001  entropy 1.250  offset 0.50/1  20.0 samples/s  eta 1m10s"
    )
    assert rows[0].endswith("eta ?")  # one step: no interval yet


def test_kl_to_the_reference_is_shown_when_the_run_has_one_and_missing_figures_are_dashes():
    text = step_numbers({mn.KL_REFERENCE: 0.25, mn.KL_SAMPLE_TRAIN: 0.001}, None)
    assert "kl 0.25 " in text and "reward -" in text and "- samples/s" in text
    assert "loss 3e-06" in step_numbers({mn.LOSS: 3e-06}, None)  # not 0.0000


def test_eta_and_durations():
    assert eta_seconds([0.0, 30.0, 60.0], step=5, total=20) == 15 * 30.0
    assert eta_seconds([0.0], step=1, total=20) is None and eta_seconds([0.0, 1.0], 1, None) is None
    assert [fmt_duration(s) for s in (5, 65, 3725, None)] == ["5s", "1m05s", "1h02m", "?"]


def test_planned_steps_from_max_steps_or_the_dataset(tmp_path):
    from fleetrl import Config

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": str(i)}) + "\n" for i in range(40)) + "\n")
    assert planned_steps(Config(max_steps=7, dataset=str(rows))) == 7
    assert planned_steps(Config(dataset=str(rows), prompt_groups_per_step=4, epochs=2)) == 20
    assert planned_steps(Config(dataset=str(rows), prompt_groups_per_step=4, max_rows=8)) == 2
    assert planned_steps(Config(dataset=str(tmp_path / "missing.jsonl"))) is None


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_a_rich_progress_bar_with_the_numbers_and_evals_above_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [step_line(1, 10.0, **{mn.RAW_REWARD: 0.125}), {mn.STEP: 1, mn.VERSION: 1, "eval/accuracy": 0.5}]
    lines.append(step_line(2, 20.0, **{mn.RAW_REWARD: 0.375}))
    path.write_text("".join(json.dumps(m) + "\n" for m in lines))
    out = Terminal()
    progress = Progress(path, 4, stream=out)
    progress.update()
    assert progress._bar is not None  # rich draws it (a live display, refreshed in place)
    progress.update(final=True)
    text = out.getvalue()
    assert "2/4" in text and "reward 0.375" in text and "eta 20s" in text
    assert "eval of version 1: accuracy 0.500" in text
    assert "\x1b[" in text  # terminal control codes: not the plain lines
    assert "step 2/4  v2" not in text
