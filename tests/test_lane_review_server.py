"""Review of the lane server (specdec/rpc/lane_server.py): unauthenticated and idle connections, refused callers, drains."""
from __future__ import annotations

import asyncio
import time

import pytest

from specdec.rpc import lane as lane_mod
from specdec.rpc import lane_server as lane_server_mod
from specdec.v1 import draft_pb2
from tests.test_lanes import _request, _run, _server, read_frame

METHOD = "/specdec.v1.DraftService/ProposeAll"


def test_idle_connection_closed_after_hello_timeout(monkeypatch):
    monkeypatch.setattr(lane_server_mod, "HELLO_S", 0.3)

    async def main():
        server = await _server()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        start = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert time.monotonic() - start < 3
        assert not server._connections or await asyncio.sleep(0.05) is None
        assert not server._connections
        writer.close()
        server.close()

    _run(main())


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_tls_silent_tcp_and_refused_callers_pipelined_call(tmp_path, monkeypatch, loop_kind):
    """Under TLS: a TCP connection that never starts the handshake, and one that
    handshakes and says nothing, end within HELLO_S; a caller the lane refuses
    gets its refusal and nothing else, even for a call sent behind its hello."""
    from specdec.rpc.lane_server import LaneTls
    from specdec.security.local_ca import LocalTls
    from specdec.security.tls import ClientTls

    monkeypatch.setattr(lane_server_mod, "HELLO_S", 0.5)
    tls = LocalTls.create(tmp_path)
    own = tls.files["draft"]
    other = tls.files["target"]

    async def main():
        server = await _server(LaneTls(own.cert, own.key, own.ca, frozenset({"orchestrator"})))
        # silent TCP: no TLS handshake at all
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        start = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert time.monotonic() - start < 3
        writer.close()
        # a refused caller pipelining a call behind its hello
        context = ClientTls(other.ca, other.cert, other.key).ssl_context()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=context,
                                                       server_hostname="localhost")
        call = draft_pb2.ProposeAllCall(call_id=1, request=_request("a"))
        writer.write(lane_mod.frame(METHOD.encode()) + lane_mod.frame(call.SerializeToString()))
        refusal = await asyncio.wait_for(read_frame(reader, 1 << 16), 5)
        assert b"names target" in refusal
        rest = await asyncio.wait_for(reader.read(), 5)
        assert rest == b""
        assert server.answered == 0
        writer.close()
        # a TLS client that handshakes and then says nothing
        good = tls.files["orchestrator"]
        context = ClientTls(good.ca, good.cert, good.key).ssl_context()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=context,
                                                       server_hostname="localhost")
        start = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert time.monotonic() - start < 3
        writer.close()
        server.close()
        await server.wait_closed(1)

    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(asyncio.wait_for(main(), 30))
    else:
        _run(main())


def test_a_drain_past_its_grace_ends_a_connection_whose_caller_never_reads():
    import socket

    from specdec.rpc.lane_server import LaneServer

    async def big(request, trace_context):
        return draft_pb2.ProposeAllResponse(drafts=[draft_pb2.ProposeResponse(token_id=i) for i in range(200_000)])

    async def main():
        server = LaneServer(METHOD, big, draft_pb2.ProposeAllCall, draft_pb2.ProposeAllReply, "fake", 64 << 20)
        await server.start("127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", server.port))
            calls = b"".join(lane_mod.frame(draft_pb2.ProposeAllCall(call_id=i).SerializeToString())
                             for i in range(1, 5))
            await loop.sock_sendall(sock, lane_mod.frame(METHOD.encode()) + calls)
            await asyncio.sleep(0.5)  # replies written, none read: their answers wait in drain()
            assert server._connections
            server.close()
            await server.wait_closed(0.3)
            await asyncio.sleep(0.2)
            assert not server._connections, "a connection outlived the drain's grace"
            assert not [t for t in asyncio.all_tasks() if "_answer" in repr(t.get_coro())]
        finally:
            sock.close()

    _run(main())

