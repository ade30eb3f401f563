"""A warm interpreter that `fleetrl up` forks its services from, instead of starting a fresh Python for each.

Every service that holds a model (trainer, hf replica, reference) imports torch and transformers before it does
anything: about 4-6 s of CPU per process on this 2-core machine, so a `fleetrl up` of three such services spends
more time importing than training a tiny model for a few steps. A preload server imports those libraries once and
forks each service from itself; the forked process then runs `python -m fleetrl serve ...` exactly as a fresh one
would (same argv, environment, working directory, log file, process group and process title).

    python -m fleetrl.up.preload --socket /tmp/fleetrl-preload.sock &       # once; imports torch, transformers
    FLEETRL_PRELOAD_SOCKET=/tmp/fleetrl-preload.sock fleetrl up run.toml    # its services are forked from it

It is opt-in (nothing uses it unless FLEETRL_PRELOAD_SOCKET names a live server) and meant for one machine where
many runs start, a developer's loop or the test suite (tests/conftest.py starts one for the slow lane). A service
is started the ordinary way (a fresh `subprocess.Popen`) when the server does not answer, for a launcher such as
torchrun, or when its environment differs from the server's in a variable the preloaded libraries read at import
(`env_blockers`): the fork would otherwise run with settings the libraries never saw. Per-service thread counts
(OMP_NUM_THREADS) are applied with `torch.set_num_threads`, since torch reads that variable only at its start.

The server imports third-party libraries only, never fleetrl's own modules, so a change to fleetrl is seen by the
next run without restarting it; restart it after upgrading torch or transformers. It never runs torch code itself
(no thread pool is started before a fork).

Wire (a Unix stream socket, one connection per service): the client sends an 8-byte length with the run's
descriptors attached (SCM_RIGHTS: the log file, then the descriptors the child keeps, e.g. the run folder's lock),
then the request as JSON. The server answers one JSON line, `{"pid": N}` or `{"error": "..."}`, and when the
service ends, `{"returncode": N}` (negative: killed by that signal). If the client goes away first (`fleetrl up`
killed, even by SIGKILL) the server sends the service SIGTERM, as the ordinary start's PR_SET_PDEATHSIG does; if the
server dies, each service gets SIGTERM through its own PR_SET_PDEATHSIG.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fleetrl.up.parent_death import die_with_parent

SOCKET_ENV = "FLEETRL_PRELOAD_SOCKET"
DEFAULT_MODULES = (
    "numpy",
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "safetensors.torch",
    "datasets",
)
# Variables the preloaded libraries (or the interpreter itself) read while starting: a service whose value differs
# from the server's is started fresh. OMP_NUM_THREADS is read by torch at import too, but applied after the fork
# (`_apply_threads`); CUDA_VISIBLE_DEVICES is read only when CUDA initialises, which the server never does.
IMPORT_TIME_PREFIXES = (
    "PYTHON",
    "LD_",
    "TORCH",
    "PYTORCH",
    "TRANSFORMERS",
    "HF_",
    "HUGGINGFACE",
    "TOKENIZERS",
    "MKL",
    "KMP_",
    "GOMP",
    "OMP_",
    "CUDA",
    "XDG_CACHE_HOME",
    "HOME",
    "TMPDIR",
    "LANG",
    "LC_",
)
APPLIED_AFTER_FORK = frozenset({"OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "PYTHONPATH"})
_HEADER = struct.Struct("!Q")
MAX_REQUEST_BYTES = 64 << 20
MAX_FDS = 32


class PreloadUnavailable(RuntimeError):
    """The preload server did not start this service (the caller starts it the ordinary way)."""


def env_blockers(
    server_env: Mapping[str, str], env: Mapping[str, str], set_by_imports: Mapping[str, str] | None = None
) -> list[str]:
    """The variables that differ between the server's environment (as it started) and a service's `env` (set,
    changed or unset) and that a preloaded library or the interpreter reads at start-up, so the service must start
    fresh. A variable the preloaded imports set themselves (`set_by_imports`, e.g. TORCHINDUCTOR_CACHE_DIR) is no
    difference when `env` lacks it or has the same value: a fresh process's imports would set it so too."""
    imported = set_by_imports or {}
    keys = set(server_env) | set(env)
    differ = [k for k in keys if server_env.get(k) != env.get(k) and k not in APPLIED_AFTER_FORK]
    differ = [k for k in differ if not (k in imported and env.get(k, imported[k]) == imported[k])]
    return sorted(k for k in differ if k.startswith(IMPORT_TIME_PREFIXES))


