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
message. A call or reply over the receiver's message limit is read past
and fails alone, RESOURCE_EXHAUSTED, as over gRPC (the two sides' limits may
differ: each role has its own --max-message-bytes); a frame that does not
parse, or an oversized one with no call id to answer for, ends the
connection (every call in flight on it fails UNAVAILABLE).

Under mutual TLS the lane speaks TLS too: the server's certificate files are
re-read when they change (each connection's handshake uses the newest), and
the caller's certificate must name an allowed caller, as on the gRPC port.

Here: the wire (frames), and what both halves share. `LaneServer`
(specdec/rpc/lane_server.py) is the service's half; `LaneClient`
(specdec/rpc/lane_client.py) the orchestrator's, which `CallStream` uses in
front of its stream: when the lane cannot be reached, the call goes on the
call stream, and the lane is tried again later.
"""
from __future__ import annotations

import asyncio
import collections
import socket
from typing import Callable

from specdec import hops

HEADER = 4  # bytes of a frame's length
PEEK_BYTES = 16  # of an oversized frame, kept to read its call id (`call_id_of`)
KEEPALIVE = (30, 10, 3)  # TCP keepalive: idle s, interval s, probes (a peer gone without a word is found in ~60 s)
# Keepalive probes only an idle connection: data sent and never acknowledged
# (a call in flight when the peer's node vanished) is retransmitted for ~15
# minutes before the kernel gives up. This bounds that to the same minute.
USER_TIMEOUT_MS = 60_000


class LaneDown(Exception):
    """The lane could not be opened: nothing was sent, the call may go another way."""


class PendingReplies:
    """The calls sent on one connection (a lane's, or a call stream's) that
    wait for their replies, by call id."""

    def __init__(self) -> None:
        self._futures: dict[int, asyncio.Future] = {}

    def expect(self, call_id: int) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._futures[call_id] = future
        return future

    def forget(self, call_id: int) -> None:
        self._futures.pop(call_id, None)

    def resolve(self, reply) -> None:
        """Hand `reply` to the call it answers (none: that caller went away)."""
        future = self._futures.pop(reply.call_id, None)
        if future is not None and not future.done():
            future.set_result(reply)

    def fail_all(self, error: BaseException) -> None:
        """The connection ended: every call still waiting fails with `error`."""
        for future in self._futures.values():
            if not future.done():
                future.set_exception(error)
        self._futures.clear()


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(HEADER, "big") + payload


def call_id_of(head: bytes) -> int:
    """The call id a serialized call or reply starts with (field 1, a
    varint: protobuf writes fields in number order); ValueError when the
    bytes do not start so."""
    if not head or head[0] != 0x08:
        raise ValueError("an oversized frame that does not start with a call id")
    value, shift = 0, 0
    for byte in head[1:11]:
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value
        shift += 7
    raise ValueError("an oversized frame whose call id does not end in its first bytes")


class FrameConnection(asyncio.Protocol):
    """One lane connection, both halves' (lane_client.py, lane_server.py).

    Each whole frame goes to `on_frame(payload)` from `data_received`, as
    soon as it has arrived: a reply resolves its caller's future, a call
    starts its handler, with no reader task to wake in between (a turn of
    the event loop per frame saved, on every round). Until `on_frame` is
    set, frames wait for `next_frame()` (the handshake). An exception from
    `on_frame` (a frame that does not parse), or a frame over `limit`
    bytes, ends the connection with that error; unless `on_oversize` is set:
    then an oversized frame is read past, unkept but for its first
    PEEK_BYTES, and `on_oversize(head, size)` answers for it (the call it
    carried fails alone: a peer whose --max-message-bytes is larger is no
    reason to fail every call on the connection). `ended` is done once the
    connection is lost: its result is the error that ended it, or None."""

    def __init__(self, limit: int):
        self.limit = limit
        self.transport: asyncio.Transport | None = None
        self.on_frame: Callable[[bytes], None] | None = None
        self.ended: asyncio.Future = asyncio.get_running_loop().create_future()
        self._buffer = bytearray()
        self._early: collections.deque[bytes] = collections.deque()  # frames before on_frame was set
        self._waiter: asyncio.Future | None = None  # next_frame's
        self._paused = False  # writing, by the transport's flow control
        self._drain_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._held = False  # no frames delivered meanwhile (`hold`)
        self._error: BaseException | None = None
        self.hop_where = ""  # what `specdec.hops` calls this end of the connection
        self.on_oversize: Callable[[bytes, int], None] | None = None
        self._skip_left = 0  # bytes of an oversized frame still to read past
        self._skip_size = 0
        self._skip_head = bytearray()  # its first PEEK_BYTES

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        hops.record("frame.in", self.hop_where)
        if self._error is not None:
            return
        if self._skip_left:
            data = self._read_past(data)
            if not data or self._error is not None:
                return
        if (not self._buffer and self.on_frame is not None and not self._held and len(data) >= HEADER
                and int.from_bytes(data[:HEADER], "big") == len(data) - HEADER and len(data) - HEADER <= self.limit):
            self._deliver(data[HEADER:])  # the usual case: exactly one whole frame, no copy into the buffer
            return
        self._buffer += data
        self._parse()

    def _parse(self) -> None:
        """Deliver the buffer's whole frames. Before `on_frame` is set, one
        at a time: the handshake reads its frame under its own limit, and
        what follows it waits for the limit set after it (`start_frames`)."""
        buffer = self._buffer
        while (len(buffer) >= HEADER and self._error is None and not self._held
               and (self.on_frame is not None or not self._early)):
            size = int.from_bytes(buffer[:HEADER], "big")
            if size > self.limit and self.on_oversize is not None and self.on_frame is not None:
                rest = bytes(buffer[HEADER:])
                del buffer[:]
                self._skip_left, self._skip_size, self._skip_head = size, size, bytearray()
                rest = self._read_past(rest)
                if rest and self._error is None:
                    buffer += rest
                continue
            if size > self.limit:  # said by its header: no need to wait for the rest
                self._end(ValueError(f"a frame of {size} bytes is over the limit of {self.limit}"))
                return
            if len(buffer) < HEADER + size:
                break
            payload = bytes(buffer[HEADER:HEADER + size])
            del buffer[:HEADER + size]
            self._deliver(payload)

    def _read_past(self, data: bytes) -> bytes:
        """Consume what `data` holds of the oversized frame being read past
        (its head kept); once it is whole, `on_oversize` answers for it.
        What follows the frame is returned."""
        taken = min(len(data), self._skip_left)
        if len(self._skip_head) < PEEK_BYTES:
            self._skip_head += data[:min(taken, PEEK_BYTES - len(self._skip_head))]
        self._skip_left -= taken
        if not self._skip_left:
            try:
                self.on_oversize(bytes(self._skip_head), self._skip_size)
            except Exception as exc:  # noqa: BLE001 - an oversized frame it cannot answer for ends the connection
                self._end(exc)
        return data[taken:]

    def _deliver(self, payload: bytes) -> None:
        """A whole frame, within the limit (checked where it was read)."""
        try:
            if self.on_frame is not None:
                self.on_frame(payload)
            else:
                self._early.append(payload)
                if self._waiter is not None and not self._waiter.done():
                    self._waiter.set_result(None)
        except Exception as exc:  # noqa: BLE001 - whatever the frame did, it ends this connection only
            self._end(exc)

    def _end(self, error: BaseException) -> None:
        self._error = error
        if self.transport is not None:
            # Aborted, not closed: a close waits for the write buffer to drain,
            # which a peer that stopped reading never lets happen, and the
            # calls waiting here would fail only at their deadlines.
            self.transport.abort()  # connection_lost follows

    def start_frames(self, on_frame: Callable[[bytes], None]) -> None:
        """From now on each frame goes to `on_frame`, those that came early first."""
        self.on_frame = on_frame
        while self._early and self._error is None:
            self._deliver(self._early.popleft())
        self._parse()

    async def next_frame(self) -> bytes:
        """The next frame that arrived before `on_frame` was set;
        IncompleteReadError once the connection has ended without one,
        ValueError for an oversized one."""
        while not self._early:
            if self.ended.done():
                if isinstance(self._error, ValueError):
                    raise self._error
                raise asyncio.IncompleteReadError(b"", HEADER)
            self._waiter = asyncio.get_running_loop().create_future()
            await asyncio.wait([self._waiter, self.ended], return_when=asyncio.FIRST_COMPLETED)
        return self._early.popleft()

    def connection_lost(self, exc: Exception | None) -> None:
        error = self._error or exc
        if not self.ended.done():
            self.ended.set_result(error)
        self._wake_drainers()

    @property
    def held(self) -> bool:
        return self._held

    def hold(self) -> None:
        """Deliver no more frames, and read no more, until `release`."""
        self._held = True
        if not self.is_closing():
            self.transport.pause_reading()

    def release(self) -> None:
        """Deliver the frames that came meanwhile, and read on."""
        self._held = False
        if not self.is_closing():
            self.transport.resume_reading()
        self._parse()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_drainers()

    def _wake_drainers(self) -> None:
        while self._drain_waiters:
            waiter = self._drain_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    async def drain(self) -> None:
        """Wait while the transport's write buffer is over its high-water
        mark (every writer waiting is woken, as a StreamWriter's are)."""
        if not self._paused or self.ended.done():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(waiter)
        await waiter

    def write(self, payload: bytes) -> None:
        """`payload` as one frame."""
        self.transport.write(frame(payload))

    def is_closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()


def keepalive(writer: asyncio.StreamWriter | asyncio.Transport) -> None:
    """TCP keepalive on the connection, and a user timeout for what is sent
    while the peer is gone, so that a peer gone without a word (a node lost,
    a partition) ends it in about a minute rather than when the kernel gives
    up retransmitting."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT", "TCP_USER_TIMEOUT"),
                                 (*KEEPALIVE, USER_TIMEOUT_MS)):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    except OSError:  # not a TCP socket (tests), or the platform refuses: the connection works without
        pass
