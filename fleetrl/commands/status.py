"""`fleetrl status [HOST:PORT] [--log-path P] [--json]`: a running run's state, asked of its controller and trainer.

    fleetrl status                       # the run in this folder: ./ready/, or ./*/ready/ or ./runs/*/ready/
    fleetrl status --log-path runs/x     # that run (its ready files give the addresses, auth_token the token)
    fleetrl status 10.0.0.5:50050        # a controller by address (the trainer is found in its member list)

With no run found and no address, the local default controller 127.0.0.1:50050 is asked (in its container).

A run whose controller is gone is described from its folder (`run_end.json`, written by the controller as it
stops): finished (exit 0), stopped or failed (exit 1), at which step and version, the final evaluation and where
the final model is.

The version shown is the trainer's own (it may be ahead of the controller's live version while a weight push is in
flight); --json prints both replies with numbers as numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from fleetrl.rpc import open_channel
from fleetrl.up.auth import read_run_token
from fleetrl.v1 import controller_pb2, controller_pb2_grpc, trainer_pb2, trainer_pb2_grpc

READY = Path("ready") / "controller.json"


def proto_to_plain(msg: Message) -> dict[str, Any]:
    """A message as JSON-ready Python values: int64 stays an int (json_format writes it as a string), every field
    is present (zeros too), enums by name, maps as dicts."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {k: _plain_value(value_field, v) for k, v in value.items()}
        elif field.is_repeated:
            out[field.name] = [_plain_value(field, v) for v in value]
        else:
            out[field.name] = _plain_value(field, value)
    return out


