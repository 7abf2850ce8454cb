"""Unary calls carried on long-lived streams (specdec/rpc/call_stream.py):
the same replies and the same statuses as unary calls, a failed or late call
that leaves the stream serving, a drain that ends the streams, and the
fallback to unary calls against a service without them."""
from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from orchestrator.downstream import DraftClient, TargetClient, channel_to, open_request
from specdec.rpc.call_stream import CallStream, ServedStreams
from specdec.rpc.session_limits import SessionLimits
from specdec.v1 import target_pb2, target_pb2_grpc
from tests.conftest import tiny_engine
from tests.harness import DEADLINE_S, BackgroundLoop, running_draft, running_target

PROMPT = [5, 9, 14, 3, 22, 7]


@pytest.fixture(scope="module")
def services():
    """A target and a draft service over tiny engines, and a loop for the clients."""
    target_engine, draft_engine = tiny_engine(seed=0), tiny_engine(seed=1)
    client_loop = BackgroundLoop()
    with running_target(target_engine, SessionLimits(max_verify_batch=4)) as (target, _, _), \
            running_draft(draft_engine) as (draft, _, _):
        yield target, draft, client_loop
    client_loop.close()


def _clients(target, draft, call_streams: bool):
    return (TargetClient(channel_to(f"127.0.0.1:{target.port}"), call_streams=call_streams),
            DraftClient(channel_to(f"127.0.0.1:{draft.port}"), call_streams=call_streams))


async def _greedy_rounds(target, draft, call_streams: bool, rounds: int = 5) -> list[list[int]]:
    """`rounds` rounds of k=3 greedy drafts + Verify; the target's argmax ids of each."""
    target_client, draft_client = _clients(target, draft, call_streams)
    request = open_request(PROMPT, 0.0, 0, 1.0, 1, 64, "call-streams")
    t_sid, _ = await target_client.open(request, DEADLINE_S)
    d_sid, _ = await draft_client.open(request, DEADLINE_S)
    length, append, seen = len(PROMPT), [], []
    try:
        for _ in range(rounds):
            drafts, _ = await draft_client.propose(d_sid, length, append, 3, DEADLINE_S)
            ids = [d.token_id for d in drafts]
            item = target_pb2.VerifyItem(session_id=t_sid, keep_length=length, append_token_ids=append,
                                         draft_token_ids=ids)
            reply, _ = await target_client.verify([item], DEADLINE_S)
            argmax = list(reply.results[0].argmax_token_ids)
            seen.append(ids + argmax)
            accepted = 0
            while accepted < len(ids) and ids[accepted] == argmax[accepted]:
                accepted += 1
            length += len(append) + accepted
            append = [argmax[accepted]]
        if call_streams:  # the calls went on the streams, not as unary calls
            assert target_client.verify_calls.enabled and draft_client.propose_all.enabled
    finally:
        await target_client.close(t_sid, DEADLINE_S)
        await draft_client.close(d_sid, DEADLINE_S)
        await target_client.aclose()
        await draft_client.aclose()
    return seen


def test_rounds_on_call_streams_match_unary_calls(services):
    target, draft, loop = services
    on_streams = loop.run(_greedy_rounds(target, draft, call_streams=True))
    as_unary = loop.run(_greedy_rounds(target, draft, call_streams=False))
    assert on_streams == as_unary
    assert len(on_streams) == 5


async def _status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code(), caught.value.details()


class StreamsOpened(grpc.aio.StreamStreamClientInterceptor):
    """Notes the method of each stream a channel opens."""

    def __init__(self):
        self.methods: list[str] = []

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        method = client_call_details.method
        self.methods.append(method.decode() if isinstance(method, bytes) else method)
        return await continuation(client_call_details, request_iterator)


