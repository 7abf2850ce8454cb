"""A service's lane (specdec/rpc/lane.py): the round's call as frames on a
TCP connection, with the semantics of a call stream (the same replies and
statuses, the caller's deadline, calls that overlap), a fallback to gRPC
when the lane cannot be opened, calls in flight failed UNAVAILABLE when it
breaks, malformed or oversized frames that end only their own connection, a
drain, mutual TLS with the same callers as the gRPC port, and end to end:
the orchestrator's rounds go on the lanes with the tokens unchanged."""
from __future__ import annotations

import asyncio
import socket
import struct
import threading

import grpc
import pytest

from orchestrator.downstream import DraftClient, LaneDialing, TargetClient, channel_to, open_request
from specdec.errors import InvalidArgument
from specdec.rpc import lane as lane_mod
from specdec.rpc.lane import LaneDown
from specdec.rpc.lane_client import RETRY_S, LaneClient
from specdec.rpc.lane_server import LaneServer, LaneTls
from specdec.v1 import draft_pb2
from tests.conftest import tiny_engine, tiny_model
from tests.harness import DEADLINE_S, BackgroundLoop, running_draft, running_system, running_target
from tests.test_orchestrator import greedy_reference, perturbed

METHOD = "/specdec.v1.DraftService/ProposeAll"

async def read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    """A raw client's read of the next frame's payload (the lanes' framing:
    a 4-byte big-endian length, then the bytes); ValueError over `limit`."""
    size = int.from_bytes(await reader.readexactly(lane_mod.HEADER), "big")
    if size > limit:
        raise ValueError(f"a frame of {size} bytes is over the limit of {limit}")
    return await reader.readexactly(size)



async def _handle(request, trace_context):
    """A fake ProposeAll: session "bad" is the caller's error, "bug" ours,
    "slow-N" answers after N ms; otherwise drafts echo keep_length."""
    sid = request.propose.session_id
    if sid == "bad":
        raise InvalidArgument("no such thing")
    if sid == "bug":
        raise RuntimeError("a bug")
    if sid.startswith("slow-"):
        await asyncio.sleep(int(sid[5:]) / 1000)
    return draft_pb2.ProposeAllResponse(drafts=[draft_pb2.ProposeResponse(token_id=request.propose.keep_length)])


def _request(session_id: str, keep: int = 7) -> draft_pb2.ProposeAllRequest:
    return draft_pb2.ProposeAllRequest(propose=draft_pb2.ProposeRequest(session_id=session_id, keep_length=keep))


async def _server(tls=None, limit: int = 1 << 20) -> LaneServer:
    server = LaneServer(METHOD, _handle, draft_pb2.ProposeAllCall, draft_pb2.ProposeAllReply, "fake", limit, tls)
    await server.start("127.0.0.1", 0)
    return server


def _client(port: int, **kwargs) -> LaneClient:
    return LaneClient("127.0.0.1", port, METHOD, draft_pb2.ProposeAllCall, draft_pb2.ProposeAllReply, "draft",
                      **kwargs)


