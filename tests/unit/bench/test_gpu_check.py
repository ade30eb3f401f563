"""bench/gpu_check.py's runner (order, stop at the first failure, time limits, "not built") and
bench/gpu_check_prepare.py's wheel list and command. The checks themselves run in the dry-run test
(tests/integration/bench/test_gpu_check.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import sys
import time
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gc = _load("gpu_check")
prepare = _load("gpu_check_prepare")


def _ctx(tmp_path: Path, **limits: float):
    sizes = dataclasses.replace(gc.DRY, limits_s={int(k.removeprefix("c")): v for k, v in limits.items()})
    return gc.Ctx(
        dry=True,
        device="cpu",
        sizes=sizes,
        workdir=tmp_path / "work",
        out=tmp_path / "out",
        report=gc.Report("test"),
        deadline=time.monotonic() + 600,
    )


def test_stops_at_the_first_failure(tmp_path):
    ran = []

    def good(ctx):
        ran.append(ctx.current_check)
        ctx.row("fine", "42 tok/s")

    def bad(ctx):
        ran.append(ctx.current_check)
        raise gc.CheckFailed("the step broke")

    ctx = _ctx(tmp_path)
    ok = gc.run_checks(ctx, ((1, "one", good), (2, "two", bad), (3, "three", good)), None)
    assert not ok and ran == [1, 2]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert [(c["check"], c["status"]) for c in report["checks"]] == [(1, "ok"), (2, "FAIL"), (3, "not run")]
    assert report["checks"][1]["error"] == "the step broke"
    assert "stopped at the first failure (check 2)" in report["checks"][2]["error"]
    assert report["failed"]


def test_keep_going_runs_the_checks_after_a_failure(tmp_path):
    ran = []

    def good(ctx):
        ran.append(ctx.current_check)

    def bad(ctx):
        ran.append(ctx.current_check)
        raise gc.CheckFailed("the step broke")

    ctx = _ctx(tmp_path)
    ok = gc.run_checks(ctx, ((1, "one", good), (2, "two", bad), (3, "three", good)), None, keep_going=True)
    assert not ok and ran == [1, 2, 3]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert [(c["check"], c["status"]) for c in report["checks"]] == [(1, "ok"), (2, "FAIL"), (3, "ok")]


def test_an_unexpected_error_and_a_failed_row_are_failures(tmp_path):
    def raises(ctx):
        raise RuntimeError("CUDA error")

    def failed_row(ctx):
        ctx.row("swap", "no sequence spans it", gc.FAIL)

    for fn, error in ((raises, "RuntimeError: CUDA error"), (failed_row, "a row failed")):
        ctx = _ctx(tmp_path)
        assert not gc.run_checks(ctx, ((1, "one", fn),), None)
        assert (ctx.report.checks[0].status, ctx.report.checks[0].error) == (gc.FAIL, error)


def test_a_check_past_its_time_limit_fails(tmp_path):
    def slow(ctx):
        time.sleep(60)  # plays a hung step

    ctx = _ctx(tmp_path, c1=0.2)
    assert not gc.run_checks(ctx, ((1, "hangs", slow), (2, "after", lambda ctx: None)), None)
    assert ctx.report.checks[0].status == gc.FAIL and "timed out" in ctx.report.checks[0].error
    assert ctx.report.checks[1].status == gc.NOT_RUN


def test_not_built_is_no_failure(tmp_path):
    def lacking(ctx):
        ctx.row("hf engine on cuda", "HFEngine has no device option", gc.NOT_BUILT)

    ctx = _ctx(tmp_path)
    assert gc.run_checks(ctx, ((1, "engine", lacking), (2, "next", lambda ctx: ctx.row("x", "y"))), None)
    assert [c.status for c in ctx.report.checks] == [gc.NOT_BUILT, gc.OK]


def test_only_runs_the_checks_named(tmp_path):
    ran = []
    ctx = _ctx(tmp_path)
    checks = tuple((n, str(n), lambda ctx: ran.append(ctx.current_check)) for n in (1, 2, 3))
    assert gc.run_checks(ctx, checks, {2})
    assert ran == [2] and [c.check for c in ctx.report.checks] == [2]


def test_the_table_has_a_line_per_check_then_its_rows(tmp_path):
    ctx = _ctx(tmp_path)
    gc.run_checks(ctx, ((1, "one", lambda ctx: ctx.row("a | b", "1 tok/s", seconds=1.23456)),), None)
    lines = ctx.report.table().splitlines()
    assert lines[0] == "| check | item | result | status | s |"
    assert lines[2].startswith("| **1** | **one** |")
    assert lines[3] == "| 1 | a / b | 1 tok/s | ok | 1.2 |"


def test_a_knob_config_lacks_is_refused_by_name(tmp_path):
    with pytest.raises(KeyError, match="no_such_knob"):
        gc.run_config("model", tmp_path, no_such_knob=1)
    assert set(gc.knobs()) == set(gc.KNOBS)


@pytest.mark.slow  # two trainers and a model built: ~8 s on 2 cores
def test_a_missing_compute_dtype_labels_the_arm_fp32(tmp_path, monkeypatch):
    """Check 7 on whatever has landed: without compute_dtype its first arm is plain fp32, said so in the row."""
    monkeypatch.setattr(gc, "knobs", lambda: dict.fromkeys(gc.KNOBS, False))
    ctx = _ctx(tmp_path)
    ctx.workdir.mkdir(parents=True)
    ctx.current_check = 7
    gc.check_adamw_precision(ctx)
    items = [r.item for r in ctx.report.rows if r.check == 7]
    assert items[-2:] == [
        "AdamW lr 1e-6, fp32 (compute_dtype not built)",
        "AdamW lr 1e-6, pure bf16 (bf16 weights and AdamW state)",
    ]
    changed = [r.data["changed"] / r.data["total"] for r in ctx.report.rows if r.item.startswith("AdamW")]
    assert changed[0] > 0.5 > changed[1]  # the update survives in fp32, rounds away in bf16


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_prepare_carries_every_requirement_the_gpu_machine_lacks():
    """A new dependency of fleetrl fails here until the prepare script carries it or names it as present there."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    # The `http` extra too: every inference replica serves its HTTP API (fastapi, uvicorn), so `fleetrl up` needs it.
    required = [*project["dependencies"], *project["optional-dependencies"]["http"]]
    names = {_name(r) for r in required}
    covered = {n.lower() for n in (*prepare.WHEELS, *prepare.DEVICE_HAS)}
    assert names - covered == set()
    assert not set(prepare.WHEELS) & set(prepare.DEVICE_HAS)


def test_the_device_command_fits_one_run():
    command = prepare.device_command()
    assert len(command) <= 2000
    assert f"{prepare.WHEEL_DIR}/*.whl" in command and "--no-index" in command
    assert "bench/gpu_check.py --out $OUT" in command
    gitignore = (REPO / ".gitignore").read_text().splitlines()
    assert f"/{prepare.WHEEL_DIR}/" in gitignore  # the wheels never land in a commit
