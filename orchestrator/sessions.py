"""One request's two sessions: the draft's and the target's.

`RequestSessions` holds each session's id and the length of the prefix its
context shares with the request's history (the keep_length of the next call
to it), and does everything to a session that is not a round:

- opening it on the history (a prefill), so that an open whose request is
  cancelled or out of time meanwhile never loses the session: it is closed;
- closing it in the background, once more with a longer deadline when the
  service was too busy to answer (a session left open holds a KV slot until
  it expires);
- the draft's fallback: a failed draft call closes its session, the rounds
  run with k = 0, and the draft is re-opened on the full history after
  `draft_retry_s`; a call that fails UNAVAILABLE marks the draft replica down
  in its pool (`pin_draft`), so that new requests go to another, and an open
  that succeeds marks it up again. The re-open itself moves the request to
  the draft replica a new request would get when its own has not answered
  since it failed and another is up (`ReplicaPool.move_from`), rather than
  waiting on a dead address for the rest of the request; the request's
  hold on the pool moves with it, and is let go once (`release_draft`);
- the target's recovery: when the target fails (UNAVAILABLE, or it lost the
  session), the request's `TargetLease` (`orchestrator/recovery.py`) re-opens
  the session on a live replica, and the request moves to that replica's
  client and batcher.

The loop (`orchestrator/speculation.py`) reads and moves the ids and prefixes
each round. Session opens and closes are `session.open` / `session.close`
spans, a recovery a `target.recover` span (docs/observability.md).
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from orchestrator.batcher import VerifyBatcher
from orchestrator.downstream import CallCost, DraftClient, TargetClient, open_request, open_to_its_end
from orchestrator.request_stats import RequestSpec, RequestStats
from specdec.errors import DeadlineExceeded, Unavailable
from specdec.rpc.grpc_errors import from_rpc_error
from specdec.telemetry import (A_FAILED_REPLICA, A_PEER, A_RECOVERED_ON, SPAN_SESSION_CLOSE, SPAN_SESSION_OPEN,
                               SPAN_TARGET_RECOVER, Telemetry)

log = logging.getLogger(__name__)

CLOSE_TIMEOUTS_S = (5.0, 30.0)  # a close's deadline, and its retry's
# A target that fails again after each re-open is not coming back for this request.
MAX_TARGET_RECOVERIES = 8


class RequestSessions:
    """The request's sessions on its target and (when it speculates) its draft.

    `history` is the request's own list (prompt + emitted tokens), shared with
    the loop; `rpc_timeout_s` bounds every call, `draft_retry_s` is the wait
    before a failed draft is re-opened."""

    def __init__(self, spec: RequestSpec, history: list[int], target: TargetClient, batcher: VerifyBatcher,
                 draft: DraftClient | None, stats: RequestStats, telemetry: Telemetry, lease,
                 rpc_timeout_s: float, draft_retry_s: float):
        self.spec = spec
        self.history = history
        self.target = target
        self.batcher = batcher
        self.draft = draft
        self.stats = stats
        self.telemetry = telemetry
        self.lease = lease  # orchestrator.recovery.TargetLease: re-opens a failed target session; None: fail
        self.rpc_timeout_s = rpc_timeout_s
        self.draft_retry_s = draft_retry_s
        self.target_id: str | None = None
        self.target_prefix = 0  # of `history`, shared with the target's context
        self.draft_id: str | None = None  # None: no draft session (none asked for, or in fallback)
        self.draft_prefix = 0
        self._draft_calls = 0  # Propose calls numbered so far (ProposeRequest.call_number)
        self._draft_down_since: float | None = None
        self._draft_pool = None  # the draft's ReplicaPool and the request's Replica in it (`pin_draft`)
        self._draft_replica = None

    def pin_draft(self, pool, replica) -> None:
        """The draft replica the request is pinned to, in its pool (acquired
        there; the request's hold is now the sessions' to move and to let go:
        `release_draft`): marked down there when a call to it fails
        UNAVAILABLE (the health loop may not notice for a second, and
        meanwhile new requests would be pinned to it), up again when an open
        succeeds; left for a live replica at a re-open (`_move_draft`)."""
        self._draft_pool, self._draft_replica = pool, replica

    @property
    def draft_replica(self):
        """The draft replica the request is pinned to now (None: none pinned, or released)."""
        return self._draft_replica

    async def release_draft(self) -> None:
        """The request ended: let go of its draft replica in its pool, once,
        whichever replica it is pinned to by now."""
        replica, self._draft_replica = self._draft_replica, None
        if replica is not None:
            await self._draft_pool.release(replica)

    def timeout(self) -> float:
        """The deadline of the next call: rpc_timeout_s, or what is left of
        the request's own deadline (DeadlineExceeded once it passed)."""
        if self.spec.deadline is None:
            return self.rpc_timeout_s
        left = self.spec.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("the request's deadline passed")
        return min(left, self.rpc_timeout_s)

    def next_draft_call(self) -> int:
        """The number of the request's next Propose call: increasing over
        its draft sessions, so that a speculative call the loop abandoned
        cannot take a session from a later call if it reaches the draft after
        it (`ProposeRequest.call_number`)."""
        self._draft_calls += 1
        return self._draft_calls

    @property
    def packed_q(self) -> bool:
        """Whether the draft is to send its q's packed (`ProposeRequest.packed_q`):
        the request samples, and its target reads packed q's."""
        info = self.target.info
        return not self.spec.greedy and info is not None and info.reads_packed_q

    def client_span(self, name: str, peer: str, attributes: dict | None = None):
        return self.telemetry.span(name, {A_PEER: peer, **(attributes or {})}, kind=SpanKind.CLIENT)

    def account(self, cost: CallCost, service: str, method: str, round_trip: bool = True) -> None:
        """Count a downstream call in the request's statistics and metrics."""
        self.stats.round_trips += round_trip
        self.stats.wire_bytes += cost.wire_bytes
        self.telemetry.metrics.record_rpc(service, method, cost.seconds)

    # ------------------------------------------------------------ opening

    def _open_request(self) -> object:
        """An open on the whole history (a re-open, after a failure, or a
        draft opened late, carries the tokens emitted so far) asking for the
        tokens the request may still emit: prompt + max_tokens in all, as the
        first open asked. Asking for the whole `max_tokens` again would be
        refused near the context limit (history + max_tokens > max_context)."""
        left = max(1, self.spec.max_tokens - self.stats.completion_tokens)
        return open_request(self.history, self.spec.temperature, self.spec.top_k, self.spec.top_p,
                            self.spec.seed, left, self.spec.request_id)

    async def open_target(self) -> None:
        with self.client_span(SPAN_SESSION_OPEN, "target"):
            try:
                self.target_id, cost = await self._open_on(self.target, self._open_request(), self.timeout())
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc, "target") from None
        self.account(cost, "target", "OpenSession")
        self.target_prefix = len(self.history)

    async def open_draft(self) -> None:
        """(Re)open the draft session on the full history; on failure stay
        in fallback and retry later."""
        if self.draft is None:
            return
        await self._move_draft()
        with self.client_span(SPAN_SESSION_OPEN, "draft") as span:
            try:
                self.draft_id, cost = await self._open_on(self.draft, self._open_request(), self.timeout())
            except grpc.aio.AioRpcError as exc:
                failed(span, exc)
                self.draft_failed(exc)
                return
            except DeadlineExceeded:  # the request is out of time: its next call ends it
                self._draft_down_since = time.monotonic()
                return
        self.account(cost, "draft", "OpenSession")
        self.draft_prefix = len(self.history)
        self._draft_down_since = None
        if self._draft_replica is not None and self._draft_replica.failures:
            self._draft_pool.mark_up(self._draft_replica)

    async def _move_draft(self) -> None:
        """Before a draft re-open (the request's draft failed): where its
        replica has not answered since it was marked down, and the pool has
        another up, move the request there (the one `acquire` would give a
        new request; its count in the pool moves too), so that the open
        prefills the history on a live replica. Otherwise the open tries the
        same replica again. The session on the failed replica was closed, in
        the background, when its call failed (`draft_failed`). A first open
        stays where `acquire` put the request: a replica whose down window
        ended gets its one more try there."""
        failed = self._draft_replica
        if failed is None or self.draft_id is not None or self._draft_down_since is None:
            return
        moved = self._draft_pool.move_from(failed)
        if moved is None:
            return
        # The request's before anything is awaited: a request cancelled from
        # here on lets go of `moved`, and `failed` is let go of here.
        self._draft_replica, self.draft, self.draft_prefix = moved, moved.client, 0
        log.info("draft replica %s failed; the request moves to %s", failed.address, moved.address)
        await self._draft_pool.release(failed)

    async def open_draft_if_due(self) -> None:
        """Open the draft session where there is none: at once if it was
        never opened (the request began decoding plainly), and `draft_retry_s`
        after a failure."""
        if self.spec.speculate and self.draft_id is None:
            if self._draft_down_since is None or time.monotonic() - self._draft_down_since >= self.draft_retry_s:
                start = time.perf_counter()
                await self.open_draft()
                self.stats.prefill_time_s += time.perf_counter() - start

    async def _open_on(self, client, request, timeout: float) -> tuple[str, CallCost]:
        """client.open, whose session is never lost (`open_to_its_end`): the
        request waits for it at most `timeout`; a session opened for a
        request already gone is closed."""
        return await open_to_its_end(client, request, self.rpc_timeout_s, timeout, self.close_later)

    # ------------------------------------------------------------ failures

    async def recover_target(self, cause: Unavailable) -> None:
        """Re-open the target session on a live replica with the whole
        history (see orchestrator/recovery.py); raise `cause` without a lease
        or after MAX_TARGET_RECOVERIES."""
        if self.lease is None or self.stats.target_recoveries >= MAX_TARGET_RECOVERIES:
            raise cause
        if self.target_id is not None:
            # Closed now, whether the re-open succeeds or not: if its replica
            # still lives (a Verify past its timeout, a broken lane), the
            # session must not hold its KV slot until it expires.
            self.close_later(self.target, self.target_id)
            self.target_id = None
        with self.telemetry.span(SPAN_TARGET_RECOVER, {A_FAILED_REPLICA: self.lease.replica.address}) as span:
            start = time.perf_counter()
            try:
                session, cost = await self.lease.reopen(self._open_request(), self.spec.deadline, cause, self._open_on)
                # The new session is the request's before anything else is
                # awaited: a request cancelled from here on closes it.
                self.target, self.batcher = self.lease.client, self.lease.batcher
                self.target_id, self.target_prefix = session, len(self.history)
                self.account(cost, "target", "OpenSession")
                self.stats.target_recoveries += 1
                await self.lease.settle_move()
            finally:
                self.stats.prefill_time_s += time.perf_counter() - start
            span.set_attribute(A_RECOVERED_ON, self.lease.replica.address)

    def draft_failed(self, exc: grpc.aio.AioRpcError) -> None:
        """A draft call failed: close its session and decode with the target
        alone until the re-open is due."""
        if exc.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED) and self._out_of_time():
            log.info("the request's own deadline passed while drafting (%s)", exc.code().name)
        else:
            log.warning("draft unavailable (%s: %s); decoding with the target alone", exc.code().name, exc.details())
        if exc.code() == grpc.StatusCode.UNAVAILABLE and self._draft_replica is not None:
            self._draft_pool.mark_down(self._draft_replica, f"{exc.code().name}: {exc.details()}")
        if self.draft_id is not None:
            self.close_later(self.draft, self.draft_id)
        self.draft_id = None
        self._draft_down_since = time.monotonic()

    def _out_of_time(self) -> bool:
        return self.spec.deadline is not None and time.monotonic() >= self.spec.deadline - 0.05

    # ------------------------------------------------------------ closing

    def close(self) -> None:
        """Close both sessions in the background: safe to call from a
        cancelled request, returns at once."""
        if self.target_id is not None:
            self.close_later(self.target, self.target_id)
            self.target_id = None
        if self.draft_id is not None:
            self.close_later(self.draft, self.draft_id)
            self.draft_id = None

    def close_later(self, client, session_id: str) -> None:
        self.stats.round_trips += 1

        async def close():
            with self.client_span(SPAN_SESSION_CLOSE, client.name) as span:
                # Once more, with a longer deadline, when the service was too
                # busy to answer in time (closing twice is harmless): a session
                # left open holds its KV slot until it expires.
                for attempt, timeout in enumerate(CLOSE_TIMEOUTS_S):
                    try:
                        await client.close(session_id, timeout)
                        return
                    except grpc.aio.AioRpcError as exc:
                        retry = exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
                        if not retry or attempt == len(CLOSE_TIMEOUTS_S) - 1:
                            failed(span, exc)
                            log.info("closing %s session failed: %s", client.name, exc.code().name)
                            return

        asyncio.ensure_future(close())  # a task inherits the current trace context


def failed(span, exc: grpc.aio.AioRpcError) -> None:
    """Mark a span whose call failed but whose error the loop absorbs."""
    span.set_status(Status(StatusCode.ERROR, f"{exc.code().name}: {exc.details()}"))
