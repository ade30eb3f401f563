"""This replica's weight relay: `ReplicaRelay` holds the one `WeightRelay` through which relayed loads arrive.

A replica binds one relay port at start. Told to load version v through its relay from upstream U (the trainer's
weight stream or a peer's relay), it closes the previous version's relay, starts `WeightRelay(U, v)` on that port
and has its engine load v from the relay's own address on loopback, so the engine needs no change; the relay keeps
serving v to peers (one that joins the run later, or is pushed v later) until the next relayed load.

The upstream is first asked for v's manifest alone, with a short timeout (`probe_timeout_s`), again every
`retry_s` for up to `timeout_s`: a peer that has not started v yet still serves the previous version, and a
request that reaches it while it closes that relay to rebind the port may go unanswered. Once the upstream served
v's manifest, it serves v until its next version, so the relay fetches from it then. A relay whose upstream stops
making progress for `timeout_s` fails the load (the controller then loads that replica from the trainer directly).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

from fleetrl.clients.inference_types import LoadResult
from fleetrl.services.inference.engine import InferenceEngine, WeightLoadError
from fleetrl.weights import WeightRelay, WeightStream, WeightTransferError

logger = logging.getLogger(__name__)


def pick_relay_port(host: str) -> int:
    """A free TCP port on `host` (the relay rebinds it for each version)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ReplicaRelay:
    """The replica's relay on `bind` (a ZeroMQ endpoint), reached by peers at `address`; one version at a time."""

    def __init__(
        self, bind: str, address: str, *, timeout_s: float, retry_s: float = 0.05, probe_timeout_s: float = 2.0
    ) -> None:
        self.bind = bind
        self.address = address
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.probe_timeout_s = probe_timeout_s
        self._relay: WeightRelay | None = None
        self._lock = asyncio.Lock()

    @property
    def version(self) -> int:
        """The version the relay holds complete and verified (0 = none)."""
        relay = self._relay
        if relay is None or not relay.done or relay.error is not None:
            return 0
        return int(relay.version)

    async def load(
        self, engine: InferenceEngine, version: int, upstream: str, *, auth_token: str | None, timeout_s: float
    ) -> LoadResult:
        """Relay `version` from `upstream` and load it into `engine` from the relay (WeightLoadError on failure:
        the engine keeps its version, and this replica's relay then holds no version)."""
        async with self._lock:
            if version <= engine.loaded_version:
                raise WeightLoadError(f"version {version} is not newer than the loaded version {engine.loaded_version}")
            start = time.monotonic()
            await self._close()
            try:
                relay = await self._open(upstream, version, auth_token, start + min(timeout_s, self.timeout_s))
            except WeightTransferError as exc:
                raise WeightLoadError(f"relaying version {version} from {upstream}: {exc}") from exc
            self._relay = relay
            left = max(timeout_s - (time.monotonic() - start), 1.0)
            try:
                result = await engine.load_weights(version, relay.address, auth_token=auth_token, timeout_s=left)
            except BaseException:
                await self._close()
                raise
            # The relay serves each piece as it arrives, before its own fetch has checked the tensor, so the engine
            # can finish first: wait for the relay's last check, so that once this load returns the relay holds the
            # version (`version`, what the controller records for catch-ups from this peer).
            try:
                await asyncio.to_thread(relay.wait, self.timeout_s)
            except WeightTransferError as exc:
                logger.warning("the engine loaded version %d, but this replica's relay holds none: %s", version, exc)
            return result

    async def _open(self, upstream: str, version: int, auth_token: str | None, deadline: float) -> WeightRelay:
        # Probe first, with a short timeout: a peer that has not started this version yet still serves the
        # previous one, and is closing it to rebind its port for this one; a request that reaches it then may
        # go unanswered. Once the upstream served this version's manifest it keeps serving it: relay from it.
        while True:
            try:
                await asyncio.to_thread(self._probe, upstream, version, auth_token, deadline)
                break
            except WeightTransferError as exc:
                if exc.reason not in ("unknown_version", "timeout") or time.monotonic() + self.retry_s >= deadline:
                    raise
            await asyncio.sleep(self.retry_s)
        return await asyncio.to_thread(
            WeightRelay, upstream, version, auth_token=auth_token, bind=self.bind, timeout_s=self.timeout_s
        )

    def _probe(self, upstream: str, version: int, auth_token: str | None, deadline: float) -> None:
        """Fetch `version`'s manifest from `upstream` and nothing else (WeightTransferError if it has none)."""
        timeout_s = max(min(self.probe_timeout_s, deadline - time.monotonic()), 0.01)
        WeightStream(upstream, version, timeout_s=timeout_s, auth_token=auth_token).close()

    async def _close(self) -> None:
        relay, self._relay = self._relay, None
        if relay is not None:
            try:
                await asyncio.to_thread(relay.close)
            except WeightTransferError as exc:
                logger.warning("closing the weight relay of version %d: %s", relay.version, exc)

    async def close(self) -> None:
        """Stop serving (at shutdown)."""
        with contextlib.suppress(Exception):
            await self._close()
