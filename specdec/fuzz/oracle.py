"""What every fuzzed call is held to, and the tally of what came back.

Oracles:
- no status INTERNAL or UNKNOWN (our bug), and no DEADLINE_EXCEEDED: every
  call carries a deadline, and running into it means the service hung;
- a refused call says why (a non-empty message);
- a call valid by the contract succeeds (`Expect.OK`), and one the contract
  forbids is refused (`Expect.FAIL`); `Expect.ANY` where the fuzzer cannot
  know (concurrent calls on one session, raw bytes);
- a witness session beside the fuzzing produces exactly what it produced alone
  (`Witness`).

A `Tally` counts messages by (service, rpc, status) and keeps the violations;
strict (tests), the first violation raises AssertionError, which fails the
hypothesis example; otherwise (the full run) they are collected and reported.
"""
from __future__ import annotations

import enum
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import grpc

from specdec.rpc.grpc_errors import status_from_number
from specdec.rpc.lane_methods import LaneMethod

BAD = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED})
CALL_TIMEOUT_S = 20.0  # each call's deadline: far above what any fuzzed call needs on the tiny models


class Expect(enum.Enum):
    OK = "ok"
    FAIL = "fail"
    ANY = "any"


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str = ""
    response: object = None  # the reply (a list of replies for a stream)

    @property
    def ok(self) -> bool:
        return self.code is grpc.StatusCode.OK


def call(method, request, streaming: bool = False, timeout: float = CALL_TIMEOUT_S) -> Outcome:
    """One call with a deadline; a stream is read to its end."""
    try:
        response = method(request, timeout=timeout)
        if streaming:
            response = list(response)
        return Outcome(grpc.StatusCode.OK, "", response)
    except grpc.RpcError as err:
        return Outcome(err.code(), err.details() or "")


def call_on_stream(method, call_type, request, timeout: float = CALL_TIMEOUT_S) -> Outcome:
    """`request` as one call on a new call stream (`method`: ProposeAllStream
    or VerifyStream): the call's own status when its reply carries an error,
    the stream's when the stream fails; a stream that ends without a reply,
    or with a reply to another call, is a violation the caller sees as
    INTERNAL."""
    try:
        replies = list(method(iter([call_type(call_id=1, request=request)]), timeout=timeout))
    except grpc.RpcError as err:
        return Outcome(err.code(), err.details() or "")
    if len(replies) != 1 or replies[0].call_id != 1:
        return Outcome(grpc.StatusCode.INTERNAL, f"{len(replies)} replies to one call: {replies}")
    reply = replies[0]
    if reply.HasField("error"):
        return Outcome(status_from_number(reply.error.code), reply.error.message)
    return Outcome(grpc.StatusCode.OK, "", reply.response)


def call_on_lane(port: int, method: LaneMethod, request, timeout: float = CALL_TIMEOUT_S) -> Outcome:
    """`request` as one call on the lane (`_on_lane`)."""
    payload = method.call_type(call_id=1, request=request).SerializeToString()
    return _on_lane(port, method.path, payload, method.reply_type, timeout, 1)


def raw_on_lane(port: int, method: LaneMethod, data: bytes, timeout: float = CALL_TIMEOUT_S) -> Outcome:
    """`data` as one frame on the lane: a frame that is not a call must end
    the connection (INVALID_ARGUMENT here), one that parses is answered
    (with whatever call id the bytes hold)."""
    out = _on_lane(port, method.path, data, method.reply_type, timeout, None)
    if out.code is grpc.StatusCode.INTERNAL and out.details == "the lane ended without a reply":
        return Outcome(grpc.StatusCode.INVALID_ARGUMENT, "the lane ended the connection")
    return out