async def _failed_call_then_more(target) -> None:
    opened = StreamsOpened()
    on_stream, as_unary = (TargetClient(channel_to(f"127.0.0.1:{target.port}", interceptors=interceptors),
                                        call_streams=flag)
                           for flag, interceptors in ((True, [opened]), (False, ())))
    try:
        t_sid, _ = await on_stream.open(open_request(PROMPT, 0.0, 0, 1.0, 1, 64, "bad"), DEADLINE_S)
        too_many = [target_pb2.VerifyItem(session_id=t_sid, draft_token_ids=[5])] * 5  # max_verify_batch is 4
        stream_status = await _status(on_stream.verify(too_many, DEADLINE_S))
        unary_status = await _status(as_unary.verify(too_many, DEADLINE_S))
        assert stream_status == unary_status
        assert stream_status[0] is grpc.StatusCode.INVALID_ARGUMENT
        assert opened.methods == ["/specdec.v1.TargetService/VerifyStream"]
        # The stream goes on: the next call is answered on it, no new stream opened.
        reply, _ = await on_stream.verify([target_pb2.VerifyItem(session_id=t_sid, draft_token_ids=[5])],
                                          DEADLINE_S)
        assert len(reply.results[0].argmax_token_ids) == 2
        assert len(opened.methods) == 1
        # An unknown session is a per-item error, as with a unary call.
        reply, _ = await on_stream.verify([target_pb2.VerifyItem(session_id="nope", draft_token_ids=[5])],
                                          DEADLINE_S)
        assert reply.results[0].error.code == grpc.StatusCode.NOT_FOUND.value[0]
        await on_stream.close(t_sid, DEADLINE_S)
    finally:
        await on_stream.aclose()
        await as_unary.aclose()


def test_a_failed_call_gets_the_unary_status_and_the_stream_goes_on(services):
    target, _, loop = services
    loop.run(_failed_call_then_more(target))


async def _late_and_concurrent_calls(draft) -> None:
    client = DraftClient(channel_to(f"127.0.0.1:{draft.port}"))
    try:
        sids = []
        for i in range(3):
            sid, _ = await client.open(open_request(PROMPT[: 3 + i], 0.0, 0, 1.0, 1, 64, f"c{i}"), DEADLINE_S)
            sids.append(sid)
        status = await _status(client.propose(sids[0], None, [], 2, timeout=1e-6))
        assert status[0] is grpc.StatusCode.DEADLINE_EXCEEDED
        # Concurrent calls on one stream each get their own reply (matched by
        # call_id); the late reply of the call above is dropped.
        results = await asyncio.gather(*(client.propose(sid, 3 + i, [], 2 + i, DEADLINE_S)
                                         for i, sid in enumerate(sids)))
        for i, (drafts, _) in enumerate(results):
            assert [d.index for d in drafts] == list(range(2 + i))
            assert drafts[-1].length == 3 + i + 2 + i
        for sid in sids:
            await client.close(sid, DEADLINE_S)
    finally:
        await client.aclose()


def test_a_late_call_leaves_the_stream_serving_and_concurrent_calls_get_their_own_replies(services):
    _, draft, loop = services
    loop.run(_late_and_concurrent_calls(draft))


async def _malformed(target) -> tuple[grpc.StatusCode, str]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{target.port}")
    try:
        call = channel.stream_stream("/specdec.v1.TargetService/VerifyStream")()
        await call.write(b"\xff\xff\xff")
        return await _status(call.read())
    finally:
        await channel.close()


def test_a_message_that_is_not_a_call_ends_the_stream_with_invalid_argument(services):
    target, _, loop = services
    code, details = loop.run(_malformed(target))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid protobuf message" in details


class _UnaryOnlyTarget(target_pb2_grpc.TargetServiceServicer):
    """An older target service: Verify, but no VerifyStream."""

    async def Verify(self, request, context):
        return target_pb2.VerifyResponse(batch_size=len(request.items))


