"""Client of the reference service, for the policy trainer (and tests):

async with ReferenceClient("127.0.0.1:50061") as ref:
    logprobs = await ref.compute_logprobs([[1, 2, 3], [4, 5]], temperature=1.0)  # [[lp, lp], [lp]]
"""

from __future__ import annotations

from types import TracebackType

from fleetrl.rpc import open_channel
from fleetrl.v1 import reference_pb2, reference_pb2_grpc


class ReferenceClient:
    """Async gRPC client of fleetrl.v1.Reference (sends the auth token, argument or env)."""

    def __init__(self, address: str, *, auth_token: str | None = None, timeout_s: float = 300.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = open_channel(address, auth_token)
        self._stub = reference_pb2_grpc.ReferenceStub(self._channel)

    async def compute_logprobs(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Per-token reference logprobs, N-1 per sequence of N tokens, in request order."""
        request = reference_pb2.ComputeLogprobsRequest(
            sequences=[reference_pb2.TokenSequence(tokens=s) for s in sequences], temperature=temperature
        )
        reply = await self._stub.ComputeLogprobs(request, timeout=self.timeout_s)
        return [list(s.logprobs) for s in reply.sequences]

    async def status(self) -> reference_pb2.ReferenceStatusResponse:
        return await self._stub.Status(reference_pb2.ReferenceStatusRequest(), timeout=self.timeout_s)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> ReferenceClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
