"""The code-reward sandbox (fleetrl/sandbox.py) against hostile code, as real processes: each attack is stopped or
refused and the caller gets a result saying how it ended.

The bwrap tests need bubblewrap (`scripts/install.sh test` installs it); without it they skip with a reason that
tests/skip_policy.py does not expect, so `FLEETRL_STRICT_SKIPS=1` (CI) fails on it.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import uuid

import pytest

from fleetrl import sandbox
from fleetrl.sandbox import SandboxUnavailable, run_sandboxed, sandbox_backend
from tests.skip_policy import expected

NO_BWRAP = "bubblewrap (bwrap) is not installed: apt-get install bubblewrap (scripts/install.sh test)"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason=NO_BWRAP)
BOTH = pytest.mark.parametrize("isolation", [pytest.param("bwrap", marks=needs_bwrap), "process"])


def test_a_missing_bwrap_is_not_an_expected_skip() -> None:
    assert not expected(NO_BWRAP)


def _leftovers(marker: str) -> list[int]:
    """Processes whose command line holds `marker` (what a sandboxed run left behind)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


@BOTH
async def test_a_correct_program_reads_stdin_and_its_files_and_exits(isolation: str) -> None:
    code = "import sys, helper\nprint(helper.double(int(input())), sys.argv[1:])"
    result = await run_sandboxed(
        code, stdin="21\n", files={"helper.py": "def double(x):\n    return 2 * x\n"}, args=["a"], isolation=isolation
    )
    assert result.ok and result.stdout == "42 ['a']\n" and result.isolation == isolation
    failing = await run_sandboxed("import sys\nsys.exit(3)", isolation=isolation)
    assert (failing.reason, failing.exit_code, failing.ok) == ("exited", 3, False)


@BOTH
async def test_a_program_that_loops_forever_is_stopped_at_its_cpu_limit(isolation: str) -> None:
    result = await run_sandboxed("while True:\n    pass", cpu_s=1, timeout_s=120, isolation=isolation)
    assert result.reason == "cpu_limit" and result.exit_code is None and not result.ok


@BOTH
async def test_a_program_that_waits_forever_is_killed_at_the_wall_clock_limit(isolation: str) -> None:
    marker = uuid.uuid4().hex
    code = "import os, threading\nif os.fork() == 0:\n    os.setsid()\nthreading.Event().wait()"
    result = await run_sandboxed(code, timeout_s=1, args=[marker], isolation=isolation)
    assert result.reason == "timeout" and "wall-clock" in result.detail
    if isolation == "bwrap" or os.geteuid() == 0:  # a plain process as this user: it can leave (docs)
        assert _leftovers(marker) == []  # the child that left the process group went too


@BOTH
async def test_a_program_that_allocates_without_bound_stops_at_its_memory_limit(isolation: str) -> None:
    code = "blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))"
    result = await run_sandboxed(code, memory_mb=128, timeout_s=120, isolation=isolation)
    assert result.reason == "memory_limit" and "MemoryError" in result.stderr


@BOTH
async def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing(isolation: str) -> None:
    marker = uuid.uuid4().hex
    # Children that stay alive until the parent goes, forked until the kernel refuses.
    counting = (
        "import os\nr, w = os.pipe()\nn = 0\n"
        "try:\n    while n < 10000:\n        if os.fork() == 0:\n            os.close(w)\n            os.read(r, 1)\n"
        "            os._exit(0)\n        n += 1\nexcept OSError as exc:\n    print(n, exc.errno)\n"
    )
    result = await run_sandboxed(counting, max_processes=16, timeout_s=120, args=[marker], isolation=isolation)
    forked, errno = result.stdout.split()
    assert result.ok and int(forked) < 16 and int(errno) == 11  # EAGAIN at RLIMIT_NPROC
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = await run_sandboxed(bomb, max_processes=16, timeout_s=2, args=[marker], isolation=isolation)
    assert result.reason in ("timeout", "cpu_limit")
    assert _leftovers(marker) == []


@needs_bwrap
async def test_the_network_is_out_of_reach_even_the_runs_services_on_loopback() -> None:
    with socket.create_server(("127.0.0.1", 0)) as service:  # a run's service listening on this host's loopback
        port = service.getsockname()[1]
        code = (
            f"import socket\nfor address in [('127.0.0.1', {port}), ('1.1.1.1', 80)]:\n"
            "    s = socket.socket()\n    s.settimeout(5)\n    print(s.connect_ex(address))\n"
        )
        result = await run_sandboxed(code, isolation="bwrap")
    refused, unreachable = (int(x) for x in result.stdout.split())
    assert result.ok and refused != 0 and unreachable != 0


