"""What one caller can hold open on our gRPC servers (specdec/rpc/serving.py,
docs/security.md "Bounded calls"): the main port's --max-concurrent-rpcs, the
plaintext health-only port's fixed bound, and the share of either that
Health/Watch streams may take.

A refused call gets RESOURCE_EXHAUSTED with a message at once, never a hang.
On the health-only port, Watches alone never refuse a probe's Check: they may
hold a quarter of the bound. When the whole bound is held (calls that never
send their request), a Check is refused too: that is correct, the other way
is memory without bound, and the port's connection age gives those places
back. Everything binds port 0 on 127.0.0.1, calls carry deadlines, and each
test stops what it starts."""
from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.cli.main import build_parser
from specdec.config import from_args
from specdec.rpc import serving
from specdec.rpc.serving import (HEALTH_PORT_MAX_CONCURRENT_RPCS, SERVICE_MAX_CONCURRENT_RPCS, ServerConfig,
                                 start_server, watch_limit)

Status = health_pb2.HealthCheckResponse
CHECK = "/grpc.health.v1.Health/Check"
HOLD = "/test.Hold/Hold"
DEADLINE_S = 10.0  # of every call here: a hang fails the test instead of stalling it


def local(**kwargs) -> ServerConfig:
    return ServerConfig(host="127.0.0.1", port=0, **kwargs)


class Holds:
    """A method whose calls wait until released: N of them are N concurrent RPCs."""

    def __init__(self):
        self.started = 0
        self.release = asyncio.Event()

    async def hold(self, request, context):
        self.started += 1
        await self.release.wait()
        return Status(status=Status.SERVING)

    def register(self, server: grpc.aio.Server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(
            self.hold, request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=Status.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Hold", {"Hold": handler}),))


@contextlib.asynccontextmanager
async def serving_at(cfg: ServerConfig, register=lambda server: None):
    running = await start_server(cfg, register, ["test.Service"])
    try:
        await running.set_serving()
        yield running
    finally:
        await running.drain(0)


@contextlib.asynccontextmanager
async def channel_to(port: int):
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel
    finally:
        await channel.close()


async def check(channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S)
    return reply.status


async def open_watches(channel, n: int) -> list:
    """n Watch streams, each past its first reply (so each is held open at the server)."""
    stub = health_pb2_grpc.HealthStub(channel)
    watches = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S) for _ in range(n)]
    for watch in watches:
        assert (await watch.read()).status == Status.SERVING
    return watches


async def refused(call) -> grpc.aio.AioRpcError:
    """The error `call` (a coroutine, or a stream's first read) ends with; it must end well before its deadline."""
    start = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert time.monotonic() - start < DEADLINE_S / 2, "refused only at the deadline: a hang"
    return caught.value


async def stalled_calls(channel, n: int) -> tuple[list, asyncio.Event]:
    """n calls to Health/Check that never send their request: each holds one
    of the server's places until cancelled (or its connection closes)."""
    never = asyncio.Event()

    async def no_request():
        await never.wait()
        yield health_pb2.HealthCheckRequest()

    stall = channel.stream_unary(CHECK, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                 response_deserializer=Status.FromString)
    calls = [stall(no_request(), timeout=DEADLINE_S * 3) for _ in range(n)]
    return calls, never


