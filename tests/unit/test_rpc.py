"""fleetrl.rpc: servers on port 0 with health, bearer-token auth, client channels (real loopback gRPC)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fleetrl.rpc import check_health, create_grpc_server, open_channel

ECHO = "/fleetrl.test.Echo/Echo"


def _echo_registrar(server: grpc.aio.Server) -> None:
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request[::-1]

    handler = grpc.method_handlers_generic_handler(
        "fleetrl.test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
    )
    server.add_generic_rpc_handlers((handler,))


async def _call(channel: grpc.aio.Channel, payload: bytes) -> bytes:
    return await channel.unary_unary(ECHO)(payload, timeout=5)


async def test_server_binds_port_zero_and_serves_health_and_calls() -> None:
    server, port = create_grpc_server([_echo_registrar])
    assert port > 0
    await server.start()
    try:
        async with open_channel(f"127.0.0.1:{port}") as channel:
            assert await check_health(channel) == "SERVING"
            assert await _call(channel, b"abc") == b"cba"
    finally:
        await server.stop(0)


async def test_auth_token_is_required_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    server, port = create_grpc_server([_echo_registrar], auth_token="s3cret")
    await server.start()
    address = f"127.0.0.1:{port}"
    try:
        async with open_channel(address) as channel:  # no token
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _call(channel, b"x")
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization: Bearer" in info.value.details()
            assert "FLEETRL_AUTH_TOKEN" in info.value.details()
            assert await check_health(channel) == "SERVING"  # probes need no secret
        async with open_channel(address, auth_token="wrong") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _call(channel, b"x")
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "wrong auth token" in info.value.details()
        async with open_channel(address, auth_token="s3cret") as channel:
            assert await _call(channel, b"ok") == b"ko"
        monkeypatch.setenv("FLEETRL_AUTH_TOKEN", "s3cret")
        async with open_channel(address) as channel:  # token from the environment
            assert await _call(channel, b"env") == b"vne"
    finally:
        await server.stop(0)


async def test_token_from_env_turns_auth_on_for_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETRL_AUTH_TOKEN", "t0ken")
    server, port = create_grpc_server([_echo_registrar])
    await server.start()
    try:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _call(channel, b"x")
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await channel.close()
    finally:
        await server.stop(0)


async def test_large_messages_pass_under_the_limit() -> None:
    server, port = create_grpc_server([_echo_registrar], max_message_mb=16)
    await server.start()
    try:
        async with open_channel(f"127.0.0.1:{port}", max_message_mb=16) as channel:
            payload = bytes(range(256)) * (10 * 4096)  # 10 MiB, over gRPC's 4 MiB default
            assert await _call(channel, payload) == payload[::-1]
    finally:
        await server.stop(0)


async def test_a_port_in_use_is_an_error_naming_the_address() -> None:
    first, port = create_grpc_server([])
    await first.start()
    try:
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            create_grpc_server([], port=port)
    finally:
        await first.stop(0)


async def test_health_service_is_the_standard_one() -> None:
    server, port = create_grpc_server([])
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)
