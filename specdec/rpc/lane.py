"""A service's lane: a round's hot call over a plain TCP connection.

Each round makes one call to each service (the draft's ProposeAll, the
target's Verify). Over gRPC, even as messages on an open call stream
(specdec/rpc/call_stream.py), each costs grpc's own machinery on both sides:
its poller thread wakes, hands the message to the event loop, and the
HTTP/2 framing runs in between. On the 2-core dev VM two bare grpc.aio
stream messages each way, each after the idle wait a round has, cost
0.91 ms; the same two exchanges as length-prefixed frames on a TCP
connection between two uvloop event loops cost 0.25 ms (measured side by
side, docs/benchmarks.md). The round's overhead goal (<= 1 ms) cannot be met
over grpc here; over a lane it can.

So a model service also listens on a lane port (`--lane-port`, advertised in
its ModelInfo), and the orchestrator sends each round's call there when the
service offers one. A lane carries exactly what a call stream carries, the
same messages with the same semantics: a call (`ProposeAllCall`,
`VerifyCall`: its id, request and trace context) is answered by one reply
with the same id, whose `error` holds the status the unary call would have
had; the caller keeps the deadline; calls of one connection run
concurrently. Everything else (sessions, health, the other calls) stays on
gRPC.

The wire: the client opens with one frame naming the method it will call
(e.g. "/specdec.v1.TargetService/Verify"); the server answers with an empty
frame, or a frame with the reason it refuses (then closes). Then calls and
replies, each one frame: a 4-byte big-endian length and the serialized
message. A frame over the message limit, or one that does not parse, ends
the connection (every call in flight on it fails UNAVAILABLE).

Under mutual TLS the lane speaks TLS too: the server's certificate files are
re-read when they change (each connection's handshake uses the newest), and
the caller's certificate must name an allowed caller, as on the gRPC port.

`LaneServer` is the service's half; `LaneClient` the orchestrator's, which
`CallStream` uses in front of its stream: when the lane cannot be reached,
the call goes on the call stream, and the lane is tried again later.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import ssl
import time
from typing import Awaitable, Callable

import grpc

from specdec.rpc import grpc_errors
from specdec.rpc.auth import caller_refusal
from specdec.rpc.grpc_tracing import trace_metadata

log = logging.getLogger(__name__)

HEADER = 4  # bytes of a frame's length
CONNECT_S = 2.0  # longest wait for a lane to open (connect, TLS, hello): past it the call goes by gRPC
HELLO_S = 10.0  # the server's limit for a new connection's TLS handshake and hello
MAX_CALLS_IN_FLIGHT = 1024  # calls one connection may have the server answering at once; reading waits past it
KEEPALIVE = (30, 10, 3)  # TCP keepalive: idle s, interval s, probes (a peer gone without a word is found in ~60 s)
RETRY_S = 10.0  # after a lane could not be opened, calls go by gRPC this long before it is tried again


class LaneDown(Exception):
    """The lane could not be opened: nothing was sent, the call may go another way."""


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(HEADER, "big") + payload


async def read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    """The next frame's payload; IncompleteReadError at the end of the
    connection, ValueError for a frame over `limit` bytes."""
    size = int.from_bytes(await reader.readexactly(HEADER), "big")
    if size > limit:
        raise ValueError(f"a frame of {size} bytes is over the limit of {limit}")
    return await reader.readexactly(size)


# ------------------------------------------------------------------ server


class LaneTls:
    """The server side of a lane under mutual TLS: an SSL context from the
    service's certificate files (rebuilt when they change) and the names a
    caller's certificate must carry one of."""

    def __init__(self, cert: str, key: str, ca: str, allowed: frozenset[str]):
        from specdec.security.tls import ReloadingCertificates

        self.files = ReloadingCertificates(cert, key, ca)
        self.allowed = allowed
        self._context = self._load()

    def _load(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.files.cert, self.files.key)
        context.load_verify_locations(self.files.ca)
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def context(self) -> ssl.SSLContext:
        """The context for the next handshake: the newest certificate."""
        fresh = self.files.reload_if_changed(self._load)
        if fresh is not None:
            self._context = fresh
        return self._context

    def refusal(self, peer_certificate: dict | None) -> str:
        """Why the caller is refused ('' when it is allowed)."""
        return caller_refusal(certificate_names(peer_certificate or {}), self.allowed)


def certificate_names(certificate: dict) -> list[str]:
    """A certificate's common name and subject alternative names (every
    kind, as grpc's `x509_subject_alternative_name`), as
    `ssl.SSLSocket.getpeercert()` describes them."""
    names = [value for rdn in certificate.get("subject", ()) for key, value in rdn if key == "commonName"]
    names += [value for _kind, value in certificate.get("subjectAltName", ())]  # DNS, URI, IP, email: as grpc reads them
    return list(dict.fromkeys(names))