def _run(coro, timeout_s: float = DEADLINE_S):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def _until(condition, timeout_s: float = 20.0) -> None:
    """Return once `condition()` holds, polled on this loop; fail after `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def test_replies_statuses_deadlines_and_overlapping_calls():
    async def main():
        server = await _server()
        client = _client(server.port)
        try:
            reply = await client(_request("a", keep=11), 5)
            assert [d.token_id for d in reply.drafts] == [11]
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await client(_request("bad"), 5)
            assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "no such thing" in bad.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as bug:
                await client(_request("bug"), 5)
            assert bug.value.code() is grpc.StatusCode.INTERNAL and "a bug" not in bug.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await client(_request("slow-30000"), 0.05)
            assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            # Calls of one connection overlap: the quick one is not held behind the slow one.
            slow = asyncio.ensure_future(client(_request("slow-3000", keep=1), 10))
            quick = await client(_request("a", keep=2), 5)
            assert not slow.done() and quick.drafts[0].token_id == 2
            assert (await slow).drafts[0].token_id == 1
            assert server.answered == 5  # the late call's handler still runs; its reply would be dropped
        finally:
            await client.close()
            server.close()

    _run(main())


def test_a_lane_that_cannot_be_opened_is_left_for_a_while_and_the_call_goes_by_grpc():
    async def main():
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
        free.close()  # nothing listens there
        now = [100.0]
        client = _client(port, clock=lambda: now[0])
        with pytest.raises(LaneDown, match="could not be opened"):
            await client(_request("a"), 5)
        assert not client.usable()
        now[0] += RETRY_S
        assert client.usable()

        server = await _server()
        wrong = LaneClient("127.0.0.1", server.port, "/specdec.v1.TargetService/Verify", draft_pb2.ProposeAllCall,
                           draft_pb2.ProposeAllReply, "target")
        with pytest.raises(LaneDown, match="answers /specdec.v1.DraftService/ProposeAll, not"):
            await wrong(_request("a"), 5)
        server.close()

    _run(main())


def test_calls_in_flight_fail_unavailable_when_the_lane_breaks_and_the_next_call_reconnects():
    async def main():
        server = await _server()
        client = _client(server.port)
        await client(_request("a"), 5)
        in_flight = asyncio.ensure_future(client(_request("slow-2000"), 5))
        await asyncio.sleep(0.1)
        client._connection.protocol.transport.abort()  # the connection breaks
        with pytest.raises(grpc.aio.AioRpcError) as broke:
            await in_flight
        assert broke.value.code() is grpc.StatusCode.UNAVAILABLE and "lane" in broke.value.details()
        reply = await client(_request("a", keep=3), 5)  # a new connection
        assert reply.drafts[0].token_id == 3
        await client.close()
        server.close()

    _run(main())


@pytest.mark.parametrize("garbage", ["unparsable", "oversized"])
def test_a_bad_frame_ends_only_its_own_connection(garbage):
    async def main():
        server = await _server(limit=1024)
        client = _client(server.port)
        await client(_request("a"), 5)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(lane_mod.frame(METHOD.encode()))
        assert await read_frame(reader, 1024) == b""  # welcomed
        if garbage == "unparsable":
            writer.write(lane_mod.frame(b"\xff\xff\xff\xff not a call"))
        else:  # read past to its end, and no call id to answer for
            writer.write(struct.pack(">I", 1 << 20) + b"\xff" * (1 << 20))
        assert await reader.read() == b""  # the server ended it
        writer.close()
        assert (await client(_request("a", keep=5), 5)).drafts[0].token_id == 5  # the other connection serves on
        await client.close()
        server.close()

    _run(main())


def test_a_call_sent_right_behind_the_hello_is_answered_under_the_message_limit():
    """The hello is read under its own small limit; a call that arrives in
    the same bytes (a client that does not wait for the welcome) is read
    under the message limit once the hello is answered."""
    async def main():
        server = await _server(limit=1 << 20)
        call = draft_pb2.ProposeAllCall(call_id=7, request=_request("x" * 3000, keep=9)).SerializeToString()
        assert len(call) > 1024  # over the hello's limit
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(lane_mod.frame(METHOD.encode()) + lane_mod.frame(call))
        assert await read_frame(reader, 1024) == b""  # welcomed
        reply = draft_pb2.ProposeAllReply.FromString(await read_frame(reader, 1 << 20))
        assert reply.call_id == 7 and reply.response.drafts[0].token_id == 9
        writer.close()
        server.close()

    _run(main())


def test_a_drain_answers_what_was_read_and_refuses_new_connections():
    async def main():
        server = await _server()
        client = _client(server.port)
        await client(_request("a"), 5)
        in_flight = asyncio.ensure_future(client(_request("slow-200", keep=4), 5))
        await asyncio.sleep(0.05)
        server.close()
        assert (await in_flight).drafts[0].token_id == 4
        late = _client(server.port)
        with pytest.raises(LaneDown):
            await late(_request("a"), 5)
        await client.close()

    _run(main())


def test_call_stream_uses_the_lane_then_grpc_when_the_lane_is_down():
    draft_engine = tiny_engine(seed=1)
    with running_draft(draft_engine) as (draft, _, service_loop):
        assert draft.lane is not None and draft.servicer.lane_port == draft.lane.port > 0

        async def main():
            client = DraftClient(channel_to(f"127.0.0.1:{draft.port}"))
            info = await client.fetch_info(DEADLINE_S)
            assert info.lane_port == draft.lane.port
            assert client.use_lane("127.0.0.1")
            sid, _ = await client.open(open_request([5, 9, 14], 0.0, 0, 1.0, 1, 32, "lanes"), DEADLINE_S)
            before = draft.lane.answered
            on_lane, _ = await client.propose(sid, 3, [], 3, DEADLINE_S)
            assert draft.lane.answered == before + 1
            # The lane goes away (the service stops listening there, and the open connection
            # breaks): the call goes on the gRPC stream, in the time the failed opening left.
            service_loop.loop.call_soon_threadsafe(draft.lane.close)  # on the service's own loop
            # Its drain ends the connection; the client sees it end.
            await _until(lambda: client.propose_all.lane._connection is None)
            by_grpc, _ = await client.propose(sid, 3, [], 3, DEADLINE_S)
            assert draft.lane.answered == before + 1 and not client.propose_all.lane.usable()
            assert [d.token_id for d in by_grpc] == [d.token_id for d in on_lane]
            await client.aclose()

        draft_loop = BackgroundLoop()
        try:
            draft_loop.run(main())
        finally:
            draft_loop.close()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])  # uvloop: what the services run (specdec/eventloop.py)
def test_mutual_tls_lane_serves_allowed_callers_only(tmp_path, loop):
    from specdec.security.local_ca import LocalCA, LocalTls
    from specdec.security.tls import ClientTls

    tls = LocalTls.create(tmp_path)
    own = tls.files["draft"]
    orchestrator = tls.files["orchestrator"]

    async def main():
        server = await _server(LaneTls(own.cert, own.key, own.ca, frozenset({"orchestrator"})))
        good = ClientTls(orchestrator.ca, orchestrator.cert, orchestrator.key).ssl_context()
        client = _client(server.port, ssl_context=good, server_hostname="localhost")
        assert (await client(_request("a", keep=9), 5)).drafts[0].token_id == 9
        # Signed by the CA but naming someone else: refused, as on the gRPC port.
        stranger = LocalCA.create().write_role(tmp_path / "other", "stranger")  # another CA entirely
        other = tls.files["target"]  # our CA, but not an allowed caller
        refused = _client(server.port, ssl_context=ClientTls(other.ca, other.cert, other.key).ssl_context(),
                          server_hostname="localhost")
        with pytest.raises(LaneDown, match="names target"):
            await refused(_request("a"), 5)
        foreign = _client(server.port, ssl_context=ClientTls(orchestrator.ca, stranger.cert, stranger.key)
                          .ssl_context(), server_hostname="localhost")
        with pytest.raises(LaneDown):
            await foreign(_request("a"), 5)
        plain = _client(server.port)
        with pytest.raises(LaneDown):
            await plain(_request("a"), 2)
        await client.close()
        server.close()

    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(asyncio.wait_for(main(), DEADLINE_S))
    else:
        _run(main())


def test_rounds_go_on_the_lanes_and_greedy_tokens_equal_target_only():
    target = tiny_model(seed=0, init_range=0.3)
    draft = perturbed(target, 0.15, seed=1)
    prompt = [5, 9, 14, 3, 22, 7]
    reference = greedy_reference(target, prompt, 20)
    for lanes in (True, False):
        with running_system(tiny_engine(model=target), tiny_engine(model=draft), lanes=lanes) as system:
            result = system.client.complete(prompt, max_tokens=20, temperature=0, num_draft_tokens=3)
            # All 20, or up to the eos the reference then emits.
            assert result.token_ids == reference[:len(result.token_ids)]
            assert len(result.token_ids) == 20 or reference[len(result.token_ids)] == 2
            rounds = result.stats.rounds
            assert rounds > 1
            drafted, verified = system.draft.lane.answered, system.target.lane.answered
            if lanes:  # every round's calls on the lanes (a last round of k = 0 drafts nothing, and may Decode)
                assert rounds - 1 <= verified <= rounds and rounds - 1 <= drafted <= rounds, (drafted, verified, rounds)
            else:
                assert (drafted, verified) == (0, 0)


def test_lane_dialing_over_tls_checks_the_service_name():
    from orchestrator.security import Dialer
    from specdec.security.tls import ClientTls

    assert Dialer().lane("target:50053", "10.0.0.7:50053") is None
    tls = ClientTls.__new__(ClientTls)  # no files needed: ssl_context is replaced
    object.__setattr__(tls, "ca", "")
    object.__setattr__(tls, "cert", "")
    object.__setattr__(tls, "key", "")
    dialing = Dialer(tls).lane("target.specdec.svc:50053", "10.0.0.7:50053")
    assert isinstance(dialing, LaneDialing) and dialing.server_hostname == "target.specdec.svc"
    assert Dialer(tls).lane("10.0.0.7:50053,10.0.0.8:50053", "10.0.0.8:50053").server_hostname == "10.0.0.8"


def test_cpu_wake_latency_request_is_written_and_held(tmp_path, caplog):
    from specdec import cpu_latency

    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    try:
        assert cpu_latency.hold(0, str(device))
        assert cpu_latency.hold(20, str(device))  # the same descriptor: a new value replaces the request
        assert device.read_bytes() == struct.pack("i", 0) + struct.pack("i", 20)
    finally:
        cpu_latency.release(str(device))
    assert not cpu_latency.hold(-1, str(device)), "negative: nothing asked"
    caplog.set_level("WARNING")
    assert not cpu_latency.hold(0, str(tmp_path / "missing" / "device"))
    assert "cannot hold the CPU wake-up latency" in caplog.text


def test_after_a_break_the_client_asks_the_service_for_its_lane_port_again():
    """A service that restarted on a free port has a new lane port: the
    reconnect asks for it (the ModelInfo) instead of knocking on the old one."""
    async def main():
        first = await _server()
        second = await _server()
        asked = []

        async def find_port(timeout):
            asked.append(timeout)
            return second.port

        client = _client(first.port, find_port=find_port)
        assert (await client(_request("a", keep=1), 5)).drafts[0].token_id == 1
        assert asked == [], "the first connection uses the advertised port"
        first.close()
        client._connection.protocol.transport.abort()
        await asyncio.sleep(0.05)
        assert (await client(_request("a", keep=2), 5)).drafts[0].token_id == 2
        assert len(asked) == 1 and client.port == second.port and second.answered == 1
        await client.close()
        second.close()

    _run(main())


def test_a_caller_cancelled_while_the_lane_opens_leaves_it_usable_and_reopenable():
    async def main():
        server = await _server()
        client = _client(server.port)
        first = asyncio.ensure_future(client(_request("a"), 5))
        await asyncio.sleep(0)  # the opening has started
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.sleep(0.2)  # the opening finished with nobody waiting
        assert (await client(_request("a", keep=6), 5)).drafts[0].token_id == 6
        client._connection.protocol.transport.abort()  # then the connection breaks
        await asyncio.sleep(0.05)
        assert (await client(_request("a", keep=7), 5)).drafts[0].token_id == 7  # a new one, not the dead one
        await client.close()
        server.close()

    _run(main())


def test_a_connection_that_ends_right_after_the_hello_fails_its_calls_at_once():
    """A server that welcomes and then closes (a drain starting just then):
    calls handed that connection fail UNAVAILABLE at once, never waiting out
    their deadline, and never with a transport's RuntimeError."""
    async def welcome_and_close(reader, writer):
        await read_frame(reader, 1024)
        writer.write(lane_mod.frame(b""))
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(welcome_and_close, "127.0.0.1", 0)
        client = _client(server.sockets[0].getsockname()[1])
        loop = asyncio.get_running_loop()
        start = loop.time()
        # A 60 s deadline: however loaded the machine, a call that fails "at once" ends well within half of it.
        outcomes = await asyncio.gather(*(client(_request("a"), 60) for _ in range(3)), return_exceptions=True)
        assert loop.time() - start < 30.0, "a call waited for its deadline"
        for outcome in outcomes:
            assert isinstance(outcome, grpc.aio.AioRpcError), outcome
            assert outcome.code() is grpc.StatusCode.UNAVAILABLE, outcome
        server.close()

    _run(main(), timeout_s=90.0)