async def _target_server(servicer, options=()) -> tuple[grpc.aio.Server, int]:
    """A started grpc.aio server of `servicer` on 127.0.0.1, and its port."""
    server = grpc.aio.server(options=list(options))
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _fallback() -> None:
    server, port = await _target_server(_UnaryOnlyTarget())
    client = TargetClient(channel_to(f"127.0.0.1:{port}"))
    try:
        for n in (1, 2):
            reply, _ = await client.verify([target_pb2.VerifyItem(session_id="s")] * n, DEADLINE_S)
            assert reply.batch_size == n
            assert not client.verify_calls.enabled
    finally:
        await client.aclose()
        await server.stop(0)


def test_a_service_without_call_streams_gets_unary_calls(services):
    services[2].run(_fallback())


class _SlowTarget(target_pb2_grpc.TargetServiceServicer):
    def __init__(self):
        self.call_streams = ServedStreams()
        self.started = asyncio.Event()

    async def VerifyStream(self, calls, context):
        await self.call_streams.serve(calls, context, self._verify, target_pb2.VerifyReply, "slow")

    async def _verify(self, request, metadata):
        self.started.set()
        await asyncio.sleep(0.2)
        return target_pb2.VerifyResponse(batch_size=7)


async def _drain() -> None:
    servicer = _SlowTarget()
    server, port = await _target_server(servicer)
    channel = channel_to(f"127.0.0.1:{port}")
    stub = target_pb2_grpc.TargetServiceStub(channel)
    calls = CallStream(stub.VerifyStream, stub.Verify, target_pb2.VerifyCall, "target")
    try:
        in_flight = asyncio.ensure_future(calls(target_pb2.VerifyRequest(), DEADLINE_S))
        await asyncio.wait_for(servicer.started.wait(), DEADLINE_S)
        # A drain ends the stream once the call it has read is answered, so a
        # grace period far longer than the test's deadline does not hold it.
        stopping = asyncio.ensure_future(server.stop(300))
        servicer.call_streams.close()
        assert (await asyncio.wait_for(in_flight, DEADLINE_S)).batch_size == 7
        await asyncio.wait_for(stopping, DEADLINE_S)
        # The server is gone: a call fails with UNAVAILABLE, it does not hang.
        code, _ = await _status(calls(target_pb2.VerifyRequest(), DEADLINE_S))
        assert code is grpc.StatusCode.UNAVAILABLE
    finally:
        await calls.close()
        await channel.close()
        await server.stop(0)


def test_a_drain_ends_the_call_streams_after_answering_what_they_read(services):
    services[2].run(_drain())


def test_calls_in_flight_fail_with_unavailable_when_the_service_dies(caplog):
    """The stream breaks: every call waiting on it fails at once, none hangs,
    and no reply is delivered to the wrong call."""
    client_loop = BackgroundLoop()
    try:
        with running_target(tiny_engine(seed=0)) as (target, _, server_loop):
            async def start_calls():
                client = TargetClient(channel_to(f"127.0.0.1:{target.port}"))
                sid, _ = await client.open(open_request(PROMPT, 0.0, 0, 1.0, 1, 64, "dies"), DEADLINE_S)
                await client.verify([target_pb2.VerifyItem(session_id=sid, draft_token_ids=[5])], DEADLINE_S)
                return client, sid

            client, sid = client_loop.run(start_calls())
            server_loop.run(target.running.server.stop(0))

            async def call_after():
                try:
                    return await _status(client.verify([target_pb2.VerifyItem(session_id=sid)], DEADLINE_S))
                finally:
                    await client.aclose()

            code, _ = client_loop.run(call_after())
            assert code is grpc.StatusCode.UNAVAILABLE
    finally:
        client_loop.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_concurrent_calls_on_a_stream_the_service_lacks_all_fall_back_to_unary():
    async def main():
        server, port = await _target_server(_UnaryOnlyTarget())
        client = TargetClient(channel_to(f"127.0.0.1:{port}"))
        try:
            replies = await asyncio.gather(*(client.verify([target_pb2.VerifyItem(session_id="s")], DEADLINE_S)
                                             for _ in range(3)))
            assert [reply.batch_size for reply, _ in replies] == [1, 1, 1]
        finally:
            await client.aclose()
            await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), DEADLINE_S))


