"""The weight stream's wire protocol: frame names, the chunk range header and error replies.

The publisher is a ROUTER socket, each fetch a DEALER. Nothing on the wire is pickled: requests,
errors and the manifest are JSON, tensors are their raw bytes.

    receiver -> publisher
      [PROTOCOL, b"manifest", auth token (empty: none), JSON {"version": int}]
      [PROTOCOL, b"chunk", session_id, RANGE(tensor index, start, stop)]   (several in flight)
      [PROTOCOL, b"done", session_id]
    publisher -> receiver
      [b"manifest", session_id, JSON {"chunk_bytes": int}, manifest JSON]
      [b"chunk", the same RANGE header, raw bytes of that range]
      [b"error", JSON {"reason": str, "message": str}]

The publisher (and a relay: both run ``fleetrl.weights.server``) compares the token frame before it
parses the JSON, caps every request frame at ``server.MAX_REQUEST_BYTES`` (ZMQ_MAXMSGSIZE: a bigger
one disconnects the peer) and answers any request it cannot serve with an error reply.

A manifest request opens a session that pins its version until the receiver says done (or goes
idle), so a fetch that started finishes even if newer versions are published meanwhile. The
receiver asks for chunks (``manifest.plan_chunks``) with a bounded number of bytes in flight
(credit flow), so one slow receiver never stalls the others or floods a queue.
"""

from __future__ import annotations

import json
import struct

PROTOCOL = b"fleetrl.weights/1"
RANGE = struct.Struct("<IQQ")  # tensor index, start byte, stop byte
SESSION_ID_BYTES = 16


def error_frames(reason: str, message: str) -> list[bytes]:
    """The frames of an error reply."""
    return [b"error", json.dumps({"reason": reason, "message": message}).encode()]


def parse_error(payload: bytes) -> tuple[str, str]:
    """``(reason, message)`` of an error reply's JSON frame, tolerating a malformed one."""
    try:
        error = json.loads(payload)
        return str(error["reason"]), str(error["message"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return "protocol", f"unreadable error reply {payload[:200]!r}"