def test_an_oversized_call_fails_alone_and_a_closed_client_sends_nothing():
    async def main():
        server = await _server()
        client = _client(server.port, max_message_bytes=256)
        with pytest.raises(grpc.aio.AioRpcError) as big:
            await client(_request("x" * 300), 5)
        assert big.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (await client(_request("a", keep=8), 5)).drafts[0].token_id == 8  # the connection serves on
        await client.close()
        assert not client.usable()
        with pytest.raises(LaneDown, match="closed"):
            await client(_request("a"), 5)
        server.close()
        await server.wait_closed(1)

    _run(main())


def test_a_service_drain_waits_for_its_lane_calls():
    """A drain's grace period covers the calls being answered on the lane:
    the service's drain returns only once they are answered."""
    target_engine = tiny_engine(seed=0)
    with running_target(target_engine) as (target, _, service_loop):
        lane = target.lane
        assert lane is not None and lane.port > 0
        slow_answers = []
        answering = threading.Event()  # set on the service's loop, waited for on the client's

        async def slow(request, trace_context):
            answering.set()
            await asyncio.sleep(0.5)
            slow_answers.append(True)
            from specdec.v1 import target_pb2

            return target_pb2.VerifyResponse()

        lane.handle = slow

        async def main():
            from specdec.v1 import target_pb2

            client = LaneClient("127.0.0.1", lane.port, "/specdec.v1.TargetService/Verify", target_pb2.VerifyCall,
                                target_pb2.VerifyReply, "target")
            call = asyncio.ensure_future(client(target_pb2.VerifyRequest(), 5))
            await _until(answering.is_set)  # the call is being answered on the lane: then the drain starts
            drained = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(target.running.drain(5.0),
                                                                           service_loop.loop))
            await drained
            assert slow_answers == [True], "the drain returned before the lane's call was answered"
            await call
            await client.close()

        client_loop = BackgroundLoop()
        try:
            client_loop.run(main())
        finally:
            client_loop.close()


