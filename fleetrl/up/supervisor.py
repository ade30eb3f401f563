"""Child processes of `fleetrl up`: start with logs in files, wait for ready files, stop cleanly, show log tails."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fleetrl.ready_file import wait_ready_file
from fleetrl.up import preload
from fleetrl.up.parent_death import die_with_parent


class ServiceProcess(Protocol):
    """What the supervisor needs of a child: a `subprocess.Popen`, or a service forked by the preload server
    (fleetrl/up/preload.py)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class Child:
    name: str
    kind: str
    argv: list[str]
    log_path: Path
    process: ServiceProcess
    ready_file: Path | None = None
    info: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # added to the supervisor's environment (a restart reuses it)

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class Supervisor:
    """Starts `python -m fleetrl serve ...` children and stops them all (SIGTERM, then SIGKILL)."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None, keep_fds: Sequence[int] = ()) -> None:
        """`keep_fds`: descriptors every child inherits (the run's folder lock, held until the last one exits)."""
        self.log_dir = log_dir
        self.keep_fds = tuple(keep_fds)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self._reaped: set[int] = set()  # ids of the exited children whose process group was killed
        self.env = {**os.environ, **(env or {})}

    def start(
        self,
        name: str,
        kind: str,
        args: list[str],
        ready: bool = True,
        *,
        env: dict[str, str] | None = None,
        nproc: int = 1,
        launcher: list[str] | None = None,
        ready_name: str | None = None,
    ) -> Child:
        """Start `fleetrl serve <kind> args` (under torchrun with `nproc` ranks when above 1, or under `launcher`,
        e.g. `torchrun_argv(...)` of one node of several), with `env` added to the supervisor's environment. The
        ready file is `ready/<ready_name or name>.json` (the agents of one multi-node service share one: whichever
        holds rank 0 writes it)."""
        ready_file = self.log_dir / "ready" / f"{ready_name or name}.json" if ready else None
        if ready_file is not None:
            ready_file.parent.mkdir(parents=True, exist_ok=True)
            ready_file.unlink(missing_ok=True)
            args = [*args, "--ready-file", str(ready_file)]
        launcher = torchrun_argv(nproc) if launcher is None else launcher
        argv = [sys.executable, *launcher, "-m", "fleetrl", "serve", kind, *args]
        log_path = self.log_dir / f"{name}.log"
        child_env = {**self.env, **(env or {})}
        with open(log_path, "ab") as log_file:
            log_file.write(f"$ {' '.join(argv)}\n".encode())
            log_file.flush()
            process = self._preloaded(argv, child_env, log_file) if not launcher else None
            if process is None:
                process = subprocess.Popen(
                    argv,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=child_env,
                    start_new_session=True,  # Ctrl-C reaches only `fleetrl up`, which stops children in order
                    preexec_fn=die_with_parent,  # runs in the child before exec
                    pass_fds=self.keep_fds,
                )
        child = Child(name, kind, argv, log_path, process, ready_file, env=dict(env or {}))
        self.children.append(child)
        return child

    def _preloaded(self, argv: list[str], env: dict[str, str], log_file: Any) -> ServiceProcess | None:
        """`argv` forked by the preload server that FLEETRL_PRELOAD_SOCKET names, if one is set and it starts it;
        None to start it the ordinary way. The log says which."""
        socket_path = self.env.get(preload.SOCKET_ENV)
        if not socket_path:
            return None
        try:
            process = preload.spawn(socket_path, argv, env, os.getcwd(), log_file.fileno(), self.keep_fds)
        except preload.PreloadUnavailable as exc:
            log_file.write(f"(started as a new process: {exc})\n".encode())
            log_file.flush()
            return None
        log_file.write(f"(forked by the preload server at {socket_path}: pid {process.pid})\n".encode())
        log_file.flush()
        return process

    def wait_ready(self, child: Child, timeout_s: float, peers: Sequence[Child] = ()) -> dict[str, Any]:
        """`child`'s ready file; fails if it, or one of `peers` (the other agents of a multi-node service), exits."""
        assert child.ready_file is not None
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                child.info = wait_ready_file(child.ready_file, max(0.0, min(1.0, left)), child.process)
                return child.info
            except RuntimeError as exc:
                raise ServiceFailed(child, f"{child.name} did not become ready: {exc}") from None
            except TimeoutError:
                if left <= 1.0:
                    message = f"{child.ready_file} did not appear within {timeout_s}s"
                    raise ServiceFailed(child, f"{child.name} did not become ready: {message}") from None
            for peer in peers:
                if (code := peer.poll()) is not None:
                    message = f"{child.name} did not become ready: {peer.name} exited with code {code}"
                    raise ServiceFailed(peer, message) from None

    def reap(self, child: Child) -> None:
        """Kill what is left of an exited child's process group: the processes it started itself (vLLM's engine
        core and workers, torchrun's ranks), which outlive a service killed by SIGKILL or the OOM killer (its own
        PR_SET_PDEATHSIG reaches only it). Left alone they hold their memory, their ports and the run folder's lock
        descriptor. Call it once the child has exited (a group with no process left is nothing to kill); once per child
        (again is a no-op)."""
        if child.poll() is None:
            raise ValueError(f"reap: {child.name} is still running")
        if id(child) in self._reaped:  # once: later, the exited child's pid may name another process's group
            return
        self._reaped.add(id(child))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)

    def stop_all(self, grace_s: float = 10.0, patient: Mapping[str, float] | None = None) -> None:
        """Stop every live child one kind at a time, in STOP_ORDER (gateways, controller, trainer, reference,
        inference; other kinds after, newest first): SIGTERM, then SIGKILL after `grace_s`, or `patient[kind]`
        for kinds that need longer. So the controller finishes its step in flight while the trainer and replicas
        still serve, and the trainer checkpoints that step while the reference still answers."""
        started = list(dict.fromkeys(c.kind for c in reversed(self.children)))
        kinds = sorted(started, key=lambda k: STOP_ORDER.index(k) if k in STOP_ORDER else len(STOP_ORDER))
        for kind in kinds:
            live = [c for c in reversed(self.children) if c.kind == kind and c.poll() is None]
            for child in live:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGTERM)
            deadline = time.monotonic() + (patient or {}).get(kind, grace_s)
            for child in live:
                try:
                    child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"fleetrl up: {child.name} did not stop in time: killing it", file=sys.stderr)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(child.pid, signal.SIGKILL)
                    child.process.wait(timeout=10)
        for child in self.children:  # what exited children left behind, the ones that died earlier included
            if child.poll() is not None:
                self.reap(child)


