"""A service's lane, the service's half (the wire and the design: specdec/rpc/lane.py)."""
from __future__ import annotations

import asyncio
import logging
import ssl

import grpc

from specdec.rpc import grpc_errors
from specdec.rpc.auth import caller_refusal
from specdec.rpc.lane import frame, keepalive, read_frame

log = logging.getLogger(__name__)

HELLO_S = 10.0  # the server's limit for a new connection's TLS handshake and hello
MAX_CALLS_IN_FLIGHT = 1024  # calls one connection may have the server answering at once; reading waits past it


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
        keepalive(writer)
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
