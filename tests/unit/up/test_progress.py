import io
import json

from fleetrl.up.progress import Progress


def test_progress_shows_steps_and_evals_and_a_resumed_run_only_new_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "version": 1, "reward/mean": 0.25}) + "\n")
    out = io.StringIO()
    Progress(path, 4, stream=out).update()
    assert "step 1/4  v1  reward 0.250" in out.getvalue()
    resumed = io.StringIO()
    progress = Progress(path, 4, stream=resumed, from_end=True)
    with open(path, "a") as fh:
        fh.write(json.dumps({"step": 2, "version": 2, "eval/accuracy": 0.5}) + "\n")
        fh.write(json.dumps({"step": 2, "version": 2, "reward/mean": 0.5}) + '\n{"step": 3')  # a partial line
    progress.update()
    text = resumed.getvalue()
    assert "step 1/" not in text and "eval of version 2: accuracy 0.500" in text and "step 2/4" in text
    assert "step 3" not in text  # not complete yet


def test_a_resumed_run_shows_new_lines_after_the_record_is_cut_back(tmp_path):
    path = tmp_path / "metrics.jsonl"
    old = [{"step": i, "version": i, "reward/mean": 0.1, "time": 1.0} for i in (1, 2, 3)]
    path.write_text("".join(json.dumps(m) + "\n" for m in old))
    out = io.StringIO()
    progress = Progress(path, 5, stream=out, from_end=True)
    # The controller resumes at version 1: the file is replaced by its first line, then step 2 is trained again.
    tmp = tmp_path / "metrics.jsonl.tmp"
    tmp.write_text(json.dumps(old[0]) + "\n" + json.dumps({"step": 2, "version": 2, "reward/mean": 0.75}) + "\n")
    tmp.replace(path)
    progress.update()
    text = out.getvalue()
    assert "step 2/5  v2  reward 0.750" in text and "step 1/" not in text and "reward 0.100" not in text
