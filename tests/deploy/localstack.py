"""Run a deployment's containers as local processes: what a container engine would start, on loopback.

    stack = LocalStack([LocalService(...), ...], workdir)
    with stack:
        stack.start()                       # in depends_on order, waiting for health where asked
        code = stack.wait_exit("controller", timeout_s=240)

Each service stands on its own loopback address (127.0.0.2, 127.0.0.3, ...) as if it were its own container or
pod: its bind addresses (0.0.0.0, and 127.0.0.1/localhost as seen inside its container) become that address, and
every other service's hostname becomes that service's address. A service that reached a peer by a wrong name, or
a peer bound to loopback only, fails here as it would between containers. Mounts become local folders: a
container path in a command line or the environment is rewritten to the folder standing for that volume.

Hostnames are rewritten where they are addresses: `name:port` anywhere in an argument, and a whole argument that
follows a flag ending in `host` or `addr` (`--host 0.0.0.0`, `--advertise-host trainer`, torchrun's
`--local-addr`). The image's entrypoint (`tini -- fleetrl`) runs as `python -m fleetrl` with this interpreter.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INITS = ("tini", "docker-init", "/sbin/docker-init", "/usr/bin/tini")
LOOPBACK_NAMES = ("0.0.0.0", "127.0.0.1", "localhost")


@dataclass
class Probe:
    """A health check: `exec` runs argv in the service's context; `grpc`/`http` check its port (k8s probes)."""

    kind: str
    argv: list[str] = field(default_factory=list)
    port: int = 0
    path: str = "/"


@dataclass
class LocalService:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    mounts: dict[str, str] = field(default_factory=dict)  # container path -> local folder or file
    hostnames: list[str] = field(default_factory=list)  # names the others reach it by
    probe: Probe | None = None
    depends_on: dict[str, str] = field(default_factory=dict)  # name -> condition
    role: str = ""  # the service a replica belongs to (compose service, k8s workload); default its name
    address: str = ""
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None


class StackError(RuntimeError):
    """A service did not come up or exited early; the message carries its log tail."""


def local_command(argv: list[str]) -> list[str]:
    """The container command as a local one: init dropped, fleetrl/python/torchrun mapped to this interpreter."""
    args = list(argv)
    while args and args[0] in INITS:
        args = args[1:]
        if args and args[0] == "--":
            args = args[1:]
    if not args:
        raise ValueError(f"empty command: {argv!r}")
    head, rest = args[0], args[1:]
    if head == "fleetrl":
        return [sys.executable, "-m", "fleetrl", *rest]
    if head in ("python", "python3"):
        return [sys.executable, *rest]
    if head == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *rest]
    raise ValueError(f"cannot run {head!r} locally (command {argv!r})")


class Rewriter:
    """Rewrites one service's arguments and environment: mounts to folders, hostnames to loopback addresses."""

    def __init__(self, mounts: dict[str, str], addresses: dict[str, str]) -> None:
        self.mounts = mounts
        self.addresses = addresses
        paths = sorted(mounts, key=len, reverse=True)
        # One pass, longest container path first, at the start of an argument or after = : , (flag values,
        # PATH-like lists): a folder that was just substituted is never rewritten again.
        self._paths = re.compile(
            r"(?:^|(?<=[=:,]))(" + "|".join(re.escape(p) for p in paths) + r")(?=/|$|[:,])" if paths else r"(?!x)x"
        )
        names = sorted(addresses, key=len, reverse=True)
        self._host_port = re.compile(
            r"(?<![\w.-])(" + "|".join(re.escape(n) for n in names) + r")(?=:\d)" if names else r"(?!x)x"
        )

    def path(self, text: str) -> str:
        return self._paths.sub(lambda m: self.mounts[m.group(1)], text)

    def arg(self, text: str, previous: str = "") -> str:
        text = self.path(text)
        if previous.startswith("--") and previous.endswith(("host", "addr")) and text in self.addresses:
            return self.addresses[text]
        return self._host_port.sub(lambda m: self.addresses[m.group(1)], text)

    def argv(self, argv: list[str]) -> list[str]:
        return [self.arg(a, argv[i - 1] if i else "") for i, a in enumerate(argv)]


