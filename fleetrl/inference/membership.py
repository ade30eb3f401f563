"""Staying a member of a run: a service that joins by itself (an inference replica started with `--controller`)
registers with the controller once it serves, heartbeats every interval the controller asks for, and registers
again when a heartbeat's reply says `known = false` (the controller restarted, or dropped it).

    stop = asyncio.Event()
    task = asyncio.create_task(
        keep_registered("10.0.0.2:50050", "inference", "inference-0", "10.0.0.5:50051", stop=stop)
    )
    ...
    stop.set(); await task

Every call has a timeout; a failed one is logged (a warning for the first of a run of failures, then debug) and
retried at the next interval, never raised: the service keeps serving whatever happens to the controller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import grpc

from fleetrl.rpc import open_channel
from fleetrl.v1 import controller_pb2, controller_pb2_grpc

log = logging.getLogger(__name__)

KINDS = {
    "gateway": controller_pb2.GATEWAY,
    "inference": controller_pb2.INFERENCE,
    "trainer": controller_pb2.TRAINER,
    "reference": controller_pb2.REFERENCE,
}


async def stay_registered(
    stub: Any,
    kind: str,
    member_id: str,
    address: str,
    *,
    stop: asyncio.Event,
    rpc_timeout_s: float = 5.0,
    retry_s: float = 2.0,
) -> None:
    """Register with the controller behind `stub` (a ControllerStub) and heartbeat until `stop` is set.

    `retry_s` is the wait between calls until the controller names its heartbeat interval (and after a failure
    to register)."""
    register = controller_pb2.RegisterRequest(kind=KINDS[kind], member_id=member_id, address=address)
    heartbeat = controller_pb2.HeartbeatRequest(member_id=member_id)
    interval, registered, failing = retry_s, False, False
    while not stop.is_set():
        try:
            if not registered:
                reply = await stub.Register(register, timeout=rpc_timeout_s)
                interval, registered = reply.heartbeat_interval_s or retry_s, True
                log.info(
                    "registered with the controller as %s %s at %s (run %s)", kind, member_id, address, reply.run_id
                )
            else:
                reply = await stub.Heartbeat(heartbeat, timeout=rpc_timeout_s)
                if not reply.known:
                    log.warning("the controller does not know %s (it restarted?): registering again", member_id)
                    registered = False
                    continue
            if failing:
                log.info("the controller answers again")
            failing = False
        except grpc.aio.AioRpcError as exc:
            call = "Heartbeat" if registered else "Register"
            message = "%s with the controller failed (%s: %s); retrying every %.1f s"
            log.log(
                logging.DEBUG if failing else logging.WARNING, message, call, exc.code().name, exc.details(), interval
            )
            failing = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)


async def keep_registered(
    controller_address: str,
    kind: str,
    member_id: str,
    address: str,
    *,
    stop: asyncio.Event,
    auth_token: str | None = None,
    rpc_timeout_s: float = 5.0,
) -> None:
    """`stay_registered` over a channel of its own to `controller_address` (token: argument or
    $FLEETRL_AUTH_TOKEN)."""
    channel = open_channel(controller_address, auth_token)
    try:
        stub = controller_pb2_grpc.ControllerStub(channel)
        await stay_registered(stub, kind, member_id, address, stop=stop, rpc_timeout_s=rpc_timeout_s)
    finally:
        await channel.close()
