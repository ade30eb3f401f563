"""`fleetrl.main`'s keyword arguments and its summary dict (no services started)."""

from __future__ import annotations

import json

import fleetrl
from fleetrl import Config
from fleetrl.up.embedded import run_summary


def make_rollout_fn(setup):  # only named: the run stops before any service starts
    raise AssertionError("not called")


def test_config_fields_as_keywords_are_taken_and_a_bad_option_is_named_as_a_keyword(tmp_path, capsys):
    cfg = Config(base_model=str(tmp_path / "none"), log_path=str(tmp_path / "run"))
    summary = fleetrl.main(cfg, rollout_fn_factory=make_rollout_fn, rollout_extras={"k": 1}, gatways=2)
    err = capsys.readouterr().err
    assert summary["exit_code"] == 2 and summary["steps"] == 0 and summary["final_model"] is None
    assert "invalid keyword arguments" in err and "gatways: unknown field, did you mean gateways?" in err
    assert "[up]" not in err and "up.gatways" not in err
    # rollout_extras is a Config field: accepted, so the next complaint is the missing model.
    summary = fleetrl.main(cfg, rollout_fn_factory=make_rollout_fn, rollout_extras={"k": 1})
    assert summary["exit_code"] == 2 and "base_model: no model at" in capsys.readouterr().err


def test_the_summary_reads_steps_version_and_last_metrics(tmp_path):
    cfg = Config(log_path=str(tmp_path))
    lines = [
        {"step": 1, "version": 1, "data/samples": 4},
        {"eval/x": 1.0},
        {"step": 2, "version": 2, "data/samples": 4},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in lines) + "\n")
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    summary = run_summary(cfg, 0)
    assert (summary["steps"], summary["final_version"]) == (2, 2)
    assert summary["last_metrics"]["step"] == 2 and summary["final_model"] == str(tmp_path / "final")


def test_lambdas_closures_and_a_local_evaluation_fn_pass_mains_checks(tmp_path, capsys):
    """The gateways run in this process: a lambda factory and filter and a local evaluation hook are accepted (no
    'must be a module-level function', no JSON error), so the first complaint is the missing model."""
    cfg = Config(base_model=str(tmp_path / "none"), log_path=str(tmp_path / "run"), eval_dataset="eval.jsonl")

    async def evaluate(setup, rows):  # a local function: not importable by a gateway process
        return {}

    summary = fleetrl.main(
        cfg, rollout_fn_factory=lambda setup: None, dynamic_filter_fn=lambda pg: True, evaluation_fn=evaluate
    )
    err = capsys.readouterr().err
    assert summary["exit_code"] == 2 and "base_model: no model at" in err and "module-level" not in err


def test_an_evaluation_fn_without_eval_dataset_is_named(tmp_path, capsys):
    cfg = Config(base_model=str(tmp_path / "none"), log_path=str(tmp_path / "run"))
    summary = fleetrl.main(cfg, rollout_fn_factory=make_rollout_fn, evaluation_fn=lambda setup, rows: {})
    assert summary["exit_code"] == 2 and "evaluation_fn: name the held-out rows" in capsys.readouterr().err


def test_a_cookbook_shaped_evaluation_fn_needs_no_eval_dataset(tmp_path, capsys):
    """The current cookbook's evaluation_fn(step, rollout_fn) owns its rows: no eval_dataset asked for (the first
    complaint is the missing model); a hook whose shape cannot be read is named."""
    cfg = Config(base_model=str(tmp_path / "none"), log_path=str(tmp_path / "run"))

    async def evaluation_fn(step, rollout_fn):
        return {}

    summary = fleetrl.main(cfg, rollout_fn_factory=make_rollout_fn, evaluation_fn=evaluation_fn)
    err = capsys.readouterr().err
    assert summary["exit_code"] == 2 and "base_model: no model at" in err and "held-out" not in err
    summary = fleetrl.main(cfg, rollout_fn_factory=make_rollout_fn, evaluation_fn=lambda a, b: {})
    assert summary["exit_code"] == 2 and "evaluation_fn: cannot tell from its parameters" in capsys.readouterr().err