def _on_lane(port: int, method: str, payload: bytes, reply_type, timeout: float, call_id: int | None) -> Outcome:
    """`payload` as one frame on a new connection to the service's lane
    (specdec/rpc/lane.py), spoken with plain blocking sockets, not our
    client: the hello naming `method`, the frame, one reply. A refused
    hello, a connection that ends without exactly one reply to the call, or
    a reply past the deadline is seen as INTERNAL or DEADLINE_EXCEEDED."""
    import socket
    import struct

    def frame(payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + payload

    def read_frame(sock) -> bytes | None:
        header = _read_exactly(sock, 4)
        return None if header is None else _read_exactly(sock, struct.unpack(">I", header)[0])

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(frame(method.encode()) + frame(payload))
            hello = read_frame(sock)
            if hello is None or hello:
                return Outcome(grpc.StatusCode.INTERNAL, f"the lane refused the hello: {hello!r}")
            payload = read_frame(sock)
    except socket.timeout:
        return Outcome(grpc.StatusCode.DEADLINE_EXCEEDED, "no reply on the lane")
    except OSError as exc:
        return Outcome(grpc.StatusCode.INTERNAL, f"the lane's connection failed: {exc}")
    if payload is None:
        return Outcome(grpc.StatusCode.INTERNAL, "the lane ended without a reply")
    try:
        reply = reply_type.FromString(payload)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError: the service sent garbage
        return Outcome(grpc.StatusCode.INTERNAL, f"an unparsable reply on the lane: {exc}")
    if call_id is not None and reply.call_id != call_id:
        return Outcome(grpc.StatusCode.INTERNAL, f"a reply to another call: {reply}")
    if reply.HasField("error"):
        return Outcome(status_from_number(reply.error.code), reply.error.message)
    return Outcome(grpc.StatusCode.OK, "", reply.response)


def _read_exactly(sock, size: int) -> bytes | None:
    """`size` bytes, or None when the connection ends first."""
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


@dataclass
class Violation:
    service: str
    rpc: str
    what: str
    request: str

    def __str__(self) -> str:
        return f"[{self.service}.{self.rpc}] {self.what}\n    request: {self.request}"


@dataclass
class Tally:
    strict: bool = False
    counts: Counter = field(default_factory=Counter)  # (service, rpc, status name) -> messages
    item_counts: Counter = field(default_factory=Counter)  # Verify items: (service, status name) -> items
    violations: list[Violation] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def messages(self) -> int:
        return sum(self.counts.values())

    def sent(self, service: str) -> int:
        return sum(n for (s, _, _), n in self.counts.items() if s == service)

    def record(self, service: str, rpc: str, status: str) -> None:
        with self._lock:
            self.counts[(service, rpc, status)] += 1

    def violate(self, service: str, rpc: str, what: str, request=None) -> None:
        text = _short(request)
        with self._lock:
            self.violations.append(Violation(service, rpc, what, text))
        if self.strict:
            raise AssertionError(str(self.violations[-1]))

    def check(self, service: str, rpc: str, outcome: Outcome, expect: Expect, request=None) -> bool:
        """Apply the status oracles to one call; True when it succeeded."""
        self.record(service, rpc, outcome.code.name)
        if outcome.code in BAD:
            self.violate(service, rpc, f"{outcome.code.name}: {outcome.details}", request)
        elif not outcome.ok and not outcome.details:
            self.violate(service, rpc, f"{outcome.code.name} without a message", request)
        elif expect is Expect.OK and not outcome.ok:
            self.violate(service, rpc, f"a valid call was refused: {outcome.code.name}: {outcome.details}", request)
        elif expect is Expect.FAIL and outcome.ok:
            self.violate(service, rpc, "an invalid call succeeded", request)
        return outcome.ok

    def by_status(self, service: str | None = None) -> Counter:
        out: Counter = Counter()
        for (s, _, status), n in self.counts.items():
            if service is None or s == service:
                out[status] += n
        return out

    def report(self) -> str:
        lines = []
        for service in sorted({s for s, _, _ in self.counts}):
            statuses = ", ".join(f"{k} {v}" for k, v in sorted(self.by_status(service).items()))
            lines.append(f"{service}: {self.sent(service)} messages ({statuses})")
            items = {k[1]: v for k, v in self.item_counts.items() if k[0] == service}
            if items:
                lines.append("  Verify items: " + ", ".join(f"{k} {v}" for k, v in sorted(items.items())))
        lines.append(f"violations: {len(self.violations)}")
        lines.extend(f"  {v}" for v in self.violations[:20])
        return "\n".join(lines)


def _short(request, limit: int = 600) -> str:
    text = repr(request) if not hasattr(request, "ListFields") else str(request).replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


class Witness:
    """A fixed computation (`run() -> result`) that must give the same result
    while the fuzzing goes on as it gave alone: run once before (`reference`),
    then over and over on a thread (`start`/`stop`), then once after."""

    def __init__(self, service: str, run: Callable[[], object], tally: Tally, pause_s: float = 0.0):
        self.service = service
        self.pause_s = pause_s  # between runs, so the witness does not take all the server's time
        self._run = run
        self.tally = tally
        self.runs = 0
        self.reference = run()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.mismatches: list[str] = []

    def _check_once(self) -> None:
        try:
            result = self._run()
        except Exception as exc:  # noqa: BLE001 - a witness must never fail
            self.mismatches.append(f"witness failed: {exc!r}")
            return
        self.runs += 1
        if result != self.reference:
            self.mismatches.append(f"witness differs: {result!r} != alone {self.reference!r}")

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._check_once()
            self._stop.wait(self.pause_s)

    def start(self) -> "Witness":
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"witness-{self.service}")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread, run once more alone, and report any difference as violations."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
        self._check_once()
        strict, self.tally.strict = self.tally.strict, False
        for text in self.mismatches:
            self.tally.violate(self.service, "witness", text)
        self.tally.strict = strict
