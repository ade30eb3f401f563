"""How the lanes' pytest-xdist workers share the suite (tests/workers.py): whole modules, the stacks and the vLLM
engines one at a time, the longest scopes first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.workers import LONG_SCOPES, VLLM_MODULES, scheduling_order, scope_of

REPO = Path(__file__).resolve().parents[2]


def test_a_module_is_a_scope_and_the_stacks_and_engines_share_one_each():
    assert scope_of("tests/unit/controller/test_gate.py::test_x") == scope_of(
        "tests/unit/controller/test_gate.py::test_y[1]"
    )
    assert scope_of("tests/unit/controller/test_gate.py::test_x") == "tests/unit/controller/test_gate.py"
    assert scope_of("tests/deploy/test_compose.py::a") == scope_of("tests/deploy/test_chart.py::b") == "deploy"
    assert scope_of("tests/integration/inference/test_vllm_lora.py::a") == "vllm"
    assert {scope_of(f"{m}::t") for m in VLLM_MODULES} == {"vllm"}
    assert scope_of("tests/unit/inference/test_vllm_pin.py::t") == "tests/unit/inference/test_vllm_pin.py"


def test_every_named_module_exists():
    assert all((REPO / module).is_file() for module in VLLM_MODULES)
    assert all((REPO / scope).is_file() for scope in LONG_SCOPES if scope.startswith("tests/"))


def test_the_long_scopes_come_first_and_the_rest_keep_their_order():
    ids = [
        "tests/a.py::1",
        "tests/deploy/test_chart.py::1",
        "tests/b.py::1",
        "tests/integration/examples/test_arithmetic_main_job.py::full",
        "tests/integration/up/test_up_modes.py::vllm",
        "tests/a.py::2",
        "tests/deploy/test_compose.py::1",
    ]
    ordered = [ids[i] for i in scheduling_order(ids)]
    assert ordered == [
        "tests/integration/up/test_up_modes.py::vllm",
        "tests/integration/examples/test_arithmetic_main_job.py::full",
        "tests/deploy/test_chart.py::1",
        "tests/deploy/test_compose.py::1",
        "tests/a.py::1",
        "tests/b.py::1",
        "tests/a.py::2",
    ]


def test_two_workers_run_each_test_once_and_hand_out_whole_modules(tmp_path):
    """A real pytest-xdist run of two small modules on two workers: each module's tests ran on one worker."""
    for name in ("test_one", "test_two"):
        (tmp_path / f"{name}.py").write_text(
            "import os, pathlib\n"
            + "".join(
                f"def test_{i}():\n"
                f"    pathlib.Path(r'{tmp_path}', '{name}-{i}').write_text(os.environ['PYTEST_XDIST_WORKER'])\n"
                for i in range(4)
            )
        )
    (tmp_path / "conftest.py").write_text("from tests.workers import pytest_xdist_make_scheduler  # noqa: F401\n")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-rA", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "8 passed" in out.stdout
    for name in ("test_one", "test_two"):  # (xdist's default would deal a module's tests out to both workers)
        assert len({(tmp_path / f"{name}-{i}").read_text() for i in range(4)}) == 1
