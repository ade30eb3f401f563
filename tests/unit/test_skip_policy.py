"""The skip policy (tests/skip_policy.py): with FLEETRL_STRICT_SKIPS=1 a skip that EXPECTED_SKIPS does not allow
fails the run (exit 1, listed as an unexpected skip); an allowed one (a `gpu` test without CUDA) does not, and
without the variable skips are reported but pass. Each case is a real pytest run, in a subprocess, of a tiny test
file with the policy loaded as a plugin (`-p tests.skip_policy`), as CI's lanes load it through tests/conftest.py.
Those three are `slow` (a pytest start and a torch import each, about 6 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lanes import RECORD_ENV
from tests.skip_policy import NO_CUDA_REASON, STRICT_ENV, expected

REPO = Path(__file__).resolve().parents[2]

INI = """\
[pytest]
markers =
    gpu: needs a CUDA device
"""

UNEXPECTED = """\
import pytest


def test_runs():
    assert True


def test_needs_a_tool():
    pytest.skip("docker-compose is not installed")


@pytest.mark.gpu
def test_on_a_gpu():
    import torch

    assert torch.cuda.is_available()
"""

MODULE_SKIP = """\
import pytest

pytest.importorskip("a_module_that_is_not_installed")


def test_never_collected():
    assert True
"""

GPU_ONLY = """\
import pytest


@pytest.mark.gpu
def test_on_a_gpu():
    import torch

    assert torch.cuda.is_available()
"""


def run_pytest(tmp_path: Path, strict: bool, **sources: str) -> subprocess.CompletedProcess[str]:
    """pytest on the test modules `sources` (name -> text) in `tmp_path`, with the skip policy loaded."""
    (tmp_path / "pytest.ini").write_text(INI)
    for name, text in sources.items():
        (tmp_path / f"{name}.py").write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in (STRICT_ENV, RECORD_ENV)}  # not the outer run's
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if strict:
        env[STRICT_ENV] = "1"
    argv = [sys.executable, "-m", "pytest", "-p", "tests.skip_policy", "-p", "no:cacheprovider", "-rs"]
    argv += ["-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), *(f"{name}.py" for name in sources)]
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_an_unexpected_skip_fails_a_strict_run_naming_each_one_and_an_expected_one_does_not(tmp_path):
    import torch

    result = run_pytest(tmp_path, strict=True, test_case=UNEXPECTED, test_module_skip=MODULE_SKIP)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    listed = result.stdout.split("unexpected skips (they fail the run")[1].split("short test summary")[0]
    assert "test_case.py::test_needs_a_tool: docker-compose is not installed" in listed
    assert "test_module_skip.py: could not import 'a_module_that_is_not_installed'" in listed
    assert "test_on_a_gpu" not in listed  # a gpu test without CUDA is an expected skip
    assert ("2 passed, 2 skipped" if torch.cuda.is_available() else "1 passed, 3 skipped") in result.stdout


@pytest.mark.slow
def test_without_the_variable_the_same_skips_are_reported_and_the_run_passes(tmp_path):
    result = run_pytest(tmp_path, strict=False, test_case=UNEXPECTED, test_module_skip=MODULE_SKIP)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"set {STRICT_ENV}=1 to fail the run on them" in result.stdout
    assert "test_case.py::test_needs_a_tool: docker-compose is not installed" in result.stdout


@pytest.mark.slow
def test_a_strict_run_whose_only_skips_are_expected_passes(tmp_path):
    import torch

    result = run_pytest(tmp_path, strict=True, test_gpu=GPU_ONLY)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "unexpected skips" not in result.stdout
    if not torch.cuda.is_available():
        assert "1 skipped" in result.stdout and NO_CUDA_REASON in result.stdout


@pytest.mark.parametrize(
    ("reason", "markers", "allowed"),
    [
        (NO_CUDA_REASON, {"gpu"}, True),
        (NO_CUDA_REASON, set(), False),  # the reason alone, on a test not marked gpu: not the expected skip
        ("promtool is not installed (Debian package prometheus)", set(), False),
        ("could not import 'vllm': No module named 'vllm'", {"vllm", "slow"}, False),
    ],
)
def test_expected_skips_allow_only_what_they_name(reason, markers, allowed):
    assert expected(reason, frozenset(markers)) is allowed
