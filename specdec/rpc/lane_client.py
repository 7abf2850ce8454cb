"""A service's lane, the orchestrator's half (the wire and the design: specdec/rpc/lane.py)."""
from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
import time
from typing import Awaitable, Callable

import grpc

from specdec import busy_poll, hops
from specdec.rpc import grpc_errors
from specdec.rpc.grpc_tracing import carry_trace_context
from specdec.rpc.lane import FrameConnection, LaneDown, PendingReplies, call_id_of, keepalive

log = logging.getLogger(__name__)

CONNECT_S = 2.0  # longest wait for a lane to open (connect, TLS, hello): past it the call goes by gRPC
RETRY_S = 10.0  # after a lane could not be opened, calls go by gRPC this long before it is tried again


class LaneClient:
    """The orchestrator's half: `await lane(request, timeout)` answers as
    the unary call would (the reply, or an AioRpcError with its status), or
    raises LaneDown when the lane cannot be opened (nothing was sent).
    One connection, opened at the first call and again after it breaks."""

    def __init__(self, host: str, port: int, method: str, call_type, reply_type, service: str,
                 max_message_bytes: int = 16 << 20,
                 ssl_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None = None,
                 server_hostname: str = "", clock: Callable[[], float] = time.monotonic,
                 find_port: Callable[[float], Awaitable[int]] | None = None):
        self.host, self.port, self.method = host, port, method
        self.call_type = call_type
        self.reply_type = reply_type
        self.service = service
        self.max_message_bytes = max_message_bytes
        # TLS: a context, or a function making one per connection (a renewed
        # client certificate is then presented from the next connection on).
        self.ssl_context = ssl_context
        self.server_hostname = server_hostname or host
        self.clock = clock
        # Asks the service for its lane's port again (its ModelInfo) before a
        # reconnect: a service that restarted on a free port has a new one.
        self.find_port = find_port
        self._stale = False
        self._ids = itertools.count(1)
        self._connection: _Connection | None = None
        self._opening: asyncio.Future | None = None
        self._down_until = 0.0
        self._closed = False
        self._reply_wait = busy_poll.Expected()  # how long replies take (--busy-poll-us)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def usable(self) -> bool:
        """Whether a call should try the lane (not closed, nor within RETRY_S of failing to open it)."""
        return not self._closed and (self._connection is not None or self.clock() >= self._down_until)

    async def __call__(self, request, timeout: float):
        if self._closed:
            raise LaneDown(f"the {self.service} service's lane client is closed")
        if self._connection is not None:
            connection = self._connection
        else:  # opening it (up to CONNECT_S) counts against the call's timeout
            opened = time.monotonic()
            connection = await self._open(timeout)
            timeout -= time.monotonic() - opened
            if timeout <= 0:
                raise grpc_errors.deadline_exceeded()
        call_id = next(self._ids)
        message = carry_trace_context(self.call_type(call_id=call_id, request=request))
        payload = message.SerializeToString()
        if len(payload) > self.max_message_bytes:  # this call fails, not the connection it would break
            raise grpc_errors.rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"the call ({len(payload)} bytes) is larger than the limit "
                                        f"({self.max_message_bytes} bytes)")
        if connection.error is not None or connection.protocol.is_closing():
            raise connection.error or _broken(self)
        reply_future = connection.waiting.expect(call_id)
        # The deadline is a timer that fails the reply's future: cheaper, on
        # every round, than an asyncio.timeout around the await.
        deadline = asyncio.get_running_loop().call_later(timeout, _expire, reply_future)
        try:
            try:
                hops.record("call.sent", self.service)
                connection.protocol.write(payload)
            except (RuntimeError, OSError):  # the transport closed under us: its end fails the rest
                raise _broken(self) from None
            with busy_poll.waiting(self._reply_wait):
                reply = await reply_future
            hops.record("call.back", self.service)
        finally:
            deadline.cancel()
            connection.waiting.forget(call_id)
        if reply.HasField("error"):
            raise grpc_errors.rpc_error(grpc_errors.status_from_number(reply.error.code), reply.error.message)
        return reply.response

    async def _open(self, timeout: float) -> "_Connection":
        """The connection, opened by the first caller (the others wait for it;
        a caller cancelled meanwhile does not stop the opening)."""
        if self._opening is None or self._opening.done():
            # Its own CONNECT_S, not this caller's timeout: a caller whose
            # deadline is nearly spent must not mark the lane down for RETRY_S
            # (nor fail the others waiting on the opening with it).
            self._opening = asyncio.ensure_future(self._connect(CONNECT_S))
            # Read by whoever awaits it; retrieved here too, for when every caller was cancelled.
            self._opening.add_done_callback(lambda f: f.cancelled() or f.exception())
        opening = self._opening
        await asyncio.wait([opening], timeout=max(timeout, 0.0))  # never cancels the opening
        if not opening.done():  # this caller's deadline came first; the opening goes on for the next call
            raise grpc_errors.deadline_exceeded()
        if opening.cancelled():
            # The opening itself was cancelled (the client closed meanwhile), not
            # this caller: the call goes another way, as when the lane is down.
            raise LaneDown(f"the {self.service} service's lane client closed while opening the lane")
        return opening.result()

    async def _connect(self, timeout: float) -> "_Connection":
        try:
            protocol = await self._handshake(timeout)
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError, LaneDown,
                grpc.aio.AioRpcError) as exc:
            self._down_until = self.clock() + RETRY_S
            self._stale = True
            down = exc if isinstance(exc, LaneDown) else LaneDown(
                f"the {self.service} service's lane at {self.address} could not be opened: {type(exc).__name__}: {exc}")
            if not self._closed:  # once per attempt, however many callers waited on it
                log.warning("%s; calls go by gRPC, the lane is tried again in %.0f s", down, RETRY_S)
            raise down from None
        if self._closed:  # closed while opening: do not keep what was opened
            protocol.transport.close()
            raise LaneDown(f"the {self.service} service's lane client is closed")
        self._stale = False
        keepalive(protocol.transport)
        protocol.limit = self.max_message_bytes
        protocol.hop_where = f"from-{self.service}"
        connection = _Connection(protocol)
        # Each reply is handed to its caller as it arrives, from the connection's data_received.
        protocol.on_oversize = lambda head, size: connection.waiting.resolve(self._too_large(head, size))
        protocol.start_frames(lambda payload: connection.waiting.resolve(self.reply_type.FromString(payload)))
        protocol.ended.add_done_callback(lambda ended: self._ended(connection, ended.result()))
        self._connection = connection
        return connection

    def _too_large(self, head: bytes, size: int):
        """The reply to a call whose own reply is over this client's limit
        (the service's is larger): that call fails alone."""
        return grpc_errors.too_large_reply(self.reply_type, call_id_of(head),
                                           f"the {self.service} service's reply ({size} bytes) is larger than "
                                           f"this client's limit ({self.max_message_bytes} bytes)")

    async def _handshake(self, timeout: float) -> FrameConnection:
        """A connection the service welcomed; whatever fails or cancels this
        leaves nothing open."""
        if self._closed:
            raise LaneDown(f"the {self.service} service's lane client is closed")
        protocol: FrameConnection | None = None
        try:
            async with asyncio.timeout(timeout):
                if self._stale and self.find_port is not None:
                    self.port = await self.find_port(timeout)
                    if self.port <= 0:
                        raise LaneDown(f"the {self.service} service no longer offers a lane")
                context = self.ssl_context() if callable(self.ssl_context) else self.ssl_context
                _, protocol = await asyncio.get_running_loop().create_connection(
                    lambda: FrameConnection(1 << 16), self.host, self.port, ssl=context,
                    server_hostname=self.server_hostname if context else None)
                protocol.write(self.method.encode())
                refusal = (await protocol.next_frame()).decode(errors="replace")
            if refusal:
                raise LaneDown(f"the {self.service} service's lane at {self.address} refused: {refusal}")
            return protocol
        except BaseException:
            if protocol is not None:
                protocol.transport.close()
            raise

    def _ended(self, connection: "_Connection", cause: BaseException | None) -> None:
        """The connection is gone: every call still waiting on it fails (once)."""
        if connection.error is not None:
            return
        if connection.closed_by_us:
            error = grpc_errors.rpc_error(grpc.StatusCode.CANCELLED, f"the {self.service} service's lane was closed")
        else:
            why = type(cause).__name__ if cause is not None else "the service closed it"
            error = grpc_errors.rpc_error(grpc.StatusCode.UNAVAILABLE, f"the {self.service} service's lane at "
                                          f"{self.address} broke: {why}")
        connection.error = error  # a caller that got this connection before now fails at once
        if self._connection is connection:
            self._connection = None
            self._stale = True
        connection.waiting.fail_all(error)

    async def close(self) -> None:
        """End the connection (calls in flight fail CANCELLED) and any opening; later calls raise LaneDown."""
        self._closed = True
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
            await asyncio.gather(self._opening, return_exceptions=True)
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.closed_by_us = True
            self._ended(connection, None)  # the calls in flight fail now, not once the peer has read what we wrote
            connection.protocol.transport.abort()
            await asyncio.wait([connection.protocol.ended], timeout=5.0)


class _Connection:
    def __init__(self, protocol: FrameConnection):
        self.protocol = protocol
        self.waiting = PendingReplies()
        self.closed_by_us = False
        self.error: grpc.aio.AioRpcError | None = None  # set once the connection has ended


def _expire(reply: asyncio.Future) -> None:
    if not reply.done():
        reply.set_exception(grpc_errors.deadline_exceeded())


def _broken(client: LaneClient) -> grpc.aio.AioRpcError:
    return grpc_errors.rpc_error(grpc.StatusCode.UNAVAILABLE,
                                 f"the {client.service} service's lane at {client.address} is closed")