def child_env(env: Mapping[str, str], set_by_imports: Mapping[str, str]) -> dict[str, str]:
    """The service's environment after its imports: what it was given, plus what the preloaded imports set (and
    would have set in a fresh process) where it was not given."""
    return {**set_by_imports, **env}


def child_sys_path(server_path: Sequence[str], server_pythonpath: str, pythonpath: str, cwd: str) -> list[str]:
    """`sys.path` of `python -m ...` started in `cwd` with PYTHONPATH `pythonpath`, given the server's own path,
    started from a script or `-m` with `server_pythonpath`: [cwd, *pythonpath, *the server's site path]."""
    server_entries = [p for p in server_pythonpath.split(os.pathsep) if p]
    rest = list(server_path[1:])
    for entry in server_entries:  # the server's PYTHONPATH entries follow its sys.path[0]
        if rest[:1] == [entry]:
            rest.pop(0)
    wanted = [p for p in pythonpath.split(os.pathsep) if p]
    return [cwd, *wanted, *rest]


def parse_module_argv(argv: Sequence[str], executable: str) -> tuple[str, list[str]]:
    """(module, arguments) of `[executable, "-m", module, *arguments]`; ValueError for any other command."""
    if len(argv) < 3 or argv[0] != executable or argv[1] != "-m":
        raise ValueError(f"the preload server starts `{executable} -m MODULE ...` only, not {list(argv)[:3]}")
    return argv[2], list(argv[3:])


def exit_code(status: int) -> int:
    """subprocess's returncode for a `waitpid` status: the exit code, or minus the signal that killed it."""
    return os.waitstatus_to_exitcode(status)


# ----------------------------------------------------------------------------------------------------- client side


