"""A health probe for containers: is this fleetrl service (are these services) serving?

    python -m fleetrl.commands.health HOST:PORT [HOST:PORT ...]    # gRPC health (grpc.health.v1): all SERVING?
    python -m fleetrl.commands.health A:1 --if-exists reference:50061  # the second only where its name resolves
    python -m fleetrl.commands.health --wait 600 A:1 B:2               # retry until all serve (an init container)
    python -m fleetrl.commands.health --http http://HOST:PORT/metrics  # HTTP 200? (a gateway has no gRPC server)
    python -m fleetrl.commands.health --auto                           # whatever `fleetrl serve ...` PID 1 runs

(`fleetrl health ...` is the same.) Exit 0 when healthy, 1 when not (the reason on stderr), 2 on bad usage. The
gRPC health service is open without the auth token, so probes need no secret. `--auto` is the images'
HEALTHCHECK: one image runs any service, chosen by its command, so the probe reads that command
(`/proc/1/cmdline`, after any init such as tini) and checks the service's gRPC port, or a gateway's /metrics
port, on loopback. The service's launcher (its flags) and config class (its default ports) are found through the
package's entry points (fleetrl/commands/registry.py). `--if-exists` is for optional services (the reference runs
only when kl_beta > 0): a name that does not resolve is not running.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from fleetrl.commands.registry import UnknownServiceError, config_class, launcher_module

_WILDCARDS = {"", "0.0.0.0", "::", "[::]"}


class ProbeError(RuntimeError):
    """The service is not healthy; the message says why."""


def check_grpc(address: str, service: str = "", timeout_s: float = 3.0) -> str:
    """The serving status of `service` at `address`; raises ProbeError unless it is SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            raise ProbeError(f"{address}: health check failed: {exc.code().name}: {exc.details()}") from None
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if status != "SERVING":
        raise ProbeError(f"{address}: {status}")
    return status


def check_http(url: str, timeout_s: float = 3.0) -> int:
    """The HTTP status of GET `url`; raises ProbeError unless it is 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            code = int(response.status)
    except (urllib.error.URLError, OSError) as exc:
        raise ProbeError(f"{url}: {exc}") from None
    if code != 200:
        raise ProbeError(f"{url}: HTTP {code}")
    return code


def probe_target(argv: Sequence[str]) -> tuple[str, str] | None:
    """What to probe for a `fleetrl serve <service> ...` command line: ("grpc", HOST:PORT), ("http", URL),
    or None for a gateway without /metrics (nothing to ask; the process being alive is all there is).

    Raises ProbeError when the command line runs no fleetrl service.
    """
    args = list(argv)
    if "serve" not in args or args.index("serve") + 1 >= len(args):
        raise ProbeError(f"not a `fleetrl serve <service>` command: {' '.join(args)!r}")
    at = args.index("serve")
    name, rest = args[at + 1], args[at + 2 :]
    try:
        fields, launcher = config_class(name).model_fields, launcher_module(name)
    except UnknownServiceError as exc:
        raise ProbeError(f"{exc} (command line {' '.join(args)!r})") from None
    try:
        flags, _ = launcher.build_parser().parse_known_args(rest)
    except SystemExit:  # argparse already said what is wrong with the command line
        raise ProbeError(f"cannot parse the {name} command line {' '.join(rest)!r}") from None
    host = getattr(flags, "host", None) or fields["host"].default
    host = "127.0.0.1" if host in _WILDCARDS else host
    if "grpc_port" not in fields:  # a gateway: no gRPC server, its /metrics endpoint (if any) is the probe
        port = flags.metrics_port if flags.metrics_port is not None else fields["metrics_port"].default
        return None if not port else ("http", f"http://{host}:{port}/metrics")
    port = flags.grpc_port if flags.grpc_port is not None else fields["grpc_port"].default
    return "grpc", f"{host}:{port}"


def read_cmdline(pid: int = 1) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [part.decode() for part in raw.split(b"\0") if part]


def resolves(address: str) -> bool:
    """Whether the host of HOST:PORT has an address (a container or Service that exists)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return False
    return True


def check_all(required: Sequence[str], optional: Sequence[str], service: str, timeout_s: float) -> str:
    """Every required address SERVING, and every optional one whose name resolves; raises ProbeError."""
    checked = []
    for address in [*required, *(a for a in optional if resolves(a))]:
        check_grpc(address, service, timeout_s)
        checked.append(address)
    return "SERVING: " + ", ".join(checked)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleetrl health", description="Exit 0 if fleetrl services are serving.")
    parser.add_argument("address", nargs="*", help="HOST:PORT of gRPC services (health service, no auth)")
    parser.add_argument("--if-exists", action="append", default=[], metavar="HOST:PORT", help="checked if it resolves")
    parser.add_argument("--http", metavar="URL", help="probe this URL instead (200 = healthy)")
    parser.add_argument("--auto", action="store_true", help="probe the service PID 1 runs (container HEALTHCHECK)")
    parser.add_argument("--pid", type=int, default=1, help="with --auto: the process whose command line to read")
    parser.add_argument("--service", default="", help="gRPC health service name ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds one check may take")
    parser.add_argument("--wait", type=float, default=0.0, metavar="SECONDS", help="retry until healthy or this long")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if sum(bool(x) for x in (args.address, args.http, args.auto)) != 1:
        parser.print_usage(sys.stderr)
        print("fleetrl health: give HOST:PORT addresses, --http URL or --auto", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.wait
    while True:
        try:
            print(f"healthy: {probe_once(args)}")
            return 0
        except (ProbeError, OSError) as exc:
            if time.monotonic() + 1.0 > deadline:
                print(f"unhealthy: {exc}", file=sys.stderr)
                return 1
            print(f"waiting: {exc}", file=sys.stderr)
            time.sleep(1.0)


def probe_once(args: argparse.Namespace) -> str:
    if args.http:
        return f"{args.http}: {check_http(args.http, args.timeout)}"
    if args.address:
        return check_all(args.address, args.if_exists, args.service, args.timeout)
    target = probe_target(read_cmdline(args.pid))
    if target is None:
        return "gateway without a metrics port (process alive)"
    kind, where = target
    if kind == "grpc":
        return f"{where}: {check_grpc(where, args.service, args.timeout)}"
    return f"{where}: {check_http(where, args.timeout)}"


if __name__ == "__main__":
    sys.exit(main())