class LocalStack:
    def __init__(self, services: list[LocalService], workdir: Path, first_address: int = 2) -> None:
        self.services = {s.name: s for s in services}
        self.workdir = workdir
        for i, service in enumerate(services):
            service.address = f"127.0.0.{first_address + i}"
        self.addresses = {h: s.address for s in services for h in [s.name, *s.hostnames]}
        self.pod_errors: dict[str, BaseException] = {}
        self._threads: list[threading.Thread] = []
        self._init_processes: list[subprocess.Popen[bytes]] = []
        self._stopping = False

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def rewriter(self, service: LocalService) -> Rewriter:
        own = dict.fromkeys(LOOPBACK_NAMES, service.address)
        return Rewriter(service.mounts, {**self.addresses, **own})

    def command(self, service: LocalService) -> list[str]:
        return local_command(self.rewriter(service).argv(service.argv))

    def environment(self, service: LocalService) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETRL_")}
        rw = self.rewriter(service)
        env.update({k: rw.arg(v) for k, v in service.env.items()})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO)]))
        return env

    def order(self) -> list[LocalService]:
        done: list[LocalService] = []

        def visit(service: LocalService, path: tuple[str, ...]) -> None:
            if service in done:
                return
            if service.name in path:
                raise ValueError(f"depends_on cycle: {' -> '.join((*path, service.name))}")
            for dep in service.depends_on:
                if dep not in self.services:
                    raise ValueError(f"{service.name} depends on {dep}, which is not in the stack")
                visit(self.services[dep], (*path, service.name))
            done.append(service)

        for service in self.services.values():
            visit(service, ())
        return done

    def start(self, health_timeout_s: float = 180.0) -> None:
        """Compose style: every service whose depends_on conditions hold is started, the rest when they do."""
        self.order()  # refuses cycles and unknown dependencies up front
        waiting = list(self.services.values())
        deadline = time.monotonic() + health_timeout_s
        while waiting:
            ready = [s for s in waiting if all(self._condition_met(d, c) for d, c in s.depends_on.items())]
            for service in ready:
                self.launch(service)
                waiting.remove(service)
            if not waiting:
                return
            if time.monotonic() > deadline:
                blocked = {s.name: s.depends_on for s in waiting}
                tails = self.all_log_tails()
                raise StackError(f"dependencies not met within {health_timeout_s:.0f} s: {blocked}\n{tails}")
            time.sleep(0.5)

    def _condition_met(self, name: str, condition: str) -> bool:
        service = self.services[name]
        if service.process is None:
            return False
        if condition == "service_completed_successfully":  # a one-shot: exit 0 lets its dependents start
            code = service.process.poll()
            if code not in (None, 0):
                raise StackError(f"{name} exited with code {code}\n{self.log_tail(name)}")
            return code == 0
        self.check_running(service)
        return condition != "service_healthy" or self.probe_once(service)

    def start_pods(self, inits: dict[str, list[LocalService]], timeout_s: float = 240.0) -> None:
        """Kubernetes style: every pod at once; a pod's init containers run in order, then its container."""
        for service in self.services.values():
            thread = threading.Thread(
                target=self._run_pod, args=(service, inits.get(service.name, []), timeout_s), daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _run_pod(self, service: LocalService, inits: list[LocalService], timeout_s: float) -> None:
        try:
            for i, init in enumerate(inits):
                init.address = service.address
                log_path = self.workdir / f"{service.name}.init-{i}.log"
                with open(log_path, "wb") as log:
                    process = subprocess.Popen(
                        self.command(init),
                        env=self.environment(init),
                        cwd=REPO,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                self._init_processes.append(process)
                code = process.wait(timeout=timeout_s)
                if code != 0:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    raise StackError(f"{service.name}: init container {i} exited with {code}\n{tail}")
            if not self._stopping:
                self.launch(service)
        except Exception as exc:  # surfaced by wait_exit / check_pods
            self.pod_errors[service.name] = exc

    def check_pods(self) -> None:
        if self.pod_errors:
            name, exc = next(iter(self.pod_errors.items()))
            raise StackError(f"pod {name} failed to start: {exc}")

    def launch(self, service: LocalService) -> None:
        service.log_path = self.workdir / f"{service.name}.log"
        with open(service.log_path, "wb") as log:
            service.process = subprocess.Popen(
                self.command(service),
                env=self.environment(service),
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def probe_once(self, service: LocalService) -> bool:
        from fleetrl.commands.health import ProbeError, check_grpc, check_http

        probe = service.probe
        if probe is None:
            return True
        if probe.kind == "exec":
            cmd = self.command(LocalService(service.name, probe.argv, mounts=service.mounts, address=service.address))
            env = self.environment(service)
            return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, timeout=30).returncode == 0
        try:
            if probe.kind == "grpc":
                check_grpc(f"{service.address}:{probe.port}", timeout_s=3)
            else:
                check_http(f"http://{service.address}:{probe.port}{probe.path}", timeout_s=3)
        except ProbeError:
            return False
        return True

    def wait_healthy(self, name: str, timeout_s: float) -> None:
        service = self.services[name]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_running(service)
            if self.probe_once(service):
                return
            time.sleep(0.5)
        raise StackError(f"{name} not healthy within {timeout_s:.0f} s\n{self.log_tail(name)}")

    def check_running(self, service: LocalService) -> None:
        if service.process is None:
            raise StackError(f"{service.name} was never started")
        code = service.process.poll()
        if code is not None:
            raise StackError(f"{service.name} exited with code {code}\n{self.log_tail(service.name)}")

    def wait_exit(self, name: str, timeout_s: float, watch: Callable[[], None] | None = None) -> int:
        """Wait for `name` to exit; any other service exiting non-zero first is an error."""
        deadline = time.monotonic() + timeout_s
        target = self.services[name]
        while time.monotonic() < deadline:
            self.check_pods()
            if target.process is not None and (code := target.process.poll()) is not None:
                return code
            for other in self.services.values():
                if other is not target and other.process is not None and other.process.poll() not in (None, 0):
                    raise StackError(f"{other.name} exited with {other.process.poll()}\n{self.log_tail(other.name)}")
            if watch is not None:
                watch()
            time.sleep(0.25)
        raise StackError(f"{name} still running after {timeout_s:.0f} s\n" + self.all_log_tails())

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.services[name].log_path
        if path is None or not path.exists():
            return f"--- {name}: no log"
        text = path.read_text(errors="replace").splitlines()[-lines:]
        return f"--- last lines of {name} ---\n" + "\n".join(text)

    def all_log_tails(self) -> str:
        return "\n".join(self.log_tail(n, 20) for n in self.services)

    def stop(self, grace_s: float = 10.0) -> None:
        self._stopping = True
        for process in self._init_processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=5)
        for thread in self._threads:
            thread.join(timeout=5)
        running = [s for s in self.services.values() if s.process is not None and s.process.poll() is None]
        for service in running:
            assert service.process is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(service.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for service in running:
            assert service.process is not None
            try:
                service.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(service.process.pid, signal.SIGKILL)
                service.process.wait(timeout=5)
