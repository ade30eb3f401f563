import pytest

from fleetrl.up.log_dir import LogDirError, prepare_log_dir


def old_run(log_dir):
    (log_dir / "checkpoints" / "step-00000002").mkdir(parents=True)
    (log_dir / "final").mkdir()
    (log_dir / "final" / "config.json").write_text("{}")
    (log_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (log_dir / "controller.sqlite").write_text("")
    (log_dir / "trainer.log").write_text("old\n")
    (log_dir / "rows.jsonl").write_text("{}\n")  # fleetrl.main's rows: not the run's output


def prepare(log_dir, **kw):
    return prepare_log_dir(log_dir, checkpoint_dir=log_dir / "checkpoints", output_dir=log_dir / "final", **kw)


def test_a_log_path_that_holds_a_run_is_refused_without_resume_or_overwrite(tmp_path):
    old_run(tmp_path)
    with pytest.raises(LogDirError) as refused:
        prepare(tmp_path, resume=False, overwrite=False)
    message = str(refused.value)
    assert "holds a run" in message and "--resume" in message and "--overwrite" in message
    assert "checkpoints/" in message and "metrics.jsonl" in message
    assert (tmp_path / "checkpoints").exists() and (tmp_path / "trainer.log").exists()  # nothing touched
    assert prepare(tmp_path, resume=True, overwrite=False) == []  # a resume keeps everything


def test_overwrite_deletes_the_run_and_its_logs_only(tmp_path):
    old_run(tmp_path)
    removed = prepare(tmp_path, resume=False, overwrite=True)
    assert {p.name for p in removed} == {"checkpoints", "final", "metrics.jsonl", "controller.sqlite", "trainer.log"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]


def test_logs_of_a_start_that_never_ran_are_cleared_and_an_empty_dir_is_fine(tmp_path):
    (tmp_path / "controller.log").write_text("failed at start\n")
    (tmp_path / "checkpoints").mkdir()  # empty: no run
    assert [p.name for p in prepare(tmp_path, resume=False, overwrite=False)] == ["controller.log"]
    assert prepare(tmp_path / "new", resume=False, overwrite=False) == []


def test_resume_needs_a_run_and_excludes_overwrite(tmp_path):
    with pytest.raises(LogDirError, match="holds no run to resume"):
        prepare(tmp_path, resume=True, overwrite=False)
    with pytest.raises(LogDirError, match="choose one"):
        prepare(tmp_path, resume=True, overwrite=True)


def test_fleetrl_up_refuses_a_used_log_path_before_starting_anything(tmp_path, capsys):
    import json

    from fleetrl.up.run import main

    log_dir = tmp_path / "run"
    log_dir.mkdir()
    old_run(log_dir)
    path = tmp_path / "run.json"
    (tmp_path / "rollout.py").write_text("def make(setup):\n    return None\n")
    path.write_text(
        json.dumps({"run": {"base_model": "m", "log_path": str(log_dir)}, "up": {"rollout": "rollout.py:make"}})
    )
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert f"fleetrl up: {log_dir} holds a run" in err and "--overwrite" in err
    with pytest.raises(SystemExit):
        main([str(path), "--restart-weights"])  # only with --resume
    assert "--restart-weights goes with --resume" in capsys.readouterr().err


def test_the_reason_a_run_failed_is_read_from_the_controller_log(tmp_path):
    from fleetrl.up.run import run_failure

    log = tmp_path / "controller.log"
    log.write_text(
        "2026-01-01 controller INFO x: run started\n"
        "2026-01-01 controller ERROR fleetrl.services.controller.orchestrator: run failed: RunFailed: all 6 rows "
        "rejected: 6 too long for max_seq_len 5; nothing exported\n"
        "2026-01-01 controller INFO x: bye\n"
    )
    assert run_failure(log) == "all 6 rows rejected: 6 too long for max_seq_len 5; nothing exported"
    assert run_failure(tmp_path / "missing.log") is None


def test_overwrite_deletes_the_trackers_files_so_a_new_run_is_a_new_tracker_run(tmp_path):
    old_run(tmp_path)
    for name in ("wandb_run_id", "mlflow_run_id", "samples.jsonl", "config.json"):
        (tmp_path / name).write_text("x\n")
    for folder in ("wandb", "tensorboard", "mlruns"):
        (tmp_path / folder / "inner").mkdir(parents=True)
    prepare(tmp_path, resume=False, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]
