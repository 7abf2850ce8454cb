"""Review of the lane client (specdec/rpc/lane_client.py): defects found, kept as regressions."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from specdec.rpc import lane as lane_mod
from tests.test_lanes import _client, _request, _run, read_frame

METHOD = "/specdec.v1.DraftService/ProposeAll"


def test_a_caller_whose_deadline_ends_while_the_lane_opens_does_not_mark_it_down():
    """The opening ran under the first caller's timeout: a call with little
    time left timed it out, the lane was logged as not opening and left for
    RETRY_S (every call meanwhile on gRPC). Now the caller fails
    DEADLINE_EXCEEDED and the opening goes on, for the next call."""
    async def main():
        async def slow_welcome(reader, writer):
            await read_frame(reader, 1024)
            await asyncio.sleep(0.3)
            writer.write(lane_mod.frame(b""))
            await writer.drain()
            await reader.read()
            writer.close()

        server = await asyncio.start_server(slow_welcome, "127.0.0.1", 0)
        client = _client(server.sockets[0].getsockname()[1])
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await client(_request("a"), 0.05)
        assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert client.usable()
        await asyncio.sleep(0.5)
        assert client._connection is not None  # the opening finished, for the next call
        await client.close()
        server.close()

    _run(main())
