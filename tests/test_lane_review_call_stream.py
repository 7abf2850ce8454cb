"""Review of call streams (specdec/rpc/call_stream.py): defects found, kept as regressions."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from specdec.rpc.call_stream import CallStream
from orchestrator.downstream import channel_to
from specdec.rpc.call_stream import ServedStreams
from specdec.v1 import draft_pb2, target_pb2, target_pb2_grpc
from tests.harness import DEADLINE_S
from tests.test_lanes import _request, _run

METHOD = "/specdec.v1.DraftService/ProposeAll"


class _FakeStreamCall:
    def __init__(self):
        self.cancelled = False
        self._end = asyncio.Event()

    async def initial_metadata(self):
        await self._end.wait()

    def done(self):
        return self.cancelled

    async def write(self, message):
        pass

    def cancel(self):
        self.cancelled = True
        self._end.set()

    def __aiter__(self):
        return self

    async def __anext__(self):
        await self._end.wait()
        raise StopAsyncIteration


def test_call_stream_close_right_after_open_fails_calls_and_cancels_the_stream():
    """`close` right after a call opened the stream cancelled its reader
    before the reader's first step: none of the reader's ending ran, so the
    call waited out its deadline and the gRPC stream was never cancelled."""
    async def main():
        calls = []

        def stream_method():
            calls.append(_FakeStreamCall())
            return calls[-1]

        cs = CallStream(stream_method, None, draft_pb2.ProposeAllCall, "draft")
        call = asyncio.ensure_future(cs(_request("a"), 5))
        await asyncio.sleep(0)
        assert calls
        await cs.close()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await asyncio.wait_for(call, 1)
        assert failed.value.code() is grpc.StatusCode.CANCELLED
        assert calls[0].cancelled

    _run(main())


class _Slow(target_pb2_grpc.TargetServiceServicer):
    def __init__(self):
        self.call_streams = ServedStreams()

    async def VerifyStream(self, calls, context):
        await self.call_streams.serve(calls, context, self._verify, target_pb2.VerifyReply, "slow")

    async def _verify(self, request, metadata):
        await asyncio.sleep(0.3)
        return target_pb2.VerifyResponse(batch_size=len(request.items))


@pytest.mark.xfail(strict=True, reason="not fixed: a call over the service's receive limit ends the whole stream")
def test_a_call_over_the_services_receive_limit_fails_alone_on_a_call_stream():
    """Over unary calls (and on a lane) only the oversized call fails
    RESOURCE_EXHAUSTED; on a call stream grpc ends the stream, and every
    call in flight on it fails RESOURCE_EXHAUSTED too."""
    async def main():
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 1 << 16)])
        target_pb2_grpc.add_TargetServiceServicer_to_server(_Slow(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = channel_to(f"127.0.0.1:{port}")
        stub = target_pb2_grpc.TargetServiceStub(channel)
        calls = CallStream(stub.VerifyStream, stub.Verify, target_pb2.VerifyCall, "target")
        try:
            small = asyncio.ensure_future(calls(target_pb2.VerifyRequest(items=[target_pb2.VerifyItem()]), DEADLINE_S))
            await asyncio.sleep(0.1)  # on the stream, being answered
            big = target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(append_token_ids=list(range(40000)))])
            with pytest.raises(grpc.aio.AioRpcError) as too_big:
                await calls(big, DEADLINE_S)
            assert too_big.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (await small).batch_size == 1
        finally:
            await calls.close()
            await channel.close()
            await server.stop(0)

    _run(main())
