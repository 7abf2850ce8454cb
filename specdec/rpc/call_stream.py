"""Unary calls carried as messages on one long-lived bidirectional stream.

A grpc.aio unary call sets up a new HTTP/2 stream every time: headers both
ways, a call object on each side, the completion through grpc's poller
thread. On loopback that is most of what a call costs: `specd overhead`
measures a bare unary call at about twice one message each way on a stream
that is already open. A speculative round makes two calls (the draft's
ProposeAll, the target's Verify), so the orchestrator sends each of them as a
message on a stream it keeps open to each service (`ProposeAllStream`,
`VerifyStream` in the protos), and the round pays for two messages each way,
not two calls.

Each message is still one call, with unary semantics:

- a call carries its `call_id` and its trace context, and is answered by one
  reply with the same `call_id`, in the order the calls finish (the server
  runs calls of one stream concurrently, as it runs concurrent unary calls);
- a call that fails gets its status in the reply's `error` (the code and
  message the unary call would have had); the stream goes on;
- the caller keeps the deadline: past it the call raises DEADLINE_EXCEEDED
  and its reply, when it comes, is dropped;
- when the stream breaks (the service died or is draining), every call in
  flight on it fails with the stream's status, UNAVAILABLE when it ended
  cleanly, and the next call opens a new stream;
- against a service without the stream method (UNIMPLEMENTED), the client
  falls back to unary calls for good.

`serve` is the server's half, `CallStream` the client's.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import AsyncIterator, Awaitable, Callable, Iterable

import grpc
from opentelemetry import context as context_api
from opentelemetry import trace

from specdec import busy_poll
from specdec.errors import InvalidArgument
from specdec.rpc import grpc_errors
from specdec.rpc.grpc_tracing import carry_trace_context, trace_metadata
from specdec.rpc.lane import LaneDown, PendingReplies
from specdec.rpc.lane_client import LaneClient
from specdec.rpc.lane_server import MAX_CALLS_IN_FLIGHT
from specdec.rpc.malformed import Malformed
from specdec.telemetry import A_CARRIER

log = logging.getLogger(__name__)

Handler = Callable[[object, Iterable[tuple[str, str]]], Awaitable[object]]


class ServedStreams:
    """The call streams a server is serving, so that a drain can end them:
    a stream never ends by itself, and the server's grace period would wait
    for it in vain."""

    def __init__(self, max_message_bytes: int = 16 << 20):
        self._readers: set[asyncio.Task] = set()
        self.closed = False
        self.max_message_bytes = max_message_bytes  # the server's --max-message-bytes: a larger reply fails its call
        self._call_gap = busy_poll.Expected()  # from a reply to the next call (--busy-poll-us)

    def close(self) -> None:
        """Stop reading new calls on every stream; each ends once the calls
        it has read are answered."""
        self.closed = True
        for reader in list(self._readers):
            reader.cancel()

    async def serve(self, calls: AsyncIterator, context, handle: Handler, reply_type, method: str) -> None:
        """Answer the calls read from `calls` on `context` until the caller
        ends the stream (or a drain does): each call's request is answered
        by `handle(request, trace_context_items)`, whose exceptions become
        the reply's `error` (logged when they are our bug). A message that is
        not a call ends the stream with INVALID_ARGUMENT."""
        if self.closed:
            return
        # Tell the client the stream is taken before it writes: a write racing
        # a refusal would turn the refusal's status into INTERNAL on its side.
        await context.send_initial_metadata(())
        writing = asyncio.Lock()  # one write at a time on a stream
        answering: set[asyncio.Task] = set()

        async def answer(call) -> None:
            reply = await grpc_errors.answer_call(call, handle, reply_type, method)
            size = reply.ByteSize()
            if size > self.max_message_bytes:  # this call fails, not the stream its write would end
                reply = grpc_errors.too_large_reply(reply_type, call.call_id,
                                                    grpc_errors.reply_over_limit(size, self.max_message_bytes))
            async with writing:
                try:
                    await context.write(reply)
                except Exception as exc:  # noqa: BLE001 - grpc's ExecuteBatchError: the stream has ended
                    log.debug("%s: a reply was not written, the stream has ended: %r", method, exc)
                    return
            busy_poll.linger(self._call_gap)  # the caller's next call usually follows within a round (--busy-poll-us)

        room = asyncio.Event()  # set while fewer than MAX_CALLS_IN_FLIGHT calls are being answered
        room.set()

        def answered(task: asyncio.Task) -> None:
            answering.discard(task)
            if len(answering) < MAX_CALLS_IN_FLIGHT:
                room.set()

        async def read() -> None:
            async for call in calls:
                if isinstance(call, Malformed):
                    raise InvalidArgument(call.message)
                busy_poll.arrived(self._call_gap)
                task = asyncio.ensure_future(answer(call))
                answering.add(task)
                task.add_done_callback(answered)
                if len(answering) >= MAX_CALLS_IN_FLIGHT:
                    # A caller that sends calls and never reads their replies
                    # would otherwise have every one computed and its reply
                    # held: reading waits, and HTTP/2 flow control pushes back.
                    room.clear()
                    await room.wait()

        reader = asyncio.ensure_future(read())
        self._readers.add(reader)
        try:
            try:
                await reader
            except asyncio.CancelledError:
                if not reader.cancelled():  # this handler was cancelled, not the reader by a drain
                    raise
            # Answer what was read, then end the stream.
            while answering:
                await asyncio.gather(*answering, return_exceptions=True)
        finally:
            self._readers.discard(reader)
            reader.cancel()
            for task in list(answering):
                task.cancel()


def _carried(carrier: str) -> None:
    """Name the way the call goes on the caller's span (a no-op untraced)."""
    if context_api.get_current():  # else no span is current (tracing off)
        trace.get_current_span().set_attribute(A_CARRIER, carrier)


