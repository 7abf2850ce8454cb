"""Async clients of the draft and target services, as the orchestrator uses
them: every call has a deadline, and bytes on the wire are counted."""
from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from specdec.errors import DeadlineExceeded, Unavailable
from specdec.rpc.call_stream import CallStream
from specdec.rpc import lane_methods
from specdec.rpc.lane_client import LaneClient
from specdec.rpc.lane_methods import LaneMethod
from specdec.rpc.grpc_tracing import trace_metadata
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


@dataclass
class CallCost:
    """What one downstream call cost the request."""

    seconds: float = 0.0
    wire_bytes: int = 0


@dataclass(frozen=True)
class LaneDialing:
    """How a lane is dialed over TLS: the context (CA, client certificate)
    and the name the service's certificate must carry."""

    context: ssl.SSLContext | Callable[[], ssl.SSLContext]  # or a function making one per connection
    server_hostname: str


def open_request(prompt: list[int], temperature: float, top_k: int, top_p: float, seed: int,
                 max_new_tokens: int, request_id: str) -> common_pb2.OpenSessionRequest:
    return common_pb2.OpenSessionRequest(
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
        seed=seed, max_new_tokens=max_new_tokens, request_id=request_id,
    )


class ModelClient:
    """The session RPCs both services share."""

    def __init__(self, channel: grpc.aio.Channel, stub, name: str):
        self.channel = channel
        self.stub = stub
        self.name = name
        self.info: common_pb2.ModelInfo | None = None
        self.call_streams: list[CallStream] = []  # the RPCs this client sends on call streams

    async def aclose(self) -> None:
        """End the call streams, then close the channel."""
        for calls in self.call_streams:
            await calls.close()
        await self.channel.close()

    async def fetch_info(self, timeout: float) -> common_pb2.ModelInfo:
        reply = await self.stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=timeout)
        self.info = reply.info
        return self.info

    def use_lane(self, host: str, tls: LaneDialing | None = None) -> bool:
        """Send the round's call on the service's lane at `host` (the
        replica's address) when its ModelInfo advertises one; whether it does."""
        if self.info is None or self.info.lane_port <= 0:
            return False
        calls, method = self.lane_call()
        calls.lane = LaneClient(host, self.info.lane_port, method.path, method.call_type, method.reply_type, self.name,
                                ssl_context=tls.context if tls else None,
                                server_hostname=tls.server_hostname if tls else "", find_port=self._lane_port)
        return True

    async def _lane_port(self, timeout: float) -> int:
        """The lane's port as the service now reports it (it may have restarted on another)."""
        return (await self.fetch_info(timeout)).lane_port

    def lane_call(self) -> tuple[CallStream, LaneMethod]:
        """The call stream whose calls may go on the lane, and the lane's method."""
        raise NotImplementedError

    async def open(self, request: common_pb2.OpenSessionRequest, timeout: float) -> tuple[str, CallCost]:
        start = time.perf_counter()
        reply = await self.stub.OpenSession(request, timeout=timeout, metadata=trace_metadata())
        return reply.session_id, CallCost(time.perf_counter() - start, request.ByteSize() + reply.ByteSize())

    async def close(self, session_id: str, timeout: float) -> None:
        """Best effort: a failure to close is logged by the caller, never raised
        into a request that is already ending."""
        await self.stub.CloseSession(common_pb2.CloseSessionRequest(session_id=session_id), timeout=timeout,
                                     metadata=trace_metadata())


