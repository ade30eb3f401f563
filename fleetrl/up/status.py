"""`fleetrl status [HOST:PORT]`: print a running controller's state (version, steps, rows, members)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from fleetrl.rpc import open_channel
from fleetrl.up.auth import read_run_token
from fleetrl.v1 import controller_pb2, controller_pb2_grpc


async def fetch_status(address: str, timeout_s: float = 5.0, auth_token: str | None = None) -> dict:
    async with open_channel(address, auth_token) as channel:
        stub = controller_pb2_grpc.ControllerStub(channel)
        reply = await stub.GetStatus(controller_pb2.GetStatusRequest(), timeout=timeout_s)
    return MessageToDict(reply, preserving_proto_field_name=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleetrl status", description=__doc__)
    parser.add_argument("address", nargs="?", help="controller HOST:PORT (default: --run's, else 127.0.0.1:50050)")
    parser.add_argument(
        "--run", type=Path, metavar="LOG_PATH", help="a `fleetrl up` run's log folder: its controller and auth token"
    )
    parser.add_argument("--json", action="store_true", help="print raw JSON")
    args = parser.parse_args(argv)
    token = read_run_token(args.run) if args.run else None
    if args.address is None and args.run is not None:
        try:
            info = json.loads((args.run / "ready" / "controller.json").read_text())
            args.address = f"{info.get('host', '127.0.0.1')}:{info['grpc_port']}"
        except (OSError, ValueError, KeyError) as exc:
            print(f"fleetrl status: no running controller in {args.run}: {exc}", file=sys.stderr)
            return 1
    args.address = args.address or "127.0.0.1:50050"
    try:
        status = asyncio.run(fetch_status(args.address, auth_token=token))
    except grpc.aio.AioRpcError as exc:
        print(f"fleetrl status: controller at {args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    counters = status.get("counters", {})
    print(
        f"run {status.get('run_id', '?')}: version {status.get('version', 0)}, "
        f"trained steps {status.get('trained_steps', 0)}, finished {status.get('finished', False)}"
    )
    if status.get("error"):
        print(f"error: {status['error']}")
    print(
        "rows: "
        + ", ".join(f"{k.removeprefix('rows_')} {v}" for k, v in sorted(counters.items()) if k.startswith("rows_"))
    )
    for m in status.get("members", []):
        flags = " fenced" if m.get("fenced") else ""
        print(
            f"  {m.get('kind', '?'):<10} {m.get('member_id', '')} {m.get('address', '')} "
            f"v{m.get('version', 0)} {'alive' if m.get('alive') else 'dead'}{flags}"
        )
    return 0