def test_over_mutual_tls_the_orchestrators_dialing_reaches_a_services_lane(tmp_path):
    """A target serving mutual TLS: the orchestrator's own dialing (its
    Dialer, as build_backends uses it) opens the lane over TLS and Verify
    goes there."""
    from orchestrator.security import Dialer
    from specdec.rpc.session_limits import SessionLimits
    from specdec.security.local_ca import LocalTls
    from specdec.security.tls import ClientTls, TlsConfig
    from specdec.v1 import target_pb2
    from target_service.server import start_target_service
    from target_service.verifier import Verifier
    from tests.harness import local_config

    pki = LocalTls.create(tmp_path)
    own, caller = pki.files["target"], pki.files["orchestrator"]
    limits = SessionLimits()
    engine = tiny_engine(seed=0)
    service_loop = BackgroundLoop()
    service = service_loop.run(start_target_service(
        local_config(), limits, lambda: Verifier(engine, limits.max_draft_tokens, limits.max_verify_batch),
        tls=TlsConfig(tls_cert=own.cert, tls_key=own.key, tls_ca=own.ca)))

    async def main():
        dial = Dialer(ClientTls(caller.ca, caller.cert, caller.key))
        address = f"127.0.0.1:{service.port}"
        client = TargetClient(dial.channel(address, address))
        await client.fetch_info(DEADLINE_S)
        assert client.use_lane("127.0.0.1", dial.lane(address, address))
        sid, _ = await client.open(open_request([5, 9, 14], 0.0, 0, 1.0, 1, 32, "tls-lane"), DEADLINE_S)
        item = target_pb2.VerifyItem(session_id=sid, keep_length=3, draft_token_ids=[7, 8])
        reply, _ = await client.verify([item], DEADLINE_S)
        assert len(reply.results[0].argmax_token_ids) == 3
        assert service.lane.answered == 1 and service.lane.tls is not None
        await client.aclose()

    client_loop = BackgroundLoop()
    try:
        client_loop.run(main())
    finally:
        client_loop.close()
        service_loop.run(service.stop(0))
        service_loop.close()