class _BigReplies(target_pb2_grpc.TargetServiceServicer):
    """Replies as large as the request's keep_length asks."""

    def __init__(self, limit: int):
        self.call_streams = ServedStreams(max_message_bytes=limit)

    async def VerifyStream(self, calls, context):
        await self.call_streams.serve(calls, context, self._verify, target_pb2.VerifyReply, "big")

    async def _verify(self, request, metadata):
        n = request.items[0].keep_length
        return target_pb2.VerifyResponse(results=[target_pb2.VerifyResult(argmax_token_ids=[1] * n)])


def test_a_reply_over_the_services_limit_fails_its_call_alone_on_a_call_stream():
    """As a unary call's would (RESOURCE_EXHAUSTED), and as on a lane: the
    stream, and the calls in flight on it, go on."""
    async def main():
        limit = 1 << 20
        server, port = await _target_server(_BigReplies(limit), [("grpc.max_send_message_length", limit)])
        channel = channel_to(f"127.0.0.1:{port}")
        stub = target_pb2_grpc.TargetServiceStub(channel)
        calls = CallStream(stub.VerifyStream, stub.Verify, target_pb2.VerifyCall, "target")

        def request(n):
            return target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(keep_length=n)])

        try:
            big, small = await asyncio.gather(_status(calls(request(limit), DEADLINE_S)),
                                              calls(request(3), DEADLINE_S))
            assert big[0] is grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-message-bytes" in big[1]
            assert list(small.results[0].argmax_token_ids) == [1, 1, 1]
            after = await calls(request(2), DEADLINE_S)
            assert list(after.results[0].argmax_token_ids) == [1, 1]
        finally:
            await calls.close()
            await channel.close()
            await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), DEADLINE_S))


class _CountingTarget(target_pb2_grpc.TargetServiceServicer):
    """Counts the calls it answers; each reply 40 KB, more than HTTP/2's
    windows hold for a caller that does not read."""

    def __init__(self):
        self.call_streams = ServedStreams()
        self.answered = 0

    async def VerifyStream(self, calls, context):
        await self.call_streams.serve(calls, context, self._verify, target_pb2.VerifyReply, "counting")

    async def _verify(self, request, metadata):
        self.answered += 1
        return target_pb2.VerifyResponse(results=[target_pb2.VerifyResult(target_probs=[0.5] * 10000)])


def test_a_caller_that_never_reads_its_replies_holds_a_bounded_number_of_calls():
    """Reading waits past MAX_CALLS_IN_FLIGHT calls being answered, as a
    lane's does: a caller that sends calls and reads no reply had every one
    computed and its reply held (6000 calls: 6000 tasks, +260 MB). Once the
    caller reads, every call is answered."""
    from specdec.rpc.lane_server import MAX_CALLS_IN_FLIGHT

    n = MAX_CALLS_IN_FLIGHT * 3

    async def main():
        service = _CountingTarget()
        server, port = await _target_server(service)
        channel = channel_to(f"127.0.0.1:{port}")
        call = channel.stream_stream("/specdec.v1.TargetService/VerifyStream",
                                     request_serializer=target_pb2.VerifyCall.SerializeToString,
                                     response_deserializer=target_pb2.VerifyReply.FromString)
        stream = call(target_pb2.VerifyCall(call_id=i + 1) for i in range(n))
        try:
            settled, last = 0, -1
            while settled < 10:  # until the count stops moving for a second
                await asyncio.sleep(0.1)
                settled = settled + 1 if service.answered == last else 0
                last = service.answered
            assert MAX_CALLS_IN_FLIGHT <= service.answered < 2 * MAX_CALLS_IN_FLIGHT
            ids = [reply.call_id async for reply in stream]
            assert sorted(ids) == list(range(1, n + 1))
        finally:
            stream.cancel()
            await channel.close()
            await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), DEADLINE_S))