async def until(predicate, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


# ------------------------------------------------------------ the flag


def _server_config(argv: list[str]) -> ServerConfig:
    return from_args(ServerConfig, build_parser().parse_args(argv))


def test_the_flag_sets_the_bound_with_a_default_per_role():
    assert _server_config(["serve", "target", "--max-concurrent-rpcs", "4"]).max_concurrent_rpcs == 4
    assert _server_config(["serve", "draft"]).max_concurrent_rpcs == SERVICE_MAX_CONCURRENT_RPCS == 1024
    assert _server_config(["serve", "target"]).max_concurrent_rpcs == SERVICE_MAX_CONCURRENT_RPCS
    # The orchestrator's is the dataclass default (also what in-process servers get).
    assert _server_config(["serve", "orchestrator"]).max_concurrent_rpcs == ServerConfig().max_concurrent_rpcs == 4096


def test_the_flag_is_in_each_roles_help(capsys):
    for role in ("draft", "target", "orchestrator"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", role, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "--max-concurrent-rpcs" in out and "RESOURCE_EXHAUSTED" in out, role
        assert f"own bound: {HEALTH_PORT_MAX_CONCURRENT_RPCS} calls" in out, role


@pytest.mark.parametrize("value", [0, -1])
def test_a_bound_below_one_is_refused(value):
    with pytest.raises(ValueError, match=f"--max-concurrent-rpcs must be at least 1, got {value}"):
        ServerConfig(max_concurrent_rpcs=value)


# ------------------------------------------------------- the main port


def test_the_main_port_refuses_the_call_past_its_bound_and_takes_calls_again_once_one_ends():
    async def run():
        n = 4
        cfg = _server_config(["serve", "target", "--host", "127.0.0.1", "--port", "0", "--max-concurrent-rpcs", str(n)])
        holds = Holds()
        async with serving_at(cfg, holds.register) as running, channel_to(running.port) as channel:
            hold = channel.unary_unary(HOLD, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                       response_deserializer=Status.FromString)
            held = [hold(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S) for _ in range(n)]
            try:
                async def all_started():
                    return holds.started == n

                await until(all_started)
                error = await refused(hold(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S))
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
                assert error.details(), "refused without a message"
                assert holds.started == n  # the refused call never reached the method
                # So is a health Check: the bound counts every call on the port.
                error = await refused(check(channel))
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            finally:
                holds.release.set()
            assert [(await call).status for call in held] == [Status.SERVING] * n
            assert await check(channel) == Status.SERVING
            assert (await hold(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S)).status == Status.SERVING

    asyncio.run(run())


def test_watch_streams_on_the_main_port_hold_a_quarter_of_its_bound_and_never_crowd_out_calls():
    async def run():
        n = 8
        limit = watch_limit(n)
        assert limit == 2
        holds = Holds()
        async with serving_at(local(max_concurrent_rpcs=n), holds.register) as running, \
                channel_to(running.port) as channel:
            watches = await open_watches(channel, limit)
            try:
                error = await refused(open_watches(channel, 1))
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
                assert f"at most {limit} at once" in error.details(), error.details()
                assert await check(channel) == Status.SERVING
                holds.release.set()
                hold = channel.unary_unary(HOLD, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                           response_deserializer=Status.FromString)
                assert (await hold(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S)).status == Status.SERVING
            finally:
                for watch in watches:
                    watch.cancel()
            # A Watch that ended gives its place back.
            async def a_watch_opens():
                with contextlib.suppress(grpc.aio.AioRpcError):
                    (again,) = await open_watches(channel, 1)
                    again.cancel()
                    return True
                return False

            await until(a_watch_opens)

    asyncio.run(run())


# ------------------------------------------------- the health-only port


def test_the_health_port_refuses_watches_past_its_share_while_checks_still_answer():
    async def run():
        limit = watch_limit(HEALTH_PORT_MAX_CONCURRENT_RPCS)
        assert 1 <= limit < HEALTH_PORT_MAX_CONCURRENT_RPCS
        async with serving_at(local(health_port=0)) as running, channel_to(running.health_port) as channel:
            watches = await open_watches(channel, limit)
            try:
                for _ in range(3):  # the excess is refused, not queued
                    error = await refused(open_watches(channel, 1))
                    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
                    assert "Health/Watch" in error.details() and "use Health/Check" in error.details()
                # A probe's Check still answers, with the status the main port's server sets.
                assert await check(channel) == Status.SERVING
                await running.set_status(Status.NOT_SERVING)
                assert await check(channel) == Status.NOT_SERVING
            finally:
                for watch in watches:
                    watch.cancel()

    asyncio.run(run())


def test_the_health_port_has_a_bound_on_all_calls_and_a_check_past_it_is_refused_not_queued():
    """Calls that never send their request hold places Watch's share does
    not cover. With the whole bound held, a Check is refused at once: a
    refusal the prober sees (and the connection age ends) rather than a
    server that grows for whoever connects."""
    async def run():
        async with serving_at(local(health_port=0)) as running, channel_to(running.health_port) as channel:
            calls, never = await stalled_calls(channel, HEALTH_PORT_MAX_CONCURRENT_RPCS)
            try:
                async def a_check_is_refused():
                    try:
                        await check(channel)
                    except grpc.aio.AioRpcError as error:
                        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
                        assert error.details(), "refused without a message"
                        return True
                    return False

                await until(a_check_is_refused)
                error = await refused(check(channel))  # and promptly, each time
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            finally:
                for call in calls:
                    call.cancel()
                never.set()

            async def a_check_answers():
                with contextlib.suppress(grpc.aio.AioRpcError):
                    return await check(channel) == Status.SERVING
                return False

            await until(a_check_answers)

    asyncio.run(run())


def test_the_health_port_ends_calls_that_outlive_its_connection_age(monkeypatch):
    """What gives a stalled call's or a Watch's place back without its caller:
    the health-only port closes each connection after a maximum age."""
    monkeypatch.setattr(serving, "HEALTH_PORT_MAX_CONNECTION_AGE_MS", 300)
    monkeypatch.setattr(serving, "HEALTH_PORT_MAX_CONNECTION_AGE_GRACE_MS", 300)

    async def run():
        async with serving_at(local(health_port=0)) as running, channel_to(running.health_port) as channel:
            (watch,) = await open_watches(channel, 1)
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await watch.read()
            assert caught.value.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "the Watch lasted to its deadline"
            assert time.monotonic() - start < DEADLINE_S / 2
            assert await check(channel) == Status.SERVING  # a new connection serves

    asyncio.run(run())


def test_a_port_in_use_is_refused_not_shared():
    """grpc binds with SO_REUSEPORT unless told not to: a second server on a
    port in use bound it too, and the kernel split the connections between
    the two processes. Now the second start fails, saying which port."""
    import asyncio

    from specdec.rpc.serving import ServerConfig, start_server

    async def run():
        first = await start_server(ServerConfig(port=0, health_port=0), lambda s: None, [])
        try:
            with pytest.raises(OSError, match=rf"cannot bind 127.0.0.1:{first.port}: another process"):
                await start_server(ServerConfig(port=first.port), lambda s: None, [])
            with pytest.raises(OSError, match=rf"cannot bind the health port 127.0.0.1:{first.health_port}"):
                await start_server(ServerConfig(port=0, health_port=first.health_port), lambda s: None, [])
        finally:
            await first.drain(0)

    asyncio.run(run())