def test_replies_held_back_by_a_slow_reader_all_go_once_it_reads():
    """Several replies wait in drain() at once (the caller reads nothing for
    a while): every one is sent once it reads, and the connection ends when
    it leaves (each waiter is woken, not only the last)."""
    async def big(request, trace_context):
        await asyncio.sleep(0.01)
        return draft_pb2.ProposeAllResponse(drafts=[draft_pb2.ProposeResponse(token_id=i) for i in range(200_000)])

    async def main():
        server = LaneServer(METHOD, big, draft_pb2.ProposeAllCall, draft_pb2.ProposeAllReply, "fake", 64 << 20)
        await server.start("127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", server.port))
        calls = b"".join(lane_mod.frame(draft_pb2.ProposeAllCall(call_id=i).SerializeToString()) for i in range(1, 5))
        await loop.sock_sendall(sock, lane_mod.frame(METHOD.encode()) + calls)
        await asyncio.sleep(0.5)  # the replies are written; the caller reads nothing: writing is paused
        data = b""
        while True:
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 2.0)
            except asyncio.TimeoutError:
                break
            data += chunk
        replies, at = [], 4  # past the welcome (an empty frame)
        while at < len(data):
            size = struct.unpack(">I", data[at:at + 4])[0]
            replies.append(draft_pb2.ProposeAllReply.FromString(data[at + 4:at + 4 + size]).call_id)
            at += 4 + size
        assert sorted(replies) == [1, 2, 3, 4]
        await asyncio.sleep(0.3)
        assert not [t for t in asyncio.all_tasks() if "_answer" in repr(t.get_coro())]  # none left waiting to drain
        sock.close()
        await asyncio.sleep(0.3)
        assert not server._connections  # its connection's task ended when the caller left
        server.close()

    _run(main())