# Gateways first (no new rows), then the controller (it finishes its step in flight while the trainer and the
# replicas still serve), the trainer (it checkpoints that step while the reference still answers), then the rest.
STOP_ORDER = ("gateway", "controller", "trainer", "reference", "inference")


def torchrun_argv(nproc: int, nnodes: int = 1, rdzv_endpoint: str = "", rdzv_id: str = "") -> list[str]:
    """The `python -m torch.distributed.run` flags of one agent (none for a single process): `--standalone` on one
    node; across `nnodes` a c10d rendezvous at `rdzv_endpoint` under `rdzv_id`, every agent on loopback
    (`--local-addr 127.0.0.1`). c10d numbers the nodes itself (by address, then agent pid: the agent started first
    holds rank 0 here) and ignores `--node-rank`, which is therefore not passed."""
    if nnodes == 1:
        return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else []
    if not rdzv_endpoint or not rdzv_id:
        raise ValueError("a multi-node torchrun needs a rendezvous endpoint and id")
    return [
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        rdzv_endpoint,
        "--rdzv-id",
        rdzv_id,
        "--local-addr",
        "127.0.0.1",
    ]


class ServiceFailed(RuntimeError):
    def __init__(self, child: Child, message: str) -> None:
        super().__init__(message)
        self.child = child