class DraftClient(ModelClient):
    """`call_streams`: ProposeAll calls go as messages on one long-lived
    stream (specdec/rpc/call_stream.py), not as unary calls."""

    def __init__(self, channel: grpc.aio.Channel, call_streams: bool = True):
        super().__init__(channel, draft_pb2_grpc.DraftServiceStub(channel), "draft")
        self.propose_all = CallStream(self.stub.ProposeAllStream, self.stub.ProposeAll, draft_pb2.ProposeAllCall,
                                      "draft", enabled=call_streams)
        self.call_streams.append(self.propose_all)

    def lane_call(self):
        return self.propose_all, lane_methods.DRAFT

    async def propose(self, session_id: str, keep_length: int, append: list[int], k: int, timeout: float,
                      first: asyncio.Future | None = None, min_confidence: float = 0.0,
                      packed_q: bool = False, call_number: int = 0,
                      first_is_guess: bool = False) -> tuple[list[draft_pb2.ProposeResponse], CallCost]:
        """Up to k drafts (fewer when one's confidence is below
        `min_confidence`); `first`, if given, gets the first token id as soon
        as it arrives (or None if the stream ends without one) from a Propose
        stream; without it one ProposeAll answers with all of them.
        `packed_q`: their q's in the packed encoding (specdec/sampling/q_wire.py).
        `call_number`: the caller's count of its Propose calls on the session
        (0: unnumbered; see ProposeRequest.call_number). `first_is_guess`:
        the first draft is a guess at an undecided token, left out of
        min_confidence's product (ProposeRequest.first_is_guess)."""
        request = draft_pb2.ProposeRequest(session_id=session_id, keep_length=keep_length,
                                           append_token_ids=append, num_draft_tokens=k,
                                           min_confidence=min_confidence, packed_q=packed_q,
                                           call_number=call_number, first_is_guess=first_is_guess)
        start = time.perf_counter()
        if first is None:  # nothing wants a token early: one message, not a stream of k
            reply = await self.propose_all(draft_pb2.ProposeAllRequest(propose=request), timeout)
            return list(reply.drafts), CallCost(time.perf_counter() - start, request.ByteSize() + reply.ByteSize())
        drafts = []
        try:
            async for d in self.stub.Propose(request, timeout=timeout, metadata=trace_metadata()):
                drafts.append(d)
                if first is not None and not first.done():
                    first.set_result(d.token_id)
        finally:
            if first is not None and not first.done():
                first.set_result(None)
        size = request.ByteSize() + sum(d.ByteSize() for d in drafts)
        return drafts, CallCost(time.perf_counter() - start, size)


class TargetClient(ModelClient):
    """`call_streams`: Verify calls go as messages on one long-lived stream
    (specdec/rpc/call_stream.py), not as unary calls."""

    def __init__(self, channel: grpc.aio.Channel, call_streams: bool = True):
        super().__init__(channel, target_pb2_grpc.TargetServiceStub(channel), "target")
        self.verify_calls = CallStream(self.stub.VerifyStream, self.stub.Verify, target_pb2.VerifyCall, "target",
                                       enabled=call_streams)
        self.call_streams.append(self.verify_calls)

    def lane_call(self):
        return self.verify_calls, lane_methods.TARGET

    async def verify(self, items: list[target_pb2.VerifyItem],
                     timeout: float) -> tuple[target_pb2.VerifyResponse, int]:
        """The reply and the request's size in bytes (for the wire statistics)."""
        request = target_pb2.VerifyRequest(items=items)
        reply = await self.verify_calls(request, timeout)
        return reply, request.ByteSize()


def channel_to(address: str, max_message_bytes: int = 16 << 20, interceptors=(),
               credentials: grpc.ChannelCredentials | None = None, server_name: str = "") -> grpc.aio.Channel:
    """A channel to one replica; over TLS with `credentials`, checking the
    server's certificate against `server_name` (the Service's DNS name) when
    the address is a replica's IP."""
    options = [("grpc.ssl_target_name_override", server_name)] if credentials and server_name else []
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, interceptors=list(interceptors) or None,
                                       options=options + _channel_options(max_message_bytes))
    return grpc.aio.insecure_channel(address, interceptors=list(interceptors) or None,
                                     options=_channel_options(max_message_bytes))


def _channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.enable_retries", 1),
        ("grpc.keepalive_time_ms", 30000),
        # A service that comes back is found within seconds, not after
        # gRPC's default backoff of up to two minutes.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


def unavailable(service: str, exc: grpc.aio.AioRpcError) -> Unavailable:
    return Unavailable(f"the {service} service failed: {exc.code().name}: {exc.details()}")


async def open_to_its_end(client, request, rpc_timeout_s: float, wait_s: float,
                          on_orphan: Callable[[object, str], None]) -> tuple[str, "CallCost"]:
    """`client.open(request)`, whose session is never lost: the call runs
    under `rpc_timeout_s` and to its end, while the caller waits for it at
    most `wait_s` (then DeadlineExceeded) or until it is cancelled. A call
    bound by the request's own deadline could end DEADLINE_EXCEEDED while
    the service, which answered in time, kept the session; and a cancel
    landing as the reply arrives would drop its id. A session opened for a
    caller already gone goes to `on_orphan(client, session_id)` (to close)."""
    opening = asyncio.ensure_future(client.open(request, rpc_timeout_s))

    def orphan(done: asyncio.Future) -> None:
        if not done.cancelled() and done.exception() is None:
            on_orphan(client, done.result()[0])

    try:
        return await asyncio.wait_for(asyncio.shield(opening), wait_s)
    except asyncio.TimeoutError:
        opening.add_done_callback(orphan)
        raise DeadlineExceeded(f"the request's deadline passed while opening the {client.name} session") from None
    except asyncio.CancelledError:
        opening.add_done_callback(orphan)
        raise