def test_a_connection_answers_at_most_the_cap_of_calls_at_once(monkeypatch):
    from specdec.rpc import lane_server

    monkeypatch.setattr(lane_server, "MAX_CALLS_IN_FLIGHT", 4)
    running, most = [0], [0]

    async def held(request, trace_context):
        running[0] += 1
        most[0] = max(most[0], running[0])
        await asyncio.sleep(0.02)
        running[0] -= 1
        return draft_pb2.ProposeAllResponse()

    async def main():
        server = LaneServer(METHOD, held, draft_pb2.ProposeAllCall, draft_pb2.ProposeAllReply, "fake", 1 << 20)
        await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        calls = b"".join(lane_mod.frame(draft_pb2.ProposeAllCall(call_id=i).SerializeToString()) for i in range(1, 41))
        writer.write(lane_mod.frame(METHOD.encode()) + calls)  # all 40 in one write, read in one go
        assert await read_frame(reader, 1024) == b""
        answered = {draft_pb2.ProposeAllReply.FromString(await read_frame(reader, 1 << 20)).call_id
                    for _ in range(40)}
        assert answered == set(range(1, 41)) and most[0] == 4
        writer.close()
        server.close()

    _run(main())


def test_closing_the_client_fails_its_calls_at_once_even_when_the_service_reads_nothing():
    async def main():
        async def deaf(reader, writer):  # welcomes, then never reads again
            await read_frame(reader, 1024)
            writer.write(lane_mod.frame(b""))
            await asyncio.sleep(120)

        deaf_server = await asyncio.start_server(deaf, "127.0.0.1", 0)
        client = _client(deaf_server.sockets[0].getsockname()[1], max_message_bytes=64 << 20)
        big = _request("x" * (16 << 20))  # more than the socket buffers hold
        # A 60 s deadline: a close that fails the call at once ends it well within half of it, however loaded.
        in_flight = asyncio.ensure_future(client(big, 60))
        # The call is written, and stuck: what the socket did not take waits in the transport's buffer.
        await _until(lambda: client._connection is not None
                     and client._connection.protocol.transport.get_write_buffer_size() > 0)
        started = asyncio.get_running_loop().time()
        await client.close()
        with pytest.raises(grpc.aio.AioRpcError) as closed:
            await in_flight
        assert closed.value.code() is grpc.StatusCode.CANCELLED
        assert asyncio.get_running_loop().time() - started < 30.0
        deaf_server.close()

    _run(main(), timeout_s=90.0)


