"""Shared gRPC helpers for every fleetrl service: server creation, bearer-token auth, client channels.

    server, port = create_grpc_server([lambda s: add_FooServicer_to_server(servicer, s)], port=0)
    await server.start()
    channel = open_channel(f"127.0.0.1:{port}")          # adds `authorization: Bearer <token>`

Auth is one shared token (argument, else env FLEETRL_AUTH_TOKEN; none = auth off). Every RPC except the
standard health service must carry metadata `authorization: Bearer <token>`, or it is refused with
UNAUTHENTICATED and a message saying what to send, without its request being parsed. Health checks stay
open so probes need no secret. A request over the server's receive cap is refused by gRPC (RESOURCE_EXHAUSTED), one
that does not parse gets INVALID_ARGUMENT (instead of gRPC's UNKNOWN and a logged traceback).
Every server gets the standard gRPC health service (grpc.health.v1), SERVING for "" from the start.
"""

from __future__ import annotations

import hmac
import inspect
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

AUTH_ENV = "FLEETRL_AUTH_TOKEN"
AUTH_METADATA_KEY = "authorization"
DEFAULT_MAX_MESSAGE_MB = 256
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)

Registrar = Callable[[grpc.aio.Server], Any]


def resolve_auth_token(auth_token: str | None = None) -> str | None:
    """The token to use: the argument, else $FLEETRL_AUTH_TOKEN, else None (auth off)."""
    token = auth_token if auth_token is not None else os.environ.get(AUTH_ENV)
    return token or None


def message_options(max_message_mb: int, max_receive_mb: int | None = None) -> list[tuple[str, int]]:
    """gRPC channel/server options setting the (4 MB default) message limits to `max_message_mb`
    (received messages: `max_receive_mb` when given)."""
    limit = int(max_message_mb * 1024 * 1024)
    receive = limit if max_receive_mb is None else int(max_receive_mb * 1024 * 1024)
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", receive)]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuse calls without `authorization: Bearer <token>` (UNAUTHENTICATED); health stays open."""

    def __init__(self, token: str, open_prefixes: Sequence[str] = OPEN_METHOD_PREFIXES) -> None:
        if not token:
            raise ValueError("AuthInterceptor needs a non-empty token")
        self._expected = f"Bearer {token}".encode()
        self._open = tuple(open_prefixes)

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._open):
            return handler
        sent = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                sent = value.encode() if isinstance(value, str) else bytes(value)
        if sent is not None and hmac.compare_digest(sent, self._expected):
            return handler
        if sent is None:
            message = (
                f"{handler_call_details.method}: no auth token; send metadata "
                f"'authorization: Bearer <token>' with the token in ${AUTH_ENV}"
            )
        else:
            message = f"{handler_call_details.method}: wrong auth token (check ${AUTH_ENV})"
        return _refusing_handler(handler, message)


class ParseInterceptor(grpc.aio.ServerInterceptor):
    """Parse unary requests in the handler, so a request that does not parse is answered INVALID_ARGUMENT."""

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.response_streaming:
            return handler
        parse, behavior = handler.request_deserializer, handler.unary_unary
        if parse is None or behavior is None:
            return handler
        method = handler_call_details.method

        async def parse_then_call(request: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                message = parse(request)
            except Exception as exc:  # DecodeError, or anything a hostile payload makes the parser raise
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request does not parse: {exc}")
            result = behavior(message, context)
            return await result if inspect.isawaitable(result) else result

        return grpc.unary_unary_rpc_method_handler(parse_then_call, response_serializer=handler.response_serializer)


def _refusing_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    # No request deserializer: the refused request stays raw bytes, an unauthenticated caller gets nothing parsed.
    kwargs = {"response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)


def create_grpc_server(
    registrars: Iterable[Registrar],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    auth_token: str | None = None,
    max_message_mb: int = DEFAULT_MAX_MESSAGE_MB,
    max_receive_mb: int | None = None,
    health: HealthServicer | None = None,
) -> tuple[grpc.aio.Server, int]:
    """An (unstarted) grpc.aio server bound to host:port (0 = pick) with health + optional auth.

    registrars: callables that add servicers, e.g. `lambda s: add_XServicer_to_server(x, s)`.
    max_message_mb caps messages both ways; max_receive_mb (default: the same) caps requests, for a
    server whose requests are small (the controller) while its replies may be large.
    health: pass your own grpc_health aio HealthServicer to set per-service statuses later; the
    default one reports SERVING for "" (the whole server). Returns (server, bound_port).
    """
    token = resolve_auth_token(auth_token)
    # Auth first: a refused request is never parsed.
    interceptors = [AuthInterceptor(token), ParseInterceptor()] if token else [ParseInterceptor()]
    # so_reuseport=0: a port already in use must be an error, not silently shared.
    options = [*message_options(max_message_mb, max_receive_mb), ("grpc.so_reuseport", 0)]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    health_pb2_grpc.add_HealthServicer_to_server(health or HealthServicer(), server)
    for register in registrars:
        register(server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"could not bind gRPC server to {address}: {exc}") from exc
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {address} (in use?)")
    return server, bound


class _AuthClientInterceptor(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call's metadata."""

    def __init__(self, token: str) -> None:
        self._pair = (AUTH_METADATA_KEY, f"Bearer {token}")

    def _with_auth(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(*self._pair)
        return details._replace(metadata=metadata)

    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[override]
        return await continuation(self._with_auth(details), request)

    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[override]
        return await continuation(self._with_auth(details), request)

    async def intercept_stream_unary(self, continuation, details, request_iterator):  # type: ignore[override]
        return await continuation(self._with_auth(details), request_iterator)

    async def intercept_stream_stream(self, continuation, details, request_iterator):  # type: ignore[override]
        return await continuation(self._with_auth(details), request_iterator)


def open_channel(
    address: str,
    auth_token: str | None = None,
    *,
    max_message_mb: int = DEFAULT_MAX_MESSAGE_MB,
) -> grpc.aio.Channel:
    """An insecure grpc.aio channel to `host:port` that sends the auth token (argument or env)."""
    token = resolve_auth_token(auth_token)
    interceptors = [_AuthClientInterceptor(token)] if token else None
    return grpc.aio.insecure_channel(address, options=message_options(max_message_mb), interceptors=interceptors)


async def check_health(channel: grpc.aio.Channel, service: str = "", timeout_s: float = 5.0) -> str:
    """The health status name ("SERVING", "NOT_SERVING", ...) of `service` on the channel's server."""
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
