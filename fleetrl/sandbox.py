"""A sandbox for code rewards: run untrusted, model-written Python with limits and out of reach of the run.

    from fleetrl.sandbox import run_sandboxed

    result = await run_sandboxed(code, stdin="2 3\\n", timeout_s=10, cpu_s=5, memory_mb=256)
    reward = float(result.ok and result.stdout.strip() == "5")

Each call runs `code` as `main.py` (with any `files` beside it) in a fresh Python interpreter (`-I -S`: the standard
library only), in a fresh scratch directory that is its working directory and is deleted afterwards, with a scrubbed
environment (PATH, HOME, TMPDIR, LANG and what `env=` adds; never the run's `FLEETRL_AUTH_TOKEN` or anything else of
the caller's), a wall-clock limit (`timeout_s`: the whole sandbox is killed), a CPU-time limit (`cpu_s`:
RLIMIT_CPU), a memory limit (`memory_mb`: RLIMIT_AS), a process limit (`max_processes`: RLIMIT_NPROC, so a fork
bomb stops at it), a cap on each file it writes and on its output (`max_output_bytes`: the sandbox is killed past
it). The result says how it ended (`SandboxResult.reason`).

Two backends, chosen once per process (`isolation="auto"`, the default, or `FLEETRL_SANDBOX`), with a log line:

- `"bwrap"` (bubblewrap, Debian's `bubblewrap` package): new pid, network, IPC and UTS namespaces and a mount
  namespace that holds only a read-only /usr (and the interpreter's own prefix), a fresh /proc and /dev, and
  size-capped tmpfs for /tmp and the scratch directory (`scratch_mb`). No network at all (only its own loopback,
  which reaches none of the run's services); none of the host's files but those; killing the namespace's first
  process ends every process the code started. Run as root, the code runs as an otherwise unused uid (so the
  process limit is its own); otherwise in a user namespace whose process count is its own.
- `"process"` (the fallback when bwrap is missing or cannot start here): the same limits as rlimits, a fresh empty
  directory and the scrubbed environment, and the process group killed on timeout. It does NOT isolate the network,
  the filesystem (the code can read and write whatever the user it runs as can; as root it runs as an unused uid,
  so root-only files such as the run's `auth_token` are out of reach), nor other processes, and a process that
  leaves its process group (setsid) outlives a timeout unless it runs as that unused uid. Disk use is capped per
  file only. Use it for trusted code or where bwrap is installed.

`isolation="bwrap"` refuses to run (SandboxUnavailable) rather than fall back. The code can still fake its own
test results (it runs in the same interpreter as any test harness written beside it): score on what it cannot
forge, or run the checks in a second sandboxed call that only reads the first one's output.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import weakref
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)

Isolation = Literal["bwrap", "process"]
Reason = Literal["exited", "timeout", "cpu_limit", "memory_limit", "output_limit", "killed", "error"]
SANDBOX_ENV = "FLEETRL_SANDBOX"
SANDBOX_DIR = "/sandbox"  # the scratch directory's path inside bwrap
KILL_WAIT_S = 10.0  # after a kill, how long to wait for the processes and pipes to go
_ROOT_UID_RANGE = (1_000_000_000, 1_100_000_000)  # unused uids the code runs as when fleetrl runs as root
_FALLBACK_UID = 65534  # nobody, where the uid range is not mapped (a container with a narrow uid map)
_LAUNCH_ERROR = 125
# The code's interpreter: no PYTHON* variables, no user or site packages (the standard library only), no .pyc files;
# not -I, which would keep main.py's folder (and the files beside it) off sys.path.
_CODE_FLAGS = ("-E", "-s", "-S", "-B")
_NAME_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")

# Runs inside the sandbox before the code: limits, then (as root) another uid, then exec. Its argument is a JSON spec.
_LAUNCHER = r"""
import json, os, resource, sys
spec = json.loads(sys.argv[1])
try:
    nproc = spec["nproc"]
    if spec["nproc_relative"]:  # a plain process shares its uid's count (threads too): this many more than now
        uid = os.getuid()
        for p in os.listdir("/proc"):
            try:
                if p.isdigit() and os.stat("/proc/" + p).st_uid == uid:
                    nproc += len(os.listdir("/proc/%s/task" % p))
            except OSError:
                pass
    for name, soft, hard in spec["limits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if spec["uid"] is not None:
        os.setgroups([])
        try:
            os.setgid(spec["uid"]); os.setuid(spec["uid"])
        except OSError:
            os.setgid(spec["fallback_uid"]); os.setuid(spec["fallback_uid"])
    os.chdir(spec["cwd"])
    os.execve(spec["argv"][0], spec["argv"], spec["env"])
except Exception as exc:
    sys.stderr.write("fleetrl-sandbox: could not start the code: %r\n" % (exc,))
    sys.exit(125)
"""


class SandboxUnavailable(RuntimeError):
    """`isolation="bwrap"` asked for where bubblewrap is missing or cannot start."""


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed run ended.

    Attributes:
        stdout, stderr: its output (UTF-8, undecodable bytes replaced), each cut at `max_output_bytes`.
        exit_code: the exit status when it exited; None when a signal ended it.
        signal: the signal that ended it (SIGXCPU at the CPU limit, SIGKILL when killed), else None.
        reason: why it stopped: "exited" (by itself, any exit code), "timeout" (the wall clock: killed),
            "cpu_limit", "memory_limit" (an allocation failed: Python's MemoryError), "output_limit" (killed),
            "killed" (another signal), "error" (the sandbox could not start the code).
        detail: the same in words.
        isolation: the backend that ran it ("bwrap" or "process").
    """

    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None
    reason: Reason
    detail: str
    isolation: Isolation

    @property
    def ok(self) -> bool:
        """It exited by itself with status 0."""
        return self.reason == "exited" and self.exit_code == 0


_backend: Isolation | None = None
_probe_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()


def _bwrap_path() -> str | None:
    return shutil.which("bwrap")


async def sandbox_backend(isolation: str | None = None, *, refresh: bool = False) -> Isolation:
    """The backend `run_sandboxed` uses: `isolation` (or `FLEETRL_SANDBOX`): "bwrap", "process" or "auto" (bwrap
    where it runs here, probed once per process with a log line saying which and what it isolates)."""
    global _backend, _bwrap_problem, _said_process
    choice = (isolation if isolation is not None else os.environ.get(SANDBOX_ENV, "")).strip() or "auto"
    if choice not in ("auto", "bwrap", "process"):
        source = "isolation" if isolation is not None else SANDBOX_ENV
        raise ValueError(f"{source}: {choice!r} is not a sandbox backend; use 'auto', 'bwrap' or 'process'")
    if choice == "process":
        if not _said_process:
            _said_process = True
            log.warning("sandbox: plain processes, as asked (%s)", _NOT_ISOLATED)
        return "process"
    lock = _probe_locks.setdefault(asyncio.get_running_loop(), asyncio.Lock())  # one probe at a time per loop
    async with lock:
        if _backend is None or refresh:
            _bwrap_problem = await _probe_bwrap()
            _backend = "bwrap" if _bwrap_problem is None else "process"
            if _bwrap_problem is None:
                log.info("sandbox: bubblewrap (no network, only a read-only /usr and a scratch tmpfs, limits)")
            else:
                log.warning("sandbox: %s; plain processes instead (%s)", _bwrap_problem, _NOT_ISOLATED)
    if choice == "bwrap" and _backend != "bwrap":
        raise SandboxUnavailable(f"isolation='bwrap': {_bwrap_problem}")
    assert _backend is not None
    return _backend


_bwrap_problem: str | None = None
_said_process = False
_NOT_ISOLATED = (
    "rlimits, a fresh directory and a scrubbed environment, which do NOT isolate the network, the filesystem or "
    "other processes: apt-get install bubblewrap"
)


async def _probe_bwrap() -> str | None:
    """None where bwrap runs a sandbox here, else why not."""
    if _bwrap_path() is None:
        return "bubblewrap (bwrap) is not installed"
    result = await _run("print('ok')", {}, "", (), "bwrap", _Limits(30.0, 10.0, 256, 16, 1 << 16, 16), None, {})
    if result.ok and result.stdout == "ok\n":
        return None
    return f"bwrap cannot start a sandbox here ({result.detail}: {result.stderr.strip()[-300:]})"


@dataclass(frozen=True)
class _Limits:
    timeout_s: float
    cpu_s: float
    memory_mb: int
    max_processes: int
    max_output_bytes: int
    scratch_mb: int


async def run_sandboxed(
    code: str,
    *,
    stdin: str | bytes = "",
    files: dict[str, str | bytes] | None = None,
    args: tuple[str, ...] | list[str] = (),
    timeout_s: float = 10.0,
    cpu_s: float | None = None,
    memory_mb: int = 512,
    max_processes: int = 32,
    max_output_bytes: int = 1 << 20,
    scratch_mb: int = 64,
    env: dict[str, str] | None = None,
    isolation: str | None = None,
    python: str | None = None,
) -> SandboxResult:
    """Run `code` (Python source, as `main.py`) in the sandbox and return how it ended (module docstring).

    `stdin` is its standard input; `files` are written beside it (plain names: no folders); `args` are its
    `sys.argv[1:]`; `cpu_s` defaults to `timeout_s`; `scratch_mb` caps its scratch directory (bwrap) or each file
    it writes (process); `env` adds variables to the scrubbed environment; `isolation` is "auto", "bwrap" or
    "process" (default `FLEETRL_SANDBOX`, else "auto"); `python` is the interpreter (default this one's)."""
    if not isinstance(code, str):
        raise TypeError(f"code: Python source as a str, got {type(code).__name__}")
    cpu = timeout_s if cpu_s is None else cpu_s
    for name, value in (("timeout_s", timeout_s), ("cpu_s", cpu)):
        if not value > 0:
            raise ValueError(f"{name}: must be > 0 seconds, got {value!r}")
    for name, value, least in (
        ("memory_mb", memory_mb, 32),
        ("max_processes", max_processes, 1),
        ("max_output_bytes", max_output_bytes, 1),
        ("scratch_mb", scratch_mb, 1),
    ):
        if not value >= least:
            raise ValueError(f"{name}: must be >= {least}, got {value!r}")
    all_files = {"main.py": code}
    for name, content in (files or {}).items():
        if name in ("", ".", "..", "main.py") or not set(name) <= _NAME_OK:
            raise ValueError(f"files: {name!r} is not a plain file name (letters, digits, '_.-'; not main.py)")
        all_files[name] = content
    for key in env or {}:
        if not key or "=" in key:
            raise ValueError(f"env: {key!r} is not a variable name")
    backend = await sandbox_backend(isolation)
    limits = _Limits(float(timeout_s), float(cpu), int(memory_mb), int(max_processes), int(max_output_bytes),
                     int(scratch_mb))  # fmt: skip
    data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
    return await _run(code, all_files, data, tuple(args), backend, limits, python, dict(env or {}))


def run_sandboxed_sync(code: str, **options: object) -> SandboxResult:
    """`run_sandboxed` from synchronous code (not from inside a running event loop)."""
    return asyncio.run(run_sandboxed(code, **options))  # type: ignore[arg-type]


def _interpreter(python: str | None, backend: Isolation) -> tuple[str, str]:
    """(the interpreter's real path, its prefix: the folder holding bin/ and lib/). A plain process under root runs
    as an unused uid, which must reach the interpreter and its library: this one's if it can (not under /root),
    else the system's python3."""
    path = os.path.realpath(python or sys.executable)
    prefix = sys.base_prefix if python is None else os.path.dirname(os.path.dirname(path))
    if backend == "process" and os.geteuid() == 0 and not _world_reachable(os.path.realpath(prefix)):
        system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
        if python is not None or system is None or not _world_reachable(os.path.realpath(system)):
            raise SandboxUnavailable(
                f"python: {path} (prefix {prefix}) is not readable by the unprivileged uid a plain-process sandbox "
                "runs as under root, and no system python3 is; install bubblewrap or pass python= one that is"
            )
        path = os.path.realpath(system)
        prefix = os.path.dirname(os.path.dirname(path))
    return path, os.path.realpath(prefix)


def _world_reachable(path: str) -> bool:
    """Whether any user can traverse to `path` (every folder above it has o+x)."""
    try:
        return all(os.stat(p).st_mode & 0o001 for p in [*_ancestors(path), path])
    except OSError:
        return False


def _base_env(home: str, extra: dict[str, str]) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", **extra}


def _launcher_spec(argv: list[str], env: dict[str, str], cwd: str, limits: _Limits, relative: bool) -> str:
    cpu = max(1, math.ceil(limits.cpu_s))  # RLIMIT_CPU counts whole seconds
    memory = limits.memory_mb << 20
    as_root = os.geteuid() == 0
    spec = {
        "limits": [
            ["RLIMIT_CPU", cpu, cpu + 1],  # SIGXCPU at cpu_s, SIGKILL a second later if it is caught
            ["RLIMIT_AS", memory, memory],
            ["RLIMIT_FSIZE", limits.scratch_mb << 20, limits.scratch_mb << 20],
            ["RLIMIT_NOFILE", 256, 256],
            ["RLIMIT_CORE", 0, 0],
        ],
        "nproc": limits.max_processes,
        "nproc_relative": relative and not as_root,
        "uid": random.randrange(*_ROOT_UID_RANGE) if as_root else None,
        "fallback_uid": _FALLBACK_UID,
        "cwd": cwd,
        "argv": argv,
        "env": env,
    }
    return json.dumps(spec)


def _bwrap_command(
    python: str, prefix: str, spec: str, file_fds: dict[str, int], info_fd: int, scratch_mb: int
) -> list[str]:
    cmd = [_bwrap_path() or "bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
    cmd += ["--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv", "--info-fd", str(info_fd)]
    if os.geteuid() == 0:  # the launcher switches to an unused uid (needs these two, lost with the switch)
        cmd += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:  # a user namespace: its process count is its own
        cmd += ["--unshare-user", "--disable-userns"]
    cmd += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
    for path in {prefix, os.path.dirname(os.path.dirname(python))}:
        if not (path + "/").startswith("/usr/"):
            parents = [p for p in _ancestors(path) if p != "/"]
            for parent in parents:  # created traversable (bwrap would copy the host's mode: /root is 0700)
                cmd += ["--perms", "0755", "--dir", parent]
            cmd += ["--ro-bind", path, path]
    cmd += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache", "--proc", "/proc", "--dev", "/dev"]
    cmd += ["--perms", "1777", "--size", str(16 << 20), "--tmpfs", "/tmp"]
    cmd += ["--perms", "1777", "--size", str(scratch_mb << 20), "--tmpfs", SANDBOX_DIR]
    for name, fd in file_fds.items():
        cmd += ["--perms", "0644", "--file", str(fd), f"{SANDBOX_DIR}/{name}"]
    cmd += ["--chdir", SANDBOX_DIR, "--", python, "-I", "-S", "-c", _LAUNCHER, spec]
    return cmd


def _ancestors(path: str) -> list[str]:
    """The folders above `path`, outermost first."""
    parents = []
    while (parent := os.path.dirname(path)) != path:
        parents.append(parent)
        path = parent
    return parents[::-1]


def _memfd(name: str, content: str | bytes) -> int:
    fd = os.memfd_create(name, 0)  # inheritable: bwrap reads it as --file
    os.write(fd, content.encode() if isinstance(content, str) else content)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


async def _run(
    code: str,
    files: dict[str, str | bytes],
    stdin: bytes,
    args: tuple[str, ...],
    backend: Isolation,
    limits: _Limits,
    python: str | None,
    env: dict[str, str],
) -> SandboxResult:
    files = files or {"main.py": code}
    interpreter, prefix = _interpreter(python, backend)
    fds: list[int] = []
    scratch: str | None = None
    info_read: int | None = None
    try:
        if backend == "bwrap":
            file_fds = {name: _memfd(name, content) for name, content in files.items()}
            fds += file_fds.values()
            info_read, info_write = os.pipe()
            fds.append(info_write)
            argv = [interpreter, *_CODE_FLAGS, f"{SANDBOX_DIR}/main.py", *args]
            spec = _launcher_spec(argv, _base_env(SANDBOX_DIR, env), SANDBOX_DIR, limits, relative=False)
            cmd = _bwrap_command(interpreter, prefix, spec, file_fds, info_write, limits.scratch_mb)
        else:
            scratch = tempfile.mkdtemp(prefix="fleetrl-sandbox-")  # 0700: as root, '..' is out of reach too
            work = os.path.join(scratch, "work")
            os.mkdir(work)
            for name, content in files.items():
                with open(os.path.join(work, name), "wb") as f:
                    f.write(content.encode() if isinstance(content, str) else content)
            spec = _launcher_spec(
                [interpreter, *_CODE_FLAGS, os.path.join(work, "main.py"), *args],
                _base_env(work, env),
                work,
                limits,
                relative=True,
            )
            uid = json.loads(spec)["uid"]
            if uid is not None:  # the unused uid owns its directory, and nothing else
                os.chmod(scratch, 0o711)  # it may pass through to work/, not list or write here
                for path in [work, *(os.path.join(work, n) for n in files)]:
                    os.chown(path, uid, uid)
            cmd = [interpreter, "-I", "-S", "-c", _LAUNCHER, spec]
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=_base_env(scratch, {}) if scratch is not None else {"PATH": "/usr/bin:/bin"},
            start_new_session=True,
            pass_fds=tuple(fds),
        )
        for fd in fds:
            os.close(fd)
        fds = []
        return await _supervise(proc, stdin, limits, backend, info_read, json.loads(spec)["uid"])
    finally:
        for fd in fds:
            os.close(fd)
        if info_read is not None:
            os.close(info_read)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


async def _read_capped(stream: asyncio.StreamReader, cap: int, overflow: asyncio.Event) -> bytes:
    kept: list[bytes] = []
    size = 0
    while data := await stream.read(1 << 16):
        if size < cap:
            kept.append(data[: cap - size])
        size += len(data)
        if size > cap:
            overflow.set()
    return b"".join(kept)


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        if data:
            proc.stdin.write(data)
            await proc.stdin.drain()
        proc.stdin.close()


async def _supervise(
    proc: asyncio.subprocess.Process,
    stdin: bytes,
    limits: _Limits,
    backend: Isolation,
    info_read: int | None,
    uid: int | None,
) -> SandboxResult:
    assert proc.stdout is not None and proc.stderr is not None
    overflow = asyncio.Event()
    readers = asyncio.gather(
        _read_capped(proc.stdout, limits.max_output_bytes, overflow),
        _read_capped(proc.stderr, limits.max_output_bytes, overflow),
    )
    feeder = asyncio.ensure_future(_feed(proc, stdin))
    exited = asyncio.ensure_future(proc.wait())
    overflowed = asyncio.ensure_future(overflow.wait())
    done, _ = await asyncio.wait({exited, overflowed}, timeout=limits.timeout_s, return_when=asyncio.FIRST_COMPLETED)
    stopped: Reason | None = None
    if exited not in done:
        stopped = "output_limit" if overflow.is_set() else "timeout"
    overflowed.cancel()
    # Killed on a limit, or exited: either way nothing it started outlives the call (in bwrap the namespace's end
    # does it; a plain process's group, and as root its uid, are killed here).
    _kill(proc, backend, info_read, uid, everything=stopped is not None)
    try:
        await asyncio.wait_for(asyncio.shield(exited), KILL_WAIT_S)
        out, err = await asyncio.wait_for(readers, KILL_WAIT_S)
    except TimeoutError:  # a plain process that left its group still holds the pipes
        readers.cancel()
        out, err = b"", b"fleetrl-sandbox: its output pipes stayed open after the kill\n"
        log.warning("sandbox: a process outlived the kill (backend %s) and holds its output open", backend)
    feeder.cancel()
    await asyncio.gather(feeder, return_exceptions=True)
    if not exited.done():
        exited.cancel()
    if overflow.is_set() and stopped is None:
        stopped = "output_limit"
    return _result(proc.returncode, out, err, stopped, limits, backend)


def _kill(
    proc: asyncio.subprocess.Process, backend: Isolation, info_read: int | None, uid: int | None, everything: bool
) -> None:
    if backend == "bwrap" and everything and info_read is not None:
        child = _bwrap_child_pid(info_read)
        if child is not None:  # the namespace's first process: the kernel ends every process in it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)
    if everything or backend == "process":
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    if backend == "process" and uid is not None:
        _kill_uid(uid)


def _bwrap_child_pid(info_read: int) -> int | None:
    os.set_blocking(info_read, False)
    try:
        text = os.read(info_read, 1 << 16).decode()
        return int(json.loads(text)["child-pid"])
    except (BlockingIOError, ValueError, KeyError):
        return None


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` (the unused uid a plain-process sandbox runs as under root), until none is
    left (bounded: a process forking as fast as it is killed stops at its process limit)."""
    for _ in range(100):
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    if os.stat(f"/proc/{entry}").st_uid == uid:
                        pids.append(int(entry))
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _result(
    returncode: int | None, out: bytes, err: bytes, stopped: Reason | None, limits: _Limits, backend: Isolation
) -> SandboxResult:
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    exit_code: int | None = returncode
    sig: int | None = None
    if returncode is not None and returncode < 0:
        exit_code, sig = None, -returncode
    elif backend == "bwrap" and returncode is not None and 128 < returncode < 128 + signal.NSIG:
        exit_code, sig = None, returncode - 128  # bwrap reports a signal's end as 128 + the signal
    reason: Reason
    if stopped == "timeout":
        reason, detail = "timeout", f"killed at the wall-clock limit of {limits.timeout_s:g} s"
    elif stopped == "output_limit":
        reason, detail = "output_limit", f"killed: wrote more than {limits.max_output_bytes} bytes of output"
    elif sig == signal.SIGXCPU:
        reason, detail = "cpu_limit", f"stopped at the CPU-time limit of {limits.cpu_s:g} s (SIGXCPU)"
    elif sig == signal.SIGKILL:
        reason, detail = "killed", "SIGKILL: past the CPU-time hard limit (cpu_s + 1 s), or the kernel's OOM killer"
    elif sig is not None:
        reason, detail = "killed", f"ended by signal {sig} ({signal.Signals(sig).name})"
    elif exit_code == _LAUNCH_ERROR and stderr.startswith("fleetrl-sandbox:"):
        reason, detail = "error", stderr.strip()
    elif exit_code and "MemoryError" in stderr[-2000:]:
        reason, detail = "memory_limit", f"an allocation failed at the memory limit of {limits.memory_mb} MiB"
    else:
        reason, detail = "exited", f"exited with status {exit_code}"
    return SandboxResult(stdout, stderr, exit_code, sig, reason, detail, backend)