class LaneServer:
    """Answers one method's calls on a lane port: each call's request by
    `handle(request, trace_context_items)`, as a call stream does."""

    def __init__(self, method: str, handle, call_type, reply_type, handler_name: str,
                 max_message_bytes: int, tls: LaneTls | None = None):
        self.method = method
        self.handle = handle
        self.call_type = call_type
        self.reply_type = reply_type
        self.handler_name = handler_name
        self.max_message_bytes = max_message_bytes
        self.tls = tls
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self.closed = False
        self.answered = 0  # calls answered, since start

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve, host, port, limit=1 << 16)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("lane for %s on %s:%d%s", self.method, host, self.port, " (TLS)" if self.tls else "")
        return self.port

    def close(self) -> None:
        """Stop accepting and stop reading calls; each connection ends once
        the calls it has read are answered (`wait_closed`)."""
        if self.closed:
            return
        self.closed = True
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.cancel()

    async def wait_closed(self, grace_s: float) -> None:
        """After `close`: wait up to `grace_s` for the calls read to be answered."""
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=max(grace_s, 0.0))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        answering: set[asyncio.Future] = set()
        _keepalive(writer)
        try:
            if await self._opened(reader, writer):
                await self._read_calls(reader, writer, answering)
        except asyncio.CancelledError:
            pass  # a drain: answer what was read, then end
        except (asyncio.IncompleteReadError, OSError, TimeoutError):
            pass  # the caller went away (or failed the TLS handshake, or sent no hello in time)
        except ValueError as exc:  # an oversized or unparsable frame: not our client
            log.warning("lane %s: ending a connection from %s: %s", self.method, _peer(writer), exc)
        finally:
            while answering:
                await asyncio.gather(*answering, return_exceptions=True)
            writer.close()
            self._connections.discard(task)  # last: a drain waits for this connection until here

    async def _opened(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """The handshake: TLS (when on), then the method; a refusal is sent as the hello's text."""
        async with asyncio.timeout(HELLO_S):
            refusal = ""
            if self.tls is not None:
                await writer.start_tls(self.tls.context())
                refusal = self.tls.refusal(writer.get_extra_info("peercert"))
            method = (await read_frame(reader, 1024)).decode(errors="replace")
            if not refusal and method != self.method:
                refusal = f"this lane answers {self.method}, not {method}"
            if self.closed:
                refusal = "the service is draining"
            writer.write(frame(refusal.encode()))
            if refusal:
                log.warning("lane %s: refused a connection from %s: %s", self.method, _peer(writer), refusal)
                await writer.drain()
                return False
            return True

    async def _read_calls(self, reader, writer, answering: set) -> None:
        # Replies are written whole, one frame each, as their calls finish.
        async def answer(call) -> None:
            reply = await grpc_errors.answer_call(call, self.handle, self.reply_type, self.handler_name)
            payload = reply.SerializeToString()
            if len(payload) > self.max_message_bytes:  # refuse this call, not the connection
                over = self.reply_type(call_id=call.call_id)
                over.error.code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
                over.error.message = (f"the reply ({len(payload)} bytes) is larger than the service's "
                                      f"--max-message-bytes ({self.max_message_bytes})")
                payload = over.SerializeToString()
            self.answered += 1  # before the reply leaves: whoever reads the reply sees it counted
            if not writer.is_closing():
                writer.write(frame(payload))
                await writer.drain()  # a caller that does not read its replies slows its own answers

        while not self.closed:
            payload = await read_frame(reader, self.max_message_bytes)
            try:
                call = self.call_type.FromString(payload)
            except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError: the bytes are not a call
                raise ValueError(f"a frame that is not a {self.call_type.DESCRIPTOR.name}: {exc}") from None
            task = asyncio.ensure_future(answer(call))
            answering.add(task)
            task.add_done_callback(answering.discard)
            while len(answering) >= MAX_CALLS_IN_FLIGHT:
                await asyncio.wait(list(answering), return_when=asyncio.FIRST_COMPLETED)


def _peer(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if peer else "an unknown peer"


# ------------------------------------------------------------------ client


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

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def usable(self) -> bool:
        """Whether a call should try the lane (not closed, nor within RETRY_S of failing to open it)."""
        return not self._closed and (self._connection is not None or self.clock() >= self._down_until)

    async def __call__(self, request, timeout: float):
        if self._closed:
            raise LaneDown(f"the {self.service} service's lane client is closed")
        connection = self._connection if self._connection is not None else await self._open(timeout)
        call_id = next(self._ids)
        message = self.call_type(call_id=call_id, request=request,
                                 trace_context=dict(trace_metadata() or ()))
        payload = message.SerializeToString()
        if len(payload) > self.max_message_bytes:  # this call fails, not the connection it would break
            raise grpc_errors.rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"the call ({len(payload)} bytes) is larger than the limit "
                                        f"({self.max_message_bytes} bytes)")
        if connection.error is not None or connection.writer.is_closing():
            raise connection.error or _broken(self)
        reply_future = asyncio.get_running_loop().create_future()
        connection.waiting[call_id] = reply_future
        try:
            try:
                connection.writer.write(frame(payload))
            except (RuntimeError, OSError):  # the transport closed under us: the reader fails the rest
                raise _broken(self) from None
            async with asyncio.timeout(timeout):
                reply = await reply_future
        except TimeoutError:
            raise grpc_errors.rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        finally:
            connection.waiting.pop(call_id, None)
        if reply.HasField("error"):
            raise grpc_errors.rpc_error(grpc_errors.status_from_number(reply.error.code), reply.error.message)
        return reply.response

    async def _open(self, timeout: float) -> "_Connection":
        """The connection, opened by the first caller (the others wait for it;
        a caller cancelled meanwhile does not stop the opening)."""
        if self._opening is None or self._opening.done():
            self._opening = asyncio.ensure_future(self._connect(min(timeout, CONNECT_S)))
            # Read by whoever awaits it; retrieved here too, for when every caller was cancelled.
            self._opening.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(self._opening)

    async def _connect(self, timeout: float) -> "_Connection":
        try:
            if self._closed:
                raise LaneDown(f"the {self.service} service's lane client is closed")
            async with asyncio.timeout(timeout):
                if self._stale and self.find_port is not None:
                    self.port = await self.find_port(timeout)
                    if self.port <= 0:
                        raise LaneDown(f"the {self.service} service no longer offers a lane")
                context = self.ssl_context() if callable(self.ssl_context) else self.ssl_context
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, limit=1 << 16, ssl=context,
                    server_hostname=self.server_hostname if context else None)
                writer.write(frame(self.method.encode()))
                refusal = (await read_frame(reader, 1 << 16)).decode(errors="replace")
            if refusal:
                writer.close()
                raise LaneDown(f"the {self.service} service's lane at {self.address} refused: {refusal}")
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
            writer.close()
            raise LaneDown(f"the {self.service} service's lane client is closed")
        self._stale = False
        _keepalive(writer)
        connection = _Connection(writer)
        connection.reader = asyncio.ensure_future(self._read(connection, reader))
        self._connection = connection
        return connection

    async def _read(self, connection: "_Connection", reader: asyncio.StreamReader) -> None:
        error: grpc.aio.AioRpcError
        try:
            while True:
                reply = self.reply_type.FromString(await read_frame(reader, self.max_message_bytes))
                waiting = connection.waiting.pop(reply.call_id, None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(reply)
        except asyncio.CancelledError:
            error = grpc_errors.rpc_error(grpc.StatusCode.CANCELLED, f"the {self.service} service's lane was closed")
        except Exception as exc:  # noqa: BLE001 - the end of the connection, whatever ended it
            error = grpc_errors.rpc_error(grpc.StatusCode.UNAVAILABLE, f"the {self.service} service's lane at "
                                          f"{self.address} broke: {type(exc).__name__}")
        connection.error = error  # a caller that got this connection before now fails at once
        if self._connection is connection:
            self._connection = None
            self._stale = True
        for waiting in connection.waiting.values():
            if not waiting.done():
                waiting.set_exception(error)
        connection.waiting.clear()
        connection.writer.close()

    async def close(self) -> None:
        """End the connection (calls in flight fail CANCELLED) and any opening; later calls raise LaneDown."""
        self._closed = True
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
            await asyncio.gather(self._opening, return_exceptions=True)
        connection, self._connection = self._connection, None
        if connection is not None and connection.reader is not None:
            connection.reader.cancel()
            await asyncio.gather(connection.reader, return_exceptions=True)


class _Connection:
    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.reader: asyncio.Task | None = None
        self.waiting: dict[int, asyncio.Future] = {}
        self.error: grpc.aio.AioRpcError | None = None  # set once the connection has ended


def _broken(client: LaneClient) -> grpc.aio.AioRpcError:
    return grpc_errors.rpc_error(grpc.StatusCode.UNAVAILABLE,
                                 f"the {client.service} service's lane at {client.address} is closed")


def _keepalive(writer: asyncio.StreamWriter) -> None:
    """TCP keepalive on the connection, so that a peer gone without a word
    (a node lost, a partition) ends it in about a minute rather than when
    the kernel gives up retransmitting."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    except OSError:  # not a TCP socket (tests), or the platform refuses: the connection works without
        pass
