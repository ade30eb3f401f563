"""Which skips the suite expects, and the pytest hooks that fail a run on any other one (`FLEETRL_STRICT_SKIPS=1`).

A skipped test is a test that did not run: the deployment tests skip when docker-compose or promtool are missing,
the vLLM tests without vLLM, so a CI machine short of a tool would report green while checking less. `.ci/run`
sets `FLEETRL_STRICT_SKIPS=1`; then a skip whose reason `EXPECTED_SKIPS` does not allow turns the run's exit code
into 1 and is listed at the end ("unexpected skips"). Without the variable skips are reported as usual (`-ra`).

`EXPECTED_SKIPS` is the one list of skips CI may see (docs/testing.md, "Skips"). tests/conftest.py imports the
hooks; a pytest run elsewhere loads them with `-p tests.skip_policy` (tests/unit/test_skip_policy.py does).

    FLEETRL_STRICT_SKIPS=1 python -m pytest -m "not slow"
"""

from __future__ import annotations

import os
import re
from collections.abc import Generator
from dataclasses import dataclass

import pytest
from _pytest.reports import TestReport

STRICT_ENV = "FLEETRL_STRICT_SKIPS"
NO_CUDA_REASON = "needs a CUDA device (none here)"


@dataclass(frozen=True)
class ExpectedSkip:
    """A skip CI may see: its reason matches `reason` (a regex, searched) and, when `marker` is set, the test
    carries that marker. `why` says why the skip is not a hole in CI."""

    reason: str
    why: str
    marker: str | None = None

    def allows(self, reason: str, markers: frozenset[str]) -> bool:
        return re.search(self.reason, reason) is not None and (self.marker is None or self.marker in markers)


EXPECTED_SKIPS: tuple[ExpectedSkip, ...] = (
    ExpectedSkip(
        reason=re.escape(NO_CUDA_REASON),
        marker="gpu",
        why="CI runs on CPU; GPU sessions run the GPU check (bench/gpu_check.py, docs/benchmarks.md)",
    ),
)


def expected(reason: str, markers: frozenset[str] = frozenset()) -> bool:
    """Whether a skip with this reason, of a test with these markers, is one `EXPECTED_SKIPS` allows."""
    return any(rule.allows(reason, markers) for rule in EXPECTED_SKIPS)


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    """The reason a skipped report gives ("Skipped: " removed)."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def strict() -> bool:
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


_unexpected: list[tuple[str, str]] = []  # (node id, reason) of this session's unexpected skips


def pytest_runtest_setup(item: pytest.Item) -> None:
    """`gpu` tests skip without a CUDA device (torch is imported only for them)."""
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip(NO_CUDA_REASON)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = skip_reason(report)
        if not expected(reason, frozenset(getattr(report, "fleetrl_markers", ()))):
            _unexpected.append((report.nodeid, reason))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module skipped as a whole (`pytest.importorskip` at its top) has no markers to go by: its reason only."""
    if report.skipped:
        reason = skip_reason(report)
        if not expected(reason):
            _unexpected.append((report.nodeid, reason))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, TestReport, TestReport]:
    """Carry the test's marker names on its report, for `pytest_runtest_logreport`."""
    report = yield
    report.fleetrl_markers = tuple(m.name for m in item.iter_markers())
    return report


def pytest_sessionstart(session: pytest.Session) -> None:
    _unexpected.clear()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if strict() and _unexpected and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _unexpected:
        return
    verdict = "they fail the run" if strict() else f"set {STRICT_ENV}=1 to fail the run on them"
    terminalreporter.section(f"unexpected skips ({verdict}; tests/skip_policy.py lists the expected ones)")
    for nodeid, reason in _unexpected:
        terminalreporter.line(f"{nodeid}: {reason}")