def _plain_value(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return proto_to_plain(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values_by_number[value].name
    return value


def find_runs(folder: Path) -> list[Path]:
    """Log folders under `folder` (itself, its children, runs/*) that hold a controller ready file, newest first."""
    candidates = [folder, *folder.glob("*"), *folder.glob("runs/*")]
    found = {p.resolve(): p for p in candidates if (p / READY).is_file()}
    return sorted(found.values(), key=lambda p: (p / READY).stat().st_mtime, reverse=True)


def _address(info: dict[str, Any]) -> str:
    return info.get("address") or f"{info.get('host', '127.0.0.1')}:{info['grpc_port']}"


def trainer_address(log_path: Path | None, status: dict[str, Any]) -> str | None:
    """The trainer's gRPC address: its ready file in the run's folder, else the controller's member list."""
    if log_path is not None:
        try:
            return _address(json.loads((log_path / "ready" / "trainer.json").read_text()))
        except (OSError, ValueError, KeyError):
            pass
    for member in status.get("members", []):
        if member.get("kind") == "TRAINER" and member.get("address"):
            return member["address"]
    return None


async def fetch_status(address: str, timeout_s: float = 5.0, auth_token: str | None = None) -> dict[str, Any]:
    """The controller's GetStatus reply as plain values (`proto_to_plain`)."""
    async with open_channel(address, auth_token) as channel:
        stub = controller_pb2_grpc.ControllerStub(channel)
        reply = await stub.GetStatus(controller_pb2.GetStatusRequest(), timeout=timeout_s)
    return proto_to_plain(reply)


async def fetch_trainer_status(address: str, timeout_s: float = 5.0, auth_token: str | None = None) -> dict[str, Any]:
    """The trainer's Status reply (its own version, steps done, last published version) as plain values."""
    async with open_channel(address, auth_token) as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        reply = await stub.Status(trainer_pb2.TrainerStatusRequest(), timeout=timeout_s)
    return proto_to_plain(reply)


def render(status: dict[str, Any], trainer: dict[str, Any] | None, trainer_error: str | None = None) -> str:
    """The text `fleetrl status` prints for the controller's and the trainer's replies."""
    max_steps = status.get("max_steps") or 0
    steps = f"{status.get('trained_steps', 0)}{f'/{max_steps}' if max_steps else ''}"
    lines = [f"run {status.get('run_id') or '?'}: trained steps {steps}, finished {status.get('finished', False)}"]
    if trainer is not None:
        published = trainer.get("published_version", -1)
        lines.append(
            f"trainer version {trainer.get('version', 0)} (steps done {trainer.get('steps_done', 0)}, "
            f"published {published if published >= 0 else 'none'}); controller's live version "
            f"{status.get('version', 0)}"
        )
    else:
        lines.append(f"trainer: {trainer_error or 'not found'}; controller's live version {status.get('version', 0)}")
    if status.get("error"):
        lines.append(f"error: {status['error']}")
    counters = status.get("counters", {})
    rows = [f"{k.removeprefix('rows_')} {v}" for k, v in sorted(counters.items()) if k.startswith("rows_")]
    lines.append("rows: " + ", ".join(rows))
    for m in status.get("members", []):
        flags = " fenced" if m.get("fenced") else ""
        lines.append(
            f"  {str(m.get('kind', '?')).lower():<10} {m.get('member_id', '')} {m.get('address', '')} "
            f"v{m.get('version', 0)} {'alive' if m.get('alive') else 'dead'}{flags}"
        )
    return "\n".join(lines)


RUN_END = "run_end.json"  # services/controller/server.py writes it as the controller stops


def read_end_record(log_path: Path) -> dict[str, Any] | None:
    """How the run in `log_path` ended (its controller's `run_end.json`), or None (running, or never recorded)."""
    try:
        record = json.loads((log_path / RUN_END).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def render_ended(record: dict[str, Any], log_path: Path) -> str:
    """The text `fleetrl status` prints for a run whose controller is gone."""
    outcome = record.get("outcome", "?")
    lines = [
        f"run in {log_path}: {outcome} at step {record.get('trained_steps', 0)}, version {record.get('version', 0)}"
        " (its services have exited)"
    ]
    if record.get("error"):
        lines.append(f"error: {record['error']}")
    final_eval = record.get("final_eval")
    if final_eval:
        lines.append("final evaluation: " + ", ".join(f"{k} {v:g}" for k, v in sorted(final_eval.items())))
    if record.get("final_model"):
        lines.append(f"final model: {record['final_model']}")
    if record.get("rows_dropped_slow") or record.get("rows_dropped_failing"):
        lines.append(
            f"rows dropped: {record.get('rows_dropped_slow') or 0} too slow (stale on every attempt), "
            f"{record.get('rows_dropped_failing') or 0} failing on every attempt"
        )
    if outcome != "finished":
        lines.append("`fleetrl up <run.toml> --resume` continues it")
    return "\n".join(lines)


def _resolve(args: argparse.Namespace) -> tuple[str, Path | None, str]:
    """(controller address, the run's log folder or None, how it was found); LookupError for a --log-path without
    a run. With nothing given and no run here, the local default controller (a container's own)."""
    if args.address:
        return args.address, args.log_path, ""
    if args.log_path and not (args.log_path / READY).is_file():
        raise LookupError(f"no run in {args.log_path} (no {READY}): is `fleetrl up` running there?")
    runs = [args.log_path] if args.log_path else find_runs(Path.cwd())
    if not runs:
        return DEFAULT_ADDRESS, None, f"no run in {Path.cwd()} (no {READY} there, nor in */ or runs/*), and "
    info = json.loads((runs[0] / READY).read_text())
    return _address(info), runs[0], ""


DEFAULT_ADDRESS = "127.0.0.1:50050"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fleetrl status", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "address",
        nargs="?",
        help=f"controller HOST:PORT (default: the run's; else {DEFAULT_ADDRESS})",
    )
    parser.add_argument(
        "--log-path",
        "--run",
        dest="log_path",
        type=Path,
        metavar="LOG_PATH",
        help="a `fleetrl up` run's log folder (default: found in the current folder)",
    )
    parser.add_argument("--json", action="store_true", help="print the controller's and trainer's replies as JSON")
    args = parser.parse_args(argv)
    try:
        address, log_path, searched = _resolve(args)
        token = read_run_token(log_path) if log_path else None
    except (LookupError, OSError, ValueError, KeyError) as exc:
        print(f"fleetrl status: {exc}", file=sys.stderr)
        return 1
    try:
        status = asyncio.run(fetch_status(address, auth_token=token))
    except grpc.aio.AioRpcError as exc:
        ended = read_end_record(log_path) if log_path is not None and not args.address else None
        if ended is not None and exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            if args.json:
                print(json.dumps({**ended, "log_path": str(log_path)}, indent=2))
            else:
                print(render_ended(ended, log_path))
            return 0 if ended.get("outcome") == "finished" else 1
        hint = "; give --log-path LOG_PATH or HOST:PORT" if searched else ""
        print(
            f"fleetrl status: {searched}controller at {address}: {exc.code().name}: {exc.details()}{hint}",
            file=sys.stderr,
        )
        return 1
    trainer, trainer_error = None, None
    if (trainer_at := trainer_address(log_path, status)) is not None:
        try:
            trainer = asyncio.run(fetch_trainer_status(trainer_at, auth_token=token))
        except grpc.aio.AioRpcError as exc:
            trainer_error = f"at {trainer_at}: {exc.code().name}"
    if args.json:
        print(json.dumps({**status, "log_path": str(log_path) if log_path else None, "trainer": trainer}, indent=2))
        return 0
    print(render(status, trainer, trainer_error))
    return 0