class _OpenStream:
    """One open stream and the calls waiting for their replies on it."""

    def __init__(self, call: grpc.aio.StreamStreamCall, outbox: asyncio.Queue):
        self.call = call
        self.outbox = outbox
        self.waiting = PendingReplies()
        self.reader: asyncio.Task | None = None
        self.writer: asyncio.Task | None = None
        # A write is under way: grpc.aio reports a write that failed because
        # the transport went away (the service died) as INTERNAL.
        self.writing = False


class CallStream:
    """The client's half: `await calls(request, timeout)` behaves as the
    unary call `unary(request, timeout=...)` would (the same reply, or an
    AioRpcError with the same status), carried on one long-lived stream of
    `stream_method`. Disabled (`enabled=False`) or against a service that
    does not know the stream method, it makes the unary call."""

    def __init__(self, stream_method, unary_method, call_type, service: str, enabled: bool = True):
        self._stream_method = stream_method
        self._unary = unary_method
        self._call_type = call_type
        self._service = service
        self.enabled = enabled
        # The service's lane (specdec/rpc/lane.py), tried first when set.
        self.lane: LaneClient | None = None
        self._stream: _OpenStream | None = None
        self._ids = itertools.count(1)
        self._reply_wait = busy_poll.Expected()  # how long replies take (--busy-poll-us)

    async def __call__(self, request, timeout: float):
        lane = self.lane
        if lane is not None and lane.usable():
            start = time.monotonic()
            try:
                _carried("lane")
                return await lane(request, timeout)
            except LaneDown:  # nothing was sent (the lane logged why): the call goes by gRPC, in what is left
                timeout -= time.monotonic() - start
                if timeout <= 0:
                    raise grpc_errors.deadline_exceeded() from None
        _carried("stream" if self.enabled else "unary")
        if not self.enabled:
            return await self._unary(request, timeout=timeout, metadata=trace_metadata())
        stream = self._stream if self._stream is not None else self._open()
        call_id = next(self._ids)
        message = carry_trace_context(self._call_type(call_id=call_id, request=request))
        reply_future = stream.waiting.expect(call_id)
        stream.outbox.put_nowait(message)
        try:
            async with asyncio.timeout(timeout) as scope:
                with busy_poll.waiting(self._reply_wait):
                    reply = await reply_future
        except TimeoutError:
            raise grpc_errors.deadline_exceeded() from None
        except grpc.aio.AioRpcError as exc:
            # This call went on a stream the service does not have; so may
            # others at once, which all fall back, however many came first.
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                if self.enabled:
                    log.info("the %s service has no call streams: unary calls from now on", self._service)
                    self.enabled = False
                _carried("unary")
                left = scope.when() - asyncio.get_running_loop().time()  # the refusal's time counts against the call's
                if left <= 0:
                    raise grpc_errors.deadline_exceeded() from None
                return await self._unary(request, timeout=left, metadata=trace_metadata())
            raise
        finally:
            stream.waiting.forget(call_id)
        if reply.HasField("error"):
            raise grpc_errors.rpc_error(grpc_errors.status_from_number(reply.error.code), reply.error.message)
        return reply.response

    def _open(self) -> _OpenStream:
        stream = _OpenStream(self._stream_method(), asyncio.Queue())
        # Writes go through one writer task: a write the caller's cancellation
        # interrupted would cancel the whole stream (grpc.aio does that).
        stream.writer = asyncio.ensure_future(_write(stream))
        stream.reader = asyncio.ensure_future(self._read(stream))
        self._stream = stream
        return stream

    async def _read(self, stream: _OpenStream) -> None:
        error: grpc.aio.AioRpcError
        try:
            async for reply in stream.call:
                stream.waiting.resolve(reply)
            error = grpc_errors.rpc_error(grpc.StatusCode.UNAVAILABLE,
                                          f"the {self._service} service ended the call stream")
        except grpc.aio.AioRpcError as exc:
            error = exc
            if exc.code() is grpc.StatusCode.INTERNAL and stream.writing:
                error = grpc_errors.rpc_error(grpc.StatusCode.UNAVAILABLE,
                                              f"the {self._service} service's call stream broke while a call "
                                              f"was sent: {exc.details()}")
        except asyncio.CancelledError:
            error = _closed()
        if self._stream is stream:
            self._stream = None
        await _end(stream, error)

    async def close(self) -> None:
        """End the open stream and the lane (their calls in flight fail with CANCELLED)."""
        if self.lane is not None:
            await self.lane.close()
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.reader.cancel()
            await asyncio.gather(stream.reader, return_exceptions=True)
            # A reader cancelled before its first step ran none of its ending:
            # its calls would wait out their deadlines, and the stream stay open.
            await _end(stream, _closed())


def _closed() -> grpc.aio.AioRpcError:
    return grpc_errors.rpc_error(grpc.StatusCode.CANCELLED, "the call stream was closed")


async def _end(stream: _OpenStream, error: grpc.aio.AioRpcError) -> None:
    """A stream's ending, whoever ends it (its reader, or `close` when the
    reader was cancelled before it ran): its calls fail with `error`, its
    writer and its gRPC call are cancelled. Harmless twice."""
    stream.waiting.fail_all(error)
    stream.writer.cancel()
    stream.call.cancel()
    await asyncio.gather(stream.writer, return_exceptions=True)


async def _write(stream: _OpenStream) -> None:
    try:
        # Nothing is written before the service has taken the stream: a service
        # without the method refuses it (UNIMPLEMENTED), and a write racing
        # that refusal would make grpc.aio report INTERNAL instead.
        await stream.call.initial_metadata()
        if stream.call.done():
            return
        while True:
            message = await stream.outbox.get()
            stream.writing = True
            await stream.call.write(message)
            stream.writing = False
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass  # the stream broke: the reader fails the calls waiting on it
