"""A service's lane, the service's half (the wire and the design: specdec/rpc/lane.py)."""
from __future__ import annotations

import asyncio
import functools
import logging
import ssl

from specdec import busy_poll, hops
from specdec.eager import start_now
from specdec.rpc import grpc_errors
from specdec.rpc.auth import caller_refusal
from specdec.rpc.lane import FrameConnection, call_id_of, keepalive

log = logging.getLogger(__name__)

HELLO_S = 10.0  # the server's limit for a new connection's TLS handshake and hello
MAX_CALLS_IN_FLIGHT = 1024  # calls one connection may have the server answering at once; reading waits past it


class LaneTls:
    """The server side of a lane under mutual TLS: an SSL context from the
    service's certificate files, rebuilt when they change
    (`ReloadingServerContext`), and the names a caller's certificate must
    carry one of."""

    def __init__(self, cert: str, key: str, ca: str, allowed: frozenset[str]):
        from specdec.security.tls import ReloadingServerContext

        self.contexts = ReloadingServerContext(cert, key, ca)
        self.allowed = allowed

    def listening_context(self) -> ssl.SSLContext:
        """The context the lane's port listens with: a renewed certificate is
        served from the next connection on."""
        return self.contexts.listening_context()

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
        self._connections: dict[asyncio.Task, _Accepted] = {}  # each connection's task, and the connection
        self.closed = False
        self.answered = 0  # calls answered, since start
        self._call_gap = busy_poll.Expected()  # from a reply to the next call (--busy-poll-us)
        # What `specdec.hops` calls this service: "draft" for /specdec.v1.DraftService/ProposeAll.
        self.role = method.rsplit("/", 2)[-2].rsplit(".", 1)[-1].removesuffix("Service").lower()

    async def start(self, host: str, port: int) -> int:
        # Under TLS the handshake completes before a connection is made (and
        # its protocol sees a byte): asyncio's and uvloop's own TLS.
        tls = {"ssl": self.tls.listening_context(), "ssl_handshake_timeout": HELLO_S} if self.tls else {}
        self._server = await asyncio.get_running_loop().create_server(lambda: _Accepted(self), host, port, **tls)
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
        """After `close`: wait up to `grace_s` for the calls read to be answered;
        the connections still open then are aborted (as grpc cancels its calls
        past the grace): a caller that never reads its replies would otherwise
        hold its connection, and the answers waiting to write to it, for good."""
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=max(grace_s, 0.0))
        for connection in list(self._connections.values()):
            if connection.transport is not None:
                connection.transport.abort()  # connection_lost wakes its answers; its task then ends

    async def _serve(self, connection: "_Accepted") -> None:
        """One connection's life: the handshake, then its calls, each started
        in the connection's data_received: answered there when it never
        waits, else by a task of its own."""
        answering: set[asyncio.Future] = set()
        keepalive(connection.transport)
        try:
            if await self._opened(connection):
                connection.limit = self.max_message_bytes
                connection.on_oversize = functools.partial(self._refuse_oversized, connection)
                connection.start_frames(functools.partial(self._call, connection, answering))
                ended = await asyncio.shield(connection.ended)
                if isinstance(ended, ValueError):  # an oversized or unparsable frame: not our client
                    log.warning("lane %s: ending a connection from %s: %s", self.method, _peer(connection.transport),
                                ended)
        except asyncio.CancelledError:
            pass  # a drain: answer what was read, then end
        except (asyncio.IncompleteReadError, OSError, TimeoutError):
            pass  # the caller went away (or sent no hello in time)
        except ValueError as exc:  # an oversized hello
            log.warning("lane %s: ending a connection from %s: %s", self.method, _peer(connection.transport), exc)
        finally:
            connection.on_frame = _ignored  # no new calls
            while answering:
                await asyncio.gather(*answering, return_exceptions=True)
            # The connection then closes and leaves `_connections` (`_Accepted._served`).

    async def _opened(self, connection: "_Accepted") -> bool:
        """The handshake: TLS (when on), then the method; a refusal is sent as the hello's text."""
        async with asyncio.timeout(HELLO_S):
            refusal = ""
            if self.tls is not None:  # the handshake is done (`start`): who called?
                refusal = self.tls.refusal(connection.transport.get_extra_info("peercert"))
            method = (await connection.next_frame()).decode(errors="replace")
            if not refusal and method != self.method:
                refusal = f"this lane answers {self.method}, not {method}"
            if self.closed:
                refusal = "the service is draining"
            connection.write(refusal.encode())
            if refusal:
                log.warning("lane %s: refused a connection from %s: %s", self.method, _peer(connection.transport),
                            refusal)
                await connection.drain()
                return False
            return True

    def _call(self, connection: "_Accepted", answering: set, payload: bytes) -> None:
        """A call frame, from data_received: its answer starts at once. Past
        MAX_CALLS_IN_FLIGHT answers at once, the connection stops reading."""
        try:
            call = self.call_type.FromString(payload)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError: the bytes are not a call
            raise ValueError(f"a frame that is not a {self.call_type.DESCRIPTOR.name}: {exc}") from None
        busy_poll.arrived(self._call_gap)  # a linger after the last reply has done its work
        # Started at once: a call that never waits (a lone round's) is
        # answered here, without a turn of the loop (specdec/eager.py).
        task = start_now(self._answer(connection, call))
        if task is None:
            return
        answering.add(task)

        def done(finished: asyncio.Future) -> None:
            answering.discard(finished)
            if connection.held and len(answering) < MAX_CALLS_IN_FLIGHT:
                connection.release()  # the calls that came meanwhile first

        task.add_done_callback(done)
        if len(answering) >= MAX_CALLS_IN_FLIGHT and not connection.held:
            connection.hold()  # frames already read wait too

    def _refuse_oversized(self, connection: "_Accepted", head: bytes, size: int) -> None:
        """A call over this service's limit (its caller's is larger): that
        call fails RESOURCE_EXHAUSTED, as grpc fails a unary call over the
        limit, and the connection goes on."""
        reply = grpc_errors.too_large_reply(self.reply_type, call_id_of(head),
                                            f"the call ({size} bytes) is larger than the service's "
                                            f"--max-message-bytes ({self.max_message_bytes})")
        if not connection.is_closing():
            connection.write(reply.SerializeToString())

    async def _answer(self, connection: "_Accepted", call) -> None:
        # Replies are written whole, one frame each, as their calls finish.
        hops.record("call.start", self.role)
        reply = await grpc_errors.answer_call(call, self.handle, self.reply_type, self.handler_name)
        payload = reply.SerializeToString()
        if len(payload) > self.max_message_bytes:  # refuse this call, not the connection
            payload = grpc_errors.too_large_reply(
                self.reply_type, call.call_id,
                grpc_errors.reply_over_limit(len(payload), self.max_message_bytes)).SerializeToString()
        self.answered += 1  # before the reply leaves: whoever reads the reply sees it counted
        if hops.ON:
            hops.record("call.answered", self.role, hops.compute_micros(reply.response))
        if not connection.is_closing():
            connection.write(payload)
            busy_poll.linger(self._call_gap)  # the caller's next call usually follows within a round (--busy-poll-us)
            await connection.drain()  # a caller that does not read its replies slows its own answers


class _Accepted(FrameConnection):
    """A connection the lane accepted; its life is a task of the server's (`LaneServer._serve`)."""

    def __init__(self, server: LaneServer):
        super().__init__(limit=1024)  # the hello: a method's name
        self.server = server
        self.hop_where = server.role

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        task = asyncio.ensure_future(self.server._serve(self))
        self.server._connections[task] = self
        task.add_done_callback(self._served)

    def _served(self, task: asyncio.Future) -> None:
        """The connection's task ended (or was cancelled before its first
        step, by a drain right after the accept): close it."""
        self.server._connections.pop(task, None)
        if not self.is_closing():
            self.transport.close()


def _ignored(payload: bytes) -> None:
    """What a connection's frames go to while it drains: nowhere."""


def _peer(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if peer else "an unknown peer"
