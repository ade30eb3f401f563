"""The preload server (fleetrl/up/preload.py) as a real process on a Unix socket: a service forked from it sees what
a fresh `python -m` would see, its exit code and its end reach the client, and it dies with its client or server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetrl.up import preload
from fleetrl.up.supervisor import Supervisor
from tests.integration.up.conftest import start_fleetrl_up, wait_for_steps, write_run
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
TARGET = "tests.integration.up.preload_target"


def start_server(socket_path: Path, modules: str) -> subprocess.Popen[bytes]:
    server = subprocess.Popen(
        [sys.executable, "-m", "fleetrl.up.preload", "--socket", str(socket_path), "--modules", modules],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    wait_until(lambda: socket_path.exists() or server.poll() is not None, 120, "the preload server's socket")
    assert server.poll() is None, "the preload server exited"
    return server


def stop(server: subprocess.Popen[bytes]) -> None:
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def server_socket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One server for the module, with torch preloaded (so OMP_NUM_THREADS must be applied after the fork)."""
    socket_path = tmp_path_factory.mktemp("preload") / "preload.sock"
    server = start_server(socket_path, "json,torch")
    yield socket_path
    stop(server)


def spawn(socket_path: Path, tmp_path: Path, action: list[str], env: dict[str, str] | None = None, **kw):
    out = tmp_path / "seen.json"
    argv = [sys.executable, "-m", TARGET, str(out), *action]
    log = open(tmp_path / "target.log", "ab")  # noqa: SIM115 - the child writes to it; closed below
    try:
        process = preload.spawn(
            socket_path, argv, env if env is not None else dict(os.environ), str(REPO), log.fileno(), **kw
        )
    finally:
        log.close()
    return process, out, argv


def test_a_forked_service_sees_what_a_fresh_one_would(server_socket: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}/extra", "FLEETRL_PRELOAD_PROBE": "1", "OMP_NUM_THREADS": "1"}
    process, out, argv = spawn(server_socket, tmp_path, ["exit", "3"], env)
    assert process.wait(timeout=60) == 3
    forked = json.loads(out.read_text())
    fresh_out = tmp_path / "fresh.json"
    fresh = subprocess.run([*argv[:3], str(fresh_out), "exit", "3"], cwd=REPO, env=env, capture_output=True)
    assert fresh.returncode == 3
    fresh_seen = json.loads(fresh_out.read_text())
    assert forked["name"] == fresh_seen["name"] == "__main__"
    assert forked["argv"][1:] == [*fresh_seen["argv"][1:-3], str(out), "exit", "3"]
    assert Path(forked["argv"][0]).resolve() == Path(fresh_seen["argv"][0]).resolve()
    assert forked["cwd"] == fresh_seen["cwd"] == str(REPO)
    assert forked["path"][:2] == fresh_seen["path"][:2] == [str(REPO), f"{tmp_path}/extra"]
    assert forked["env"]["FLEETRL_PRELOAD_PROBE"] == "1"
    assert {k: v for k, v in forked["env"].items() if k in env} == env
    assert forked["sid"] == forked["pgid"] == process.pid  # its own session, as start_new_session gives
    assert " ".join(forked["cmdline"]) == " ".join(argv)  # what ps and pgrep -f show
    assert forked["threads"] == 1  # OMP_NUM_THREADS applied although torch was imported before the fork
    assert "preload target exit" in (tmp_path / "target.log").read_text()


def test_an_exception_a_signal_and_a_refusal_reach_the_client(server_socket: Path, tmp_path: Path) -> None:
    raised, _, _ = spawn(server_socket, tmp_path, ["raise"])
    assert raised.wait(timeout=60) == 1
    assert "RuntimeError: the target raised" in (tmp_path / "target.log").read_text()

    waiting, out, _ = spawn(server_socket, tmp_path, ["wait"])
    wait_until(out.exists, 60, "the waiting target to start")
    assert waiting.poll() is None
    os.kill(waiting.pid, signal.SIGKILL)
    assert waiting.wait(timeout=60) == -signal.SIGKILL

    with pytest.raises(preload.PreloadUnavailable, match="HF_HOME"):
        spawn(server_socket, tmp_path, ["exit", "0"], {**os.environ, "HF_HOME": str(tmp_path)})
    with pytest.raises(preload.PreloadUnavailable, match="-m MODULE"):
        log = os.open(tmp_path / "x.log", os.O_WRONLY | os.O_CREAT)
        preload.spawn(server_socket, ["/bin/true"], dict(os.environ), str(REPO), log)
    with pytest.raises(preload.PreloadUnavailable, match="did not answer"):
        spawn(tmp_path / "no-such.sock", tmp_path, ["exit", "0"])