@BOTH
async def test_the_runs_auth_token_is_out_of_reach(isolation: str, tmp_path, monkeypatch) -> None:
    if isolation == "process" and os.geteuid() != 0:
        pytest.skip("a plain process as this user can read this user's files (docs: it does not isolate them)")
    monkeypatch.setenv("FLEETRL_AUTH_TOKEN", "run-secret")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    token = run_dir / "auth_token"
    token.write_text("run-secret")
    token.chmod(0o600)
    code = (
        "import os\nprint(os.environ.get('FLEETRL_AUTH_TOKEN'))\n"
        f"try:\n    print(open({str(token)!r}).read())\nexcept OSError as exc:\n    print(type(exc).__name__)\n"
    )
    result = await run_sandboxed(code, isolation=isolation)
    assert result.ok and "run-secret" not in result.stdout
    assert result.stdout.split()[0] == "None" and result.stdout.split()[1] in ("FileNotFoundError", "PermissionError")


@BOTH
async def test_writes_outside_its_directory_are_refused(isolation: str, tmp_path) -> None:
    if isolation == "process" and os.geteuid() != 0:
        pytest.skip("a plain process as this user can write where this user can (docs: it does not isolate it)")
    outside = tmp_path / "escaped"
    code = (
        f"for path in [{str(outside)!r}, '/usr/escaped', '../escaped']:\n"
        "    try:\n        open(path, 'w').write('x')\n        print('wrote')\n"
        "    except OSError as exc:\n        print(type(exc).__name__)\n"
        "open('inside', 'w').write('ok')\nprint(open('inside').read())\n"
    )
    result = await run_sandboxed(code, isolation=isolation)
    assert result.ok and "wrote" not in result.stdout and result.stdout.split()[-1] == "ok"
    assert not outside.exists() and not os.path.exists("/usr/escaped")


@BOTH
async def test_output_past_the_cap_kills_it(isolation: str) -> None:
    result = await run_sandboxed("while True:\n    print('x' * 1000)", max_output_bytes=10_000, isolation=isolation)
    assert result.reason == "output_limit" and len(result.stdout) == 10_000


@needs_bwrap
async def test_auto_picks_bwrap_and_says_so(caplog, monkeypatch) -> None:
    monkeypatch.delenv(sandbox.SANDBOX_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="fleetrl.sandbox"):
        assert await sandbox_backend(refresh=True) == "bwrap"
    assert "sandbox: bubblewrap" in caplog.text


async def test_without_bwrap_auto_falls_back_saying_what_is_not_isolated(caplog, monkeypatch) -> None:
    monkeypatch.delenv(sandbox.SANDBOX_ENV, raising=False)
    monkeypatch.setattr(sandbox, "_bwrap_path", lambda: None)
    try:
        with caplog.at_level(logging.WARNING, logger="fleetrl.sandbox"):
            assert await sandbox_backend(refresh=True) == "process"
        assert "do NOT isolate the network, the filesystem or other processes" in caplog.text
        with pytest.raises(SandboxUnavailable, match=r"bwrap.*not installed"):
            await run_sandboxed("print(1)", isolation="bwrap")
        result = await run_sandboxed("print(1)")
        assert result.ok and result.isolation == "process"
    finally:
        monkeypatch.undo()
        await sandbox_backend(refresh=True)  # the real answer again, for the tests after this one


async def test_bad_arguments_are_refused_naming_them(monkeypatch) -> None:
    with pytest.raises(ValueError, match="timeout_s: must be > 0"):
        await run_sandboxed("print(1)", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb: must be >= 32"):
        await run_sandboxed("print(1)", memory_mb=8)
    with pytest.raises(ValueError, match=r"files: '\.\./x' is not a plain file name"):
        await run_sandboxed("print(1)", files={"../x": ""})
    with pytest.raises(ValueError, match="isolation: 'docker' is not a sandbox backend"):
        await run_sandboxed("print(1)", isolation="docker")
    monkeypatch.setenv(sandbox.SANDBOX_ENV, "vm")
    with pytest.raises(ValueError, match="FLEETRL_SANDBOX: 'vm' is not a sandbox backend"):
        await run_sandboxed("print(1)")
    with pytest.raises(TypeError, match="code: Python source"):
        await run_sandboxed(b"print(1)")  # type: ignore[arg-type]
