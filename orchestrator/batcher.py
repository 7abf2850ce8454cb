"""The verification batcher: one Verify RPC for the rounds of many requests.

Each request in a round hands its VerifyItem to `verify()` and awaits its own
result. Items are sent together when the batch is full, when every active
request has an item waiting (nothing more can come, so waiting would only add
latency), or when the oldest item has waited `window_s`, provided fewer than
`max_in_flight` batches are on their way; otherwise items gather until one
returns. The target runs its forward passes one at a time, so a batch sent
while another is computing would only queue there: holding it back lets the
items that arrive meanwhile ride in one pass instead of several small ones
(measured on the real CPU pair: target-only decoding of 8 streams gained
nothing over one stream without this limit). A request waits only for the
batch that carries its item, within its own deadline.

Tracing: a batch serves several requests, hence several traces. Its RPC span
(`verify.batch`) is a child of the FIRST item's `target.verify` span (so the
target's `verify` span lands in that request's trace) and links to the other
items' spans; each other item's `target.verify` span links back to the batch.

The batcher also holds its replica's speculation gate
(`orchestrator/speculation_gate.py`): whether the requests it batches
speculate at all is a choice for the batch, not for one request.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind

from orchestrator.downstream import TargetClient, unavailable
from orchestrator.speculation_gate import GateSettings, SpeculationGate
from specdec.rpc import grpc_errors
from specdec.errors import DeadlineExceeded, NotFound, SpecdecError, Unavailable
from specdec.telemetry import A_BATCH_ITEMS, A_BATCH_SESSIONS, A_PEER, NOOP, SPAN_VERIFY_BATCH, Telemetry
from specdec.v1 import target_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyReply:
    result: target_pb2.VerifyResult
    batch_size: int
    compute_s: float  # server-side compute of the whole batch
    rtt_s: float  # orchestrator-side time of the whole RPC
    wire_bytes: int  # this item's share of the request and reply bytes
    items: int = 1  # verify items (requests) the RPC carried


class VerifyBatcher:
    def __init__(self, target: TargetClient, max_batch: int = 16, window_s: float = 0.002,
                 rpc_timeout_s: float = 120.0, enabled: bool = True, telemetry: Telemetry = NOOP,
                 max_in_flight: int = 1, gate: SpeculationGate | None = None):
        self.target = target
        # Whether the requests batched here speculate at all (off: they always do).
        self.gate = gate or SpeculationGate(GateSettings(enabled=False))
        self.max_batch = max_batch if enabled else 1
        # Unbatched: every item goes at once, as before batching existed.
        self.max_in_flight = max(1, max_in_flight) if enabled else 1 << 30
        self._in_flight = 0
        self.window_s = window_s
        self.rpc_timeout_s = rpc_timeout_s
        self.telemetry = telemetry
        # (item, its future, the caller's trace context or None)
        self._pending: list[tuple[target_pb2.VerifyItem, asyncio.Future, object]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._active = 0  # requests currently generating
        self.batches_sent = 0

    @property
    def active(self) -> int:
        """Requests generating on this target replica now."""
        return self._active

    def request_started(self) -> None:
        self._active += 1

    def request_finished(self) -> None:
        self._active -= 1
        self._maybe_flush()

    async def verify(self, item: target_pb2.VerifyItem, timeout: float | None = None) -> VerifyReply:
        """`item`'s reply, from the batch that carries it. `timeout`: how long
        the caller waits for it, then DeadlineExceeded (Unavailable when it is
        no shorter than `rpc_timeout_s`: then it is the call's limit, not a
        deadline of the request's own). The deadline is a
        timer that fails the reply's future, not asyncio.wait_for: on every
        round that saves a task, and the two turns of the event loop it
        takes to start and to hand the reply back (~0.1 ms on the dev VM)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        caller = otel_context.get_current() if self.telemetry.tracing else None
        if self._active <= 1 and not self._pending and self._in_flight < self.max_in_flight:
            return await self._send_alone((item, future, caller), timeout)
        entry = (item, future, caller)
        self._pending.append(entry)
        self._maybe_flush()
        if self._pending and self._timer is None:
            self._timer = loop.call_later(self.window_s, self._flush)
        # Past a timeout as long as the call's own limit (the request has no
        # shorter deadline), the target did not answer in time: its failure,
        # as a call alone ends (`_send_batch`), not the request's deadline.
        deadline = (loop.call_later(timeout, _expire, future, timeout >= self.rpc_timeout_s)
                    if timeout is not None else None)
        try:
            return await future
        except BaseException:
            # Cancelled, or past its time: an item still pending is nobody's
            # now (its request ends, or moves to a new session), and goes to
            # no batch.
            self._withdraw(entry)
            raise
        finally:
            if deadline is not None:
                deadline.cancel()

    def _withdraw(self, entry) -> None:
        for i, pending in enumerate(self._pending):
            if pending is entry:
                del self._pending[i]
                if not self._pending and self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                return

    def _maybe_flush(self) -> None:
        if self._pending and (len(self._pending) >= self.max_batch or len(self._pending) >= self._active):
            self._flush()

    def _flush(self) -> None:
        """Send what is pending, as far as the in-flight limit allows; the rest
        goes when a batch returns."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending and self._in_flight < self.max_in_flight:
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            self._in_flight += 1
            asyncio.ensure_future(self._send(batch))

    def _returned(self) -> None:
        self._in_flight -= 1
        if self._pending:
            self._flush()

    async def _send(self, batch: list[tuple[target_pb2.VerifyItem, asyncio.Future, object]]) -> None:
        try:
            await self._send_batch(batch)
        finally:
            self._returned()

    async def _send_alone(self, entry: tuple[target_pb2.VerifyItem, asyncio.Future, object],
                          timeout: float | None) -> VerifyReply:
        """A lone request's item (nothing else pending or in flight, no other
        request on the replica): its batch, sent from the caller's own task
        under the caller's deadline. A task of its own would cost a turn of
        the event loop to start, and another to hand the reply on. A caller
        cancelled meanwhile frees the in-flight slot at once (its reply, if
        one comes, is dropped), so a batch pending then may reach the target
        while it still computes the abandoned one, and wait there for it."""
        self._in_flight += 1
        try:
            await self._send_batch([entry], timeout)
        finally:
            self._returned()
        return entry[1].result()

    async def _send_batch(self, batch: list[tuple[target_pb2.VerifyItem, asyncio.Future, object]],
                          caller_timeout: float | None = None) -> None:
        """One Verify carrying `batch`; each item's future gets its result or
        error. `caller_timeout`: the one caller's deadline (`_send_alone`),
        which bounds the call and ends it in DeadlineExceeded."""
        self.batches_sent += 1
        items = [item for item, _, _ in batch]
        timeout = self.rpc_timeout_s if caller_timeout is None else min(caller_timeout, self.rpc_timeout_s)
        with self._batch_span(batch) as span:
            start = time.perf_counter()
            try:
                reply, request_bytes = await self.target.verify(items, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                span.set_status(trace.Status(trace.StatusCode.ERROR, exc.code().name))
                if (exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and caller_timeout is not None
                        and caller_timeout < self.rpc_timeout_s):  # the request's own deadline, not the call's limit
                    error = _deadline_passed()
                else:
                    error = unavailable("target", exc)
                _fail(batch, error)
                return
            except grpc.aio.UsageError as exc:  # the channel was closed under the call: the replica is gone
                span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
                _fail(batch, Unavailable(f"the target service's channel failed: {exc}"))
                return
            except Exception as exc:  # noqa: BLE001 - our bug: the batch's items fail with it, none waits on
                log.exception("a Verify of %d items failed", len(batch))
                span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
                _fail(batch, SpecdecError(f"verifying failed: {type(exc).__name__}: {exc}"))
                return
            rtt = time.perf_counter() - start
            span.set_attribute(A_BATCH_SESSIONS, reply.batch_size)
        self.telemetry.metrics.record_rpc("target", "Verify", rtt)
        share = (request_bytes + reply.ByteSize()) // len(batch)
        for (_, future, _), result in zip(batch, reply.results):
            if future.done():  # the request was cancelled meanwhile
                continue
            if result.HasField("error"):
                future.set_exception(_item_error(result.error))
            else:
                future.set_result(VerifyReply(result, reply.batch_size, reply.compute_micros / 1e6, rtt, share,
                                              len(batch)))
        for _, future, _ in batch[len(reply.results):]:  # a reply short of results: never a hang
            if not future.done():
                future.set_exception(SpecdecError(f"the target's reply carried {len(reply.results)} results "
                                                  f"for {len(batch)} items"))

    @contextlib.contextmanager
    def _batch_span(self, batch):
        """The RPC's span: child of the first sampled caller's span, linked
        both ways with the others' (see the module docstring). Under an
        unsampled caller (its client sent flags 00, or a ratio sampler passed
        it by) the batch's span, and the target's under it, would be dropped
        for every request in the batch."""
        if not self.telemetry.tracing:
            yield trace.INVALID_SPAN
            return
        contexts = [ctx for _, _, ctx in batch]
        first = next((i for i, ctx in enumerate(contexts)
                      if trace.get_current_span(ctx).get_span_context().trace_flags.sampled), 0)
        callers = [trace.get_current_span(ctx) for i, ctx in enumerate(contexts) if i != first]
        links = [Link(c.get_span_context()) for c in callers if c.get_span_context().is_valid]
        with self.telemetry.span(SPAN_VERIFY_BATCH, {A_PEER: "target", A_BATCH_ITEMS: len(batch)},
                                 parent=contexts[first], kind=SpanKind.CLIENT, links=links) as span:
            for caller in callers:
                if caller.is_recording():  # still open: its request awaits this batch
                    caller.add_link(span.get_span_context())
            yield span


def _fail(batch, error: Exception) -> None:
    for _, future, _ in batch:
        if not future.done():
            future.set_exception(error)


def _deadline_passed() -> DeadlineExceeded:
    return DeadlineExceeded("the request's deadline passed while verifying")


def _expire(future: asyncio.Future, call_limit: bool) -> None:
    if not future.done():  # its batch, when it returns, skips it
        future.set_exception(Unavailable("the target service did not answer within the call's time limit")
                             if call_limit else _deadline_passed())


def _item_error(error: target_pb2.ItemError) -> SpecdecError:
    """An item's error as the loop raises it: a lost session is recovered
    (NotFound); a status the core has an error for keeps it (a replica
    restarted with a lower --max-draft-tokens refuses a round's k with
    INVALID_ARGUMENT, and the client is told so); the rest is our failure
    (INTERNAL, logged)."""
    code = grpc_errors.status_from_number(error.code)
    if code is grpc.StatusCode.NOT_FOUND:
        return NotFound(f"target session lost: {error.message}")
    kind = grpc_errors.error_kind(code)
    if kind is not None:
        return kind(f"target service: {error.message}")
    return SpecdecError(f"target rejected the round: {code.name}: {error.message}")