def test_opening_the_lane_counts_against_the_calls_timeout():
    """A call that first has to open its lane (up to CONNECT_S) has only what
    is left of its timeout for the call itself: a caller's deadline is never
    overrun by the opening."""
    async def main():
        server = await _server()
        client = _client(server.port)
        opening = client._open

        async def slow_open(timeout):
            await asyncio.sleep(0.3)
            return await opening(timeout)

        client._open = slow_open
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await client(_request("a"), 0.2)
        assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        client._open = opening
        assert (await client(_request("a"), 5)).drafts  # the lane itself is fine
        await client.close()
        server.close()

    _run(main())


def test_a_call_that_never_waits_is_answered_in_the_read_that_brought_it():
    """A lone round's call (its steps or verify on the loop) needs no task and
    no turn of the loop: it is answered inside the connection's
    data_received (specdec/eager.py); a call that waits still gets a task."""
    tasks = []

    async def handler(request, trace_context):
        tasks.append(asyncio.current_task())  # none inside a protocol's callback
        if request.propose.session_id == "waits":
            await asyncio.sleep(0.01)
            tasks.append(asyncio.current_task())
        return draft_pb2.ProposeAllResponse(drafts=[draft_pb2.ProposeResponse(token_id=request.propose.keep_length)])

    async def main():
        server = LaneServer(METHOD, handler, draft_pb2.ProposeAllCall, draft_pb2.ProposeAllReply, "fake", 1 << 20)
        await server.start("127.0.0.1", 0)
        client = _client(server.port)
        try:
            assert (await client(_request("now", keep=3), 5)).drafts[0].token_id == 3
            assert tasks == [None]
            assert (await client(_request("waits", keep=4), 5)).drafts[0].token_id == 4
            assert tasks[1] is None and isinstance(tasks[2], asyncio.Task)
            assert server.answered == 2
        finally:
            await client.close()
            server.close()

    _run(main())


def test_a_caller_waiting_on_the_opening_when_the_client_closes_gets_lane_down_not_cancelled():
    """The opening is cancelled by `close`, the caller is not: its call goes
    another way (LaneDown), as when the lane cannot be opened."""
    async def main():
        silent = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)  # never answers the hello
        client = _client(silent.sockets[0].getsockname()[1])
        call = asyncio.ensure_future(client(_request("s"), 5))
        await asyncio.sleep(0.2)
        await client.close()
        with pytest.raises(LaneDown, match="closed while opening"):
            await call
        assert not call.cancelled()
        silent.close()

    _run(main())