class PreloadedProcess:
    """A service forked by the preload server, with the part of `subprocess.Popen` that the supervisor uses: `pid`,
    `args`, `returncode`, `poll()` and `wait(timeout)`. It is not this process's child: its exit code comes from
    the server over the connection, which this object keeps open (closing it stops the service)."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str]) -> None:
        self._conn = conn
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._buffer = b""

    def _read(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        self._conn.settimeout(timeout)
        try:
            chunk = self._conn.recv(4096)
        except (TimeoutError, BlockingIOError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the server went away before saying: the service got SIGTERM through PR_SET_PDEATHSIG
            self.returncode = self._lost_code()
            self._conn.close()
            return
        self.take(chunk)

    def take(self, data: bytes) -> None:
        """Data from the server after the pid: the returncode line, once the service has ended."""
        self._buffer += data
        if self.returncode is None and b"\n" in self._buffer:
            line = self._buffer.split(b"\n", 1)[0]
            self.returncode = int(json.loads(line)["returncode"])
            self._conn.close()

    def _lost_code(self) -> int:
        """The code of a service whose server died: -SIGTERM once it is gone (it cannot be reaped from here)."""
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and _alive(self.pid):
            time.sleep(0.05)
        return -signal.SIGTERM

    def poll(self) -> int | None:
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read(left)
        return self.returncode


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def spawn(
    socket_path: str | Path,
    argv: list[str],
    env: Mapping[str, str],
    cwd: str,
    log_fd: int,
    keep_fds: Sequence[int] = (),
    timeout_s: float = 30.0,
) -> PreloadedProcess:
    """Ask the server at `socket_path` to start `argv` (`python -m MODULE ...`) with `env` in `cwd`, its output in
    `log_fd`, keeping `keep_fds` open; raises PreloadUnavailable when it does not (the caller then starts it the
    ordinary way)."""
    request = json.dumps({"argv": argv, "env": dict(env), "cwd": cwd}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout_s)
    try:
        conn.connect(str(socket_path))
        socket.send_fds(conn, [_HEADER.pack(len(request))], [log_fd, *keep_fds])
        conn.sendall(request)
        line, rest = _read_line(conn)
        reply = json.loads(line)
    except (OSError, ValueError) as exc:
        conn.close()
        raise PreloadUnavailable(f"the preload server at {socket_path} did not answer: {exc}") from None
    if not isinstance(reply, dict) or "pid" not in reply:
        conn.close()
        error = reply.get("error", reply) if isinstance(reply, dict) else reply
        raise PreloadUnavailable(f"the preload server at {socket_path} refused: {error}")
    process = PreloadedProcess(conn, int(reply["pid"]), list(argv))
    process.take(rest)  # a service that ended at once: its returncode came with the pid
    return process


def _read_line(conn: socket.socket) -> tuple[bytes, bytes]:
    """The first line on `conn`, and whatever came after it."""
    data = b""
    while b"\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            raise ConnectionError("connection closed before a reply")
        data += chunk
    line, rest = data.split(b"\n", 1)
    return line, rest


# ----------------------------------------------------------------------------------------------------- server side


class PreloadServer:
    """Forks services from this interpreter (single-threaded: one selector loop; SIGCHLD wakes it)."""

    def __init__(self, socket_path: str | Path, modules: Sequence[str] = DEFAULT_MODULES) -> None:
        self.socket_path = Path(socket_path)
        self.modules = list(modules)
        self.env = dict(os.environ)
        self.pythonpath = os.environ.get("PYTHONPATH", "")
        self.set_by_imports: dict[str, str] = {}
        self.children: dict[int, socket.socket] = {}  # pid -> the client's connection
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = -1, -1
        self._stopping = False

    def preload(self) -> float:
        start = time.monotonic()
        for name in self.modules:
            __import__(name)
        self.set_by_imports = {k: v for k, v in os.environ.items() if self.env.get(k) != v}
        return time.monotonic() - start

    def bind(self) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = self.socket_path.with_name(self.socket_path.name + f".{os.getpid()}.tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        listener.bind(str(tmp))
        os.chmod(tmp, 0o600)  # only this user may ask for processes
        listener.listen(64)
        os.replace(tmp, self.socket_path)  # clients see the path only once it accepts
        self._listener = listener
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self._wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")

    def _on_stop(self, *_: Any) -> None:
        self._stopping = True

    def serve(self) -> None:
        while not self._stopping:
            for key, _ in self._selector.select(timeout=1.0):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_r, 512):
                            pass
                else:
                    self._client_event(key.data)
            self._reap()
        self.close()

    def close(self) -> None:
        for pid in list(self.children):  # each would get SIGTERM from its PR_SET_PDEATHSIG anyway
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if self._listener is not None:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            self._listener.close()

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        fds: list[int] = []
        try:
            conn.settimeout(10.0)
            request, fds = _read_request(conn)
            pid = self._fork(request, fds, conn)
        except Exception as exc:  # a bad request is refused; the server goes on
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode() + b"\n")
            conn.close()
            return
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.children[pid] = conn
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:
            self._client_gone(pid)
            return
        conn.setblocking(False)
        self._selector.register(conn, selectors.EVENT_READ, pid)

    def _client_event(self, pid: int) -> None:
        conn = self.children.get(pid)
        if conn is None:
            return
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._client_gone(pid)

    def _client_gone(self, pid: int) -> None:
        """The client closed its connection (or died) while its service runs: stop the service, as
        PR_SET_PDEATHSIG does for a service started the ordinary way. Once: the connection is no longer watched."""
        conn = self.children.get(pid)
        if conn is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn)
            with contextlib.suppress(OSError):
                conn.setblocking(True)
                conn.settimeout(5.0)
                conn.sendall(json.dumps({"returncode": exit_code(status)}).encode() + b"\n")
            conn.close()

    def _fork(self, request: dict[str, Any], fds: list[int], conn: socket.socket) -> int:
        argv = [str(a) for a in request["argv"]]
        env = {str(k): str(v) for k, v in dict(request["env"]).items()}
        cwd = str(request["cwd"])
        module, _ = parse_module_argv(argv, sys.executable)
        if blockers := env_blockers(self.env, env, self.set_by_imports):
            raise ValueError(f"environment differs from the server's in {', '.join(blockers)}")
        if not fds:
            raise ValueError("no log file descriptor")
        if not os.path.isdir(cwd):
            raise ValueError(f"no such directory: {cwd}")
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid:
            return pid
        try:  # the child: never returns
            _drop(conn)
            self._become(argv, module, env, cwd, fds, parent)
        except BaseException:  # nothing may escape into the server's loop
            traceback.print_exc()
            os._exit(1)
        os._exit(0)  # unreachable: _become exits

    def _become(self, argv: list[str], module: str, env: dict[str, str], cwd: str, fds: list[int], parent: int) -> None:
        os.setsid()  # its own process group, as `start_new_session=True` gives the ordinary start
        _die_with(parent)
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self._selector.close()
        for conn in self.children.values():
            _drop(conn)
        if self._listener is not None:
            _drop(self._listener)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        log_fd, keep = fds[0], fds[1:]
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        for fd in {devnull, log_fd} - {0, 1, 2}:
            os.close(fd)
        for fd in keep:
            os.set_inheritable(fd, True)  # as pass_fds: a process the service starts inherits it too
        # buffered as a fresh interpreter's streams on a file: stdout by blocks (unless PYTHONUNBUFFERED, which the
        # server shares), stderr by lines
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        sys.stdout.reconfigure(line_buffering=False, write_through=unbuffered)  # type: ignore[union-attr]
        sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        _set_title(argv)  # before the environment changes: setproctitle finds its room from the process's environ
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(child_env(env, self.set_by_imports))
        sys.path[:] = child_sys_path(sys.path, self.pythonpath, env.get("PYTHONPATH", ""), cwd)
        _apply_threads(env)
        _reseed()
        _run_module(module, argv[3:])

    def run(self) -> None:
        took = self.preload()
        self.bind()
        print(f"fleetrl preload: {len(self.modules)} modules in {took:.1f}s; serving on {self.socket_path}", flush=True)
        self.serve()


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    header, fds, _flags, _addr = socket.recv_fds(conn, _HEADER.size, MAX_FDS)
    if len(header) != _HEADER.size:
        raise ValueError("short request header")
    (size,) = _HEADER.unpack(header)
    if size > MAX_REQUEST_BYTES:
        raise ValueError(f"request of {size} bytes")
    body = b""
    while len(body) < size:
        chunk = conn.recv(min(1 << 20, size - len(body)))
        if not chunk:
            raise ValueError("request cut short")
        body += chunk
    request = json.loads(body)
    if not isinstance(request, dict) or not {"argv", "env", "cwd"} <= set(request):
        raise ValueError("a request needs argv, env and cwd")
    return request, fds


def _drop(sock: socket.socket) -> None:
    """Close a server socket in the child without leaving a Python object that could close the number again."""
    fd = sock.detach()
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)


def _die_with(parent: int) -> None:
    """SIGTERM when the server dies (PR_SET_PDEATHSIG), and exit now if it already has."""
    die_with_parent()
    if os.getppid() != parent:
        os._exit(1)


def _apply_threads(env: Mapping[str, str]) -> None:
    """OMP_NUM_THREADS as torch would have read it at import (it reads the variable only then). Set only when it
    differs from the count the server's import gave: `torch.set_num_threads` also turns MKL's dynamic threading
    off, which a fresh process with that count would have left on."""
    value = env.get("OMP_NUM_THREADS")
    if value and "torch" in sys.modules:
        torch = sys.modules["torch"]
        with contextlib.suppress(ValueError):
            wanted = max(1, int(value))
            if wanted != torch.get_num_threads():
                torch.set_num_threads(wanted)


def _reseed() -> None:
    """Fresh seeds for the global generators a fresh process would seed from the OS (`random` reseeds itself)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _set_title(argv: Sequence[str]) -> None:
    """The command line `ps` and `pgrep -f` show: the one an ordinary start would have."""
    import setproctitle

    setproctitle.setproctitle(" ".join(argv))


def _run_module(module: str, args: list[str]) -> None:
    """`python -m module args`, ending as the interpreter would: non-daemon threads joined, atexit run."""
    import atexit
    import threading

    sys.argv = [module, *args]
    code: int = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _system_exit_code(exc)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:  # the interpreter prints it and exits 1
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter does before atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _system_exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetrl.up.preload", description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", required=True, help="the Unix socket to serve on (clients: FLEETRL_PRELOAD_SOCKET)")
    parser.add_argument(
        "--modules", default=",".join(DEFAULT_MODULES), help="comma-separated modules to import before serving"
    )
    args = parser.parse_args(argv)
    try:
        import setproctitle  # noqa: F401 - the services' process titles need it
    except ImportError:
        print("fleetrl preload: needs the setproctitle package (pip install setproctitle)", file=sys.stderr)
        return 2
    server = PreloadServer(args.socket, [m for m in args.modules.split(",") if m])
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