def test_garbage_on_the_socket_is_refused_and_the_server_goes_on(server_socket: Path, tmp_path: Path) -> None:
    import socket

    for junk in (b"\x00" * 8 + b"{}", preload._HEADER.pack(5) + b"[1,2]", b"\xff" * 8):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(30)
            conn.connect(str(server_socket))
            conn.sendall(junk)
            conn.shutdown(socket.SHUT_WR)
            reply = conn.recv(4096)
        assert b"error" in reply
    process, _, _ = spawn(server_socket, tmp_path, ["exit", "0"])
    assert process.wait(timeout=60) == 0


def test_a_kept_descriptor_stays_open_until_the_service_exits(server_socket: Path, tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    try:
        process, out, _ = spawn(server_socket, tmp_path, ["wait"], keep_fds=[write_end])
        os.close(write_end)
        wait_until(out.exists, 60, "the waiting target to start")
        os.set_blocking(read_end, False)
        with pytest.raises(BlockingIOError):  # the service holds the write end: no EOF yet
            os.read(read_end, 1)
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert os.read(read_end, 1) == b""  # EOF: the last holder has exited
    finally:
        os.close(read_end)


def test_a_service_whose_client_goes_away_gets_sigterm(server_socket: Path, tmp_path: Path) -> None:
    process, out, _ = spawn(server_socket, tmp_path, ["wait"])
    wait_until(out.exists, 60, "the waiting target to start")
    process._conn.close()  # as when `fleetrl up` is killed: the kernel closes its end
    terminated = out.with_name(out.name + ".terminated")
    wait_until(terminated.exists, 60, "the service to get SIGTERM")


def test_services_get_sigterm_when_the_server_dies(tmp_path: Path) -> None:
    socket_path = tmp_path / "own.sock"
    server = start_server(socket_path, "json")
    try:
        process, out, _ = spawn(socket_path, tmp_path, ["wait"])
        wait_until(out.exists, 60, "the waiting target to start")
        server.kill()
        server.wait(timeout=30)
        wait_until(out.with_name(out.name + ".terminated").exists, 60, "the service to get SIGTERM")
        assert process.wait(timeout=60) == -signal.SIGTERM  # the server could not say: read as its PDEATHSIG
    finally:
        if server.poll() is None:
            stop(server)


def test_the_supervisor_forks_through_the_server_and_falls_back_without_it(server_socket: Path, tmp_path: Path) -> None:
    with_server = Supervisor(tmp_path / "a", env={preload.SOCKET_ENV: str(server_socket)})
    child = with_server.start("probe", "no-such-service", [], ready=False)
    assert isinstance(child.process, preload.PreloadedProcess)
    assert child.process.wait(timeout=60) == 2
    assert "no-such-service" in child.log_path.read_text()

    without = Supervisor(tmp_path / "b", env={preload.SOCKET_ENV: str(tmp_path / "no-such.sock")})
    child = without.start("probe", "no-such-service", [], ready=False)
    assert isinstance(child.process, subprocess.Popen)
    assert child.process.wait(timeout=60) == 2
    assert "(started as a new process: the preload server" in child.log_path.read_text()


def run_pids(kind: str, tmp_path: Path) -> list[int]:
    """PIDs of the `fleetrl serve <kind>` processes whose command line names `tmp_path` (config or ready file)."""
    out = subprocess.run(["pgrep", "-f", f"fleetrl serve {kind} .*{tmp_path}/"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.slow
@pytest.mark.parametrize("start", ["preload", "fresh"])
def test_services_of_a_killed_fleetrl_up_stop_however_they_were_started(
    start: str, tmp_path: Path, tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL `fleetrl up` mid-run: every service it started exits (forked ones: the server sees the connection
    close; fresh ones: PR_SET_PDEATHSIG). The slow lane's runs are forked (tests/conftest.py); this checks that too."""
    if start == "fresh":
        monkeypatch.delenv(preload.SOCKET_ENV, raising=False)
    else:
        assert os.environ.get(preload.SOCKET_ENV), "the slow lane's preload server is not running (tests/conftest.py)"
    config = write_run(tmp_path, tiny_model_dir, {"max_steps": 200}, {})
    run_dir = tmp_path / "run"
    proc = start_fleetrl_up(config)
    try:
        wait_for_steps(proc, run_dir, 1)
        kinds = ("controller", "gateway", "trainer", "inference")
        pids = {kind: run_pids(kind, tmp_path) for kind in kinds}
        assert all(pids.values()), pids  # found by their command lines, forked or not
        proc.kill()
        proc.communicate(timeout=60)
        wait_until(lambda: not any(run_pids(k, tmp_path) for k in kinds), 60, "every service to exit", poll_s=0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    for log in [run_dir / f"{name}.log" for name in ("controller", "gateway-0", "trainer", "inference-0")]:
        text = log.read_text()
        assert ("(forked by the preload server" in text) == (start == "preload"), log.name
        assert "(started as a new process" not in text, log.name