def test_lane_sockets_bound_what_is_sent_to_a_vanished_peer():
    """Keepalive probes only an idle connection; a call in flight to a peer
    whose node vanished is bounded by TCP_USER_TIMEOUT (~1 minute), not by
    ~15 minutes of retransmissions."""
    if not hasattr(socket, "TCP_USER_TIMEOUT"):
        pytest.skip("no TCP_USER_TIMEOUT on this platform")

    async def main():
        server = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
        _, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        lane_mod.keepalive(writer)
        sock = writer.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == lane_mod.USER_TIMEOUT_MS
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        writer.close()
        server.close()

    _run(main())


def test_a_call_or_reply_over_one_sides_limit_fails_alone_and_the_lane_serves_on():
    """Roles with different --max-message-bytes: the call over the service's
    limit, or the reply over the client's, fails RESOURCE_EXHAUSTED, as over
    gRPC; the calls in flight beside it and the connection go on (it was
    ended, failing every call on it UNAVAILABLE)."""
    async def main():
        server = await _server(limit=4096)
        client = _client(server.port, max_message_bytes=1 << 20)
        try:
            big_call = asyncio.ensure_future(client(_request("x" * 20000), 5))
            beside = asyncio.ensure_future(client(_request("slow-50", keep=4), 5))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await big_call
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than the service's --max-message-bytes (4096)" in refused.value.details()
            assert (await beside).drafts[0].token_id == 4
            connection = client._connection
            assert (await client(_request("a", keep=6), 5)).drafts[0].token_id == 6
            assert client._connection is connection  # the same connection
        finally:
            await client.close()
            server.close()

        async def big_replies(request, trace_context):  # a reply as large as keep_length asks
            n = request.propose.keep_length
            return draft_pb2.ProposeAllResponse(drafts=[draft_pb2.ProposeResponse(token_id=7)] * n)

        server = LaneServer(METHOD, big_replies, draft_pb2.ProposeAllCall, draft_pb2.ProposeAllReply, "fake",
                            1 << 20)
        await server.start("127.0.0.1", 0)
        client = _client(server.port, max_message_bytes=4096)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client(_request("s", keep=5000), 5)
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than this client's limit (4096 bytes)" in refused.value.details()
            assert len((await client(_request("s", keep=3), 5)).drafts) == 3
        finally:
            await client.close()
            server.close()

    _run(main())


def test_frames_split_anyhow_arrive_whole_and_oversized_ones_are_read_past():
    """The parser against random splits of a stream of frames, some over the
    limit (each reported once, with its head and size), with holds between
    reads: every frame arrives whole, in order, and nothing ends the connection."""
    import random

    class Transport:
        closed = False

        def close(self):
            self.closed = True

        abort = close

        def is_closing(self):
            return self.closed

        def pause_reading(self):
            pass

        def resume_reading(self):
            pass

    async def main():
        rnd, limit = random.Random(7), 200
        for _ in range(500):
            payloads = [(bytes([0x08, rnd.randrange(1, 127)]) + bytes(rnd.randrange(256) for _ in range(size)))[:size]
                        for size in (rnd.choice([0, 1, 5, 150, 200, 201, 1000, 5000]) for _ in range(rnd.randrange(1, 9)))]
            stream = b"".join(lane_mod.frame(p) for p in payloads)
            connection = lane_mod.FrameConnection(limit)
            connection.connection_made(Transport())
            got = []
            connection.on_oversize = lambda head, size: got.append(("over", head[:2], size))
            connection.start_frames(got.append)
            cuts = sorted(rnd.sample(range(1, len(stream)), min(len(stream) - 1, rnd.randrange(0, 12))))
            for start, end in zip([0] + cuts, cuts + [len(stream)]):
                if rnd.random() < 0.2:
                    connection.hold()
                connection.data_received(stream[start:end])
                if connection.held and rnd.random() < 0.5:
                    connection.release()
            if connection.held:
                connection.release()
            assert not connection.ended.done() and connection._error is None
            assert got == [p if len(p) <= limit else ("over", p[:2], len(p)) for p in payloads]

    _run(main())
