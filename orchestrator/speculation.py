"""One request's speculative loop: propose, verify (batched), accept, repeat.

Per round, with k = num_draft_tokens chosen by the request's policy:
  1. the draft proposes x_1..x_k (with their sparse q, unless greedy);
  2. the target scores them in the request's slot of a batched Verify;
  3. the orchestrator decides acceptance (`specdec.sampling.rejection`);
  4. both services are cut back to the accepted prefix by the keep_length
     riding on the NEXT call: no rollback round trip.

Bookkeeping: `history` is prompt + emitted tokens. For each service we track
the length of the prefix its context shares with `history`; each call sends
keep_length = that prefix and appends the rest of `history`.

Pipelined drafting (`RequestSpec.pipeline`): while the target verifies round
r, the draft already proposes round r+1 as if round r will be fully accepted;
`orchestrator/pipelining.py` holds it and the decision whether it pays.

If the draft fails, the round decodes plainly (a Verify with k = 0 draws the
same token a plain decode would) and the draft is re-opened on the full
history after `draft_retry_s`. Output stays exact either way. If the target
fails (UNAVAILABLE, or it lost the session), `orchestrator/recovery.py`
re-opens the session on a live replica by prefilling the history, and the
round runs again.

Tracing (the span tree is in docs/observability.md): each round is a `round`
span holding `draft.propose`, `target.verify` and `accept`; session opens and
closes are `session.open` / `session.close`. No span is open across a `yield`
of `run()`, whose consumer may stop iterating at any point.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from orchestrator.batcher import VerifyBatcher
from orchestrator.downstream import CallCost, DraftClient, TargetClient, open_request
from orchestrator.gamma_policy import GammaPolicy, RoundObservation, acceptance_estimate, round_observation
from orchestrator.pipelining import AheadDecision, Pipeline, draft_ahead_length
from orchestrator.request_stats import RequestSpec, RequestStats
from specdec.errors import DeadlineExceeded, NotFound, Unavailable
from specdec.limits import DEFAULT_MAX_DRAFT_TOKENS
from specdec.rpc.grpc_errors import from_rpc_error
from specdec.sampling.rejection import RoundResult, VerifyOutcome, accept_greedy, accept_sampled
from specdec.sampling.sparse import prob_of
from specdec.telemetry import (A_ACCEPTED, A_BATCH_ITEMS, A_BATCH_SESSIONS, A_EMITTED, A_FALLBACK, A_K, A_PEER,
                               A_FAILED_REPLICA, A_RECOVERED_ON, A_RETURNED, A_ROUND, NOOP, SPAN_ACCEPT,
                               SPAN_DRAFT_PROPOSE, SPAN_ROUND, SPAN_SESSION_CLOSE, SPAN_SESSION_OPEN,
                               SPAN_TARGET_RECOVER, SPAN_TARGET_VERIFY, Telemetry)
from specdec.v1 import target_pb2

log = logging.getLogger(__name__)

CLOSE_TIMEOUTS_S = (5.0, 30.0)  # a close's deadline, and its retry's
# A target that fails again after each re-open is not coming back for this request.
MAX_TARGET_RECOVERIES = 8


@dataclass(frozen=True)
class LoopSettings:
    rpc_timeout_s: float = 60.0
    draft_retry_s: float = 2.0
    max_context: int = 4096  # the smaller of the two services' limits
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS  # the smallest of the orchestrator's and the services' limits
    pipeline_call_cost_s: float = 0.002  # what one more speculative Propose costs, for the pipelining decision
    pipeline_always: bool = False  # draft ahead every round, without weighing it


class SpeculativeRequest:
    """Runs one request; `run()` yields the tokens each round emits."""

    def __init__(self, spec: RequestSpec, policy: GammaPolicy, target: TargetClient,
                 batcher: VerifyBatcher, draft: DraftClient | None, settings: LoopSettings,
                 telemetry: Telemetry = NOOP, lease=None):
        self.spec = spec
        self.telemetry = telemetry
        self.policy = policy
        self.target = target
        self.batcher = batcher
        self.draft = draft
        self.settings = settings
        self.lease = lease  # orchestrator.recovery.TargetLease: re-opens a failed target session; None: fail
        self.stats = RequestStats()
        self.finish_reason = "length"
        self.history = list(spec.prompt)
        self._target_session: str | None = None
        self._target_prefix = 0
        self._draft_session: str | None = None
        self._draft_prefix = 0
        self._draft_down_since: float | None = None
        self._pipeline = Pipeline(draft)
        self._ahead_decision = AheadDecision(settings.pipeline_call_cost_s, settings.pipeline_always)
        self._last_obs: RoundObservation | None = None  # the last speculative round
        self._last_round_end: float | None = None  # when the previous round was observed

    # ------------------------------------------------------------ lifecycle

    def _timeout(self) -> float:
        if self.spec.deadline is None:
            return self.settings.rpc_timeout_s
        left = self.spec.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("the request's deadline passed")
        return min(left, self.settings.rpc_timeout_s)

    def _open_request(self) -> object:
        return open_request(self.history, self.spec.temperature, self.spec.top_k, self.spec.top_p,
                            self.spec.seed, self.spec.max_tokens, self.spec.request_id)

    def _client_span(self, name: str, peer: str, attributes: dict | None = None):
        return self.telemetry.span(name, {A_PEER: peer, **(attributes or {})}, kind=SpanKind.CLIENT)

    async def _open_target(self) -> None:
        with self._client_span(SPAN_SESSION_OPEN, "target"):
            try:
                self._target_session, cost = await self._open_on(self.target, self._open_request(), self._timeout())
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc, "target") from None
        self._account(cost, "target", "OpenSession")
        self._target_prefix = len(self.history)

    async def _open_draft(self) -> None:
        """(Re)open the draft session on the full history; on failure stay
        in fallback and retry later."""
        if self.draft is None:
            return
        with self._client_span(SPAN_SESSION_OPEN, "draft") as span:
            try:
                self._draft_session, cost = await self._open_on(self.draft, self._open_request(), self._timeout())
            except grpc.aio.AioRpcError as exc:
                _failed(span, exc)
                self._draft_failed(exc)
                return
            except DeadlineExceeded:  # the request is out of time: its next call ends it
                self._draft_down_since = time.monotonic()
                return
        self._account(cost, "draft", "OpenSession")
        self._draft_prefix = len(self.history)
        self._draft_down_since = None

    async def _open_on(self, client, request, timeout: float) -> tuple[str, CallCost]:
        """client.open, whose session is never lost: the call itself runs
        under rpc_timeout_s and to its end, while the request waits for it at
        most `timeout` (DeadlineExceeded) or until it is cancelled. A call
        bound by the request's own deadline could end DEADLINE_EXCEEDED here
        while the service, which answered in time, kept the session; and a
        cancel landing as the reply arrives would drop its id. A session
        opened for a request already gone is closed."""
        opening = asyncio.ensure_future(client.open(request, self.settings.rpc_timeout_s))

        def close_orphan(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                self._close_later(client, done.result()[0])

        try:
            return await asyncio.wait_for(asyncio.shield(opening), timeout)
        except asyncio.TimeoutError:
            opening.add_done_callback(close_orphan)
            raise DeadlineExceeded(f"the request's deadline passed while opening the {client.name} session") from None
        except asyncio.CancelledError:
            opening.add_done_callback(close_orphan)
            raise

    async def _recover_target(self, cause: Unavailable) -> None:
        """Re-open the target session on a live replica with the whole
        history (see orchestrator/recovery.py); raise `cause` without a lease."""
        if self.lease is None or self.stats.target_recoveries >= MAX_TARGET_RECOVERIES:
            raise cause
        self._pipeline.drop()
        old_client, old_session = self.target, self._target_session
        with self.telemetry.span(SPAN_TARGET_RECOVER, {A_FAILED_REPLICA: self.lease.replica.address}) as span:
            self._target_session = None
            start = time.perf_counter()
            try:
                session, cost = await self.lease.reopen(self._open_request(), self.spec.deadline, cause)
            finally:
                self.stats.prefill_time_s += time.perf_counter() - start
            span.set_attribute(A_RECOVERED_ON, self.lease.replica.address)
        if old_session is not None:  # if its replica still lives, the session must not wait for expiry
            self._close_later(old_client, old_session)
        self.target, self.batcher = self.lease.client, self.lease.batcher
        self._target_session, self._target_prefix = session, len(self.history)
        self._account(cost, "target", "OpenSession")
        self.stats.target_recoveries += 1

    def _draft_failed(self, exc: grpc.aio.AioRpcError) -> None:
        if exc.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED) and self._out_of_time():
            log.info("the request's own deadline passed while drafting (%s)", exc.code().name)
        else:
            log.warning("draft unavailable (%s: %s); decoding with the target alone", exc.code().name, exc.details())
        if self._draft_session is not None:
            self._close_later(self.draft, self._draft_session)
        self._draft_session = None
        self._draft_down_since = time.monotonic()

    def _out_of_time(self) -> bool:
        return self.spec.deadline is not None and time.monotonic() >= self.spec.deadline - 0.05

    def close(self) -> None:
        """Close both sessions in the background: safe to call from a
        cancelled request, returns at once."""
        self._pipeline.drop()
        if self._target_session is not None:
            self._close_later(self.target, self._target_session)
            self._target_session = None
        if self._draft_session is not None:
            self._close_later(self.draft, self._draft_session)
            self._draft_session = None

    def _close_later(self, client, session_id: str) -> None:
        self.stats.round_trips += 1

        async def close():
            with self._client_span(SPAN_SESSION_CLOSE, client.name) as span:
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
                            _failed(span, exc)
                            log.info("closing %s session failed: %s", client.name, exc.code().name)
                            return

        asyncio.ensure_future(close())  # a task inherits the current trace context

    def _account(self, cost: CallCost, service: str, method: str, round_trip: bool = True) -> None:
        self.stats.round_trips += round_trip
        self.stats.wire_bytes += cost.wire_bytes
        self.telemetry.metrics.record_rpc(service, method, cost.seconds)

    # ----------------------------------------------------------------- loop

    async def run(self) -> AsyncIterator[list[int]]:
        # Both prefills at once: the time to first token pays the slower one,
        # not their sum. A draft failure is absorbed by _open_draft; a target
        # failure is raised once both calls have ended, so close() sees every
        # session that was opened.
        opens = [self._open_target()] + ([self._open_draft()] if self.spec.speculate else [])
        start = time.perf_counter()
        outcomes = await asyncio.gather(*opens, return_exceptions=True)
        self.stats.prefill_time_s += time.perf_counter() - start
        for outcome in outcomes:
            if isinstance(outcome, Unavailable):
                await self._recover_target(outcome)
            elif isinstance(outcome, BaseException):
                raise outcome
        while self.stats.completion_tokens < self.spec.max_tokens:
            try:
                emitted = await self._round()
            except Unavailable as exc:  # only the target's failures reach here: the draft's are absorbed
                await self._recover_target(exc)
                continue
            emitted = self._finish_at_eos(emitted)
            self.history.extend(emitted)
            self.stats.completion_tokens += len(emitted)
            if emitted:
                yield emitted
            if self.finish_reason == "eos":
                return

    def _finish_at_eos(self, emitted: list[int]) -> list[int]:
        for i, token in enumerate(emitted):
            if token in self.spec.eos_ids:
                self.finish_reason = "eos"
                return emitted[:i]
        return emitted

    def _choose_k(self) -> int:
        remaining = self.spec.max_tokens - self.stats.completion_tokens
        room = self.settings.max_context - len(self.history) - 1
        return max(0, min(self.policy.next_k(), remaining - 1, room, self.settings.max_draft_tokens))

    async def _round(self) -> list[int]:
        with self.telemetry.span(SPAN_ROUND, {A_ROUND: self.stats.rounds}) as span:
            await self._reopen_draft_if_due()
            fallbacks = self.stats.fallback_rounds
            k = self._choose_k() if self._draft_session is not None else 0
            drafts = self._pipeline.take(k)
            if drafts is not None:  # made during the previous round; their time was counted then
                self.stats.pipelined_rounds += 1
                draft_time, draft_compute = 0.0, 0.0
            else:
                drafts, draft_time, draft_compute = await self._propose(k)
            self._draft_ahead(drafts)
            overlapped = self._pipeline.in_flight
            try:
                reply = await self._verify(drafts)
            except BaseException:
                self._pipeline.drop()
                raise
            if self.spec.pipeline and drafts:
                self._ahead_decision.observe_verify(overlapped, reply.compute_s / max(1, reply.items))
            with self.telemetry.span(SPAN_ACCEPT) as accept_span:
                result = self._accept(drafts, reply.result)
                accept_span.set_attribute(A_ACCEPTED, result.num_accepted)
            self._advance_prefixes(len(drafts), result.num_accepted)
            await self._settle_ahead(len(drafts), result)
            self._observe(k, len(drafts), result.num_accepted, draft_time, draft_compute, reply)
            span.set_attributes({A_K: k, A_RETURNED: len(drafts), A_ACCEPTED: result.num_accepted,
                                 A_EMITTED: len(result.emitted_ids),
                                 A_FALLBACK: self.stats.fallback_rounds > fallbacks})
        return result.emitted_ids

    async def _reopen_draft_if_due(self) -> None:
        if self.spec.speculate and self._draft_session is None:
            if self._draft_down_since is None or time.monotonic() - self._draft_down_since >= self.settings.draft_retry_s:
                start = time.perf_counter()
                await self._open_draft()
                self.stats.prefill_time_s += time.perf_counter() - start

    async def _propose(self, k: int) -> tuple[list, float, float]:
        """(drafts, wall seconds, draft compute seconds)"""
        if k == 0:
            if self.spec.speculate:
                self.stats.fallback_rounds += self._draft_session is None
            return [], 0.0, 0.0
        keep = self._draft_prefix
        with self._client_span(SPAN_DRAFT_PROPOSE, "draft", {A_K: k}) as span:
            try:
                drafts, cost = await self.draft.propose(self._draft_session, keep, self.history[keep:], k,
                                                        self._timeout())
            except grpc.aio.AioRpcError as exc:
                _failed(span, exc)
                self._draft_failed(exc)
                self.stats.fallback_rounds += 1
                return [], 0.0, 0.0
            span.set_attribute(A_RETURNED, len(drafts))
        self._account(cost, "draft", "Propose")
        compute = _compute_s(drafts)
        self.stats.draft_time_s += cost.seconds
        self.stats.draft_compute_s += compute
        if drafts:  # the draft now holds history + drafts (with none, the cut may not have happened)
            self._draft_prefix = len(self.history)
        return drafts, cost.seconds, compute

    # ------------------------------------------------------ pipelined drafting

    def _draft_ahead(self, drafts: list) -> None:
        """Start drafting round r+1 while round r's drafts are verified, as if
        all of them will be accepted."""
        k = len(drafts)
        if not (self.spec.pipeline and k and self._draft_session is not None):
            return
        if any(d.token_id in self.spec.eos_ids for d in drafts):
            return  # a full acceptance would end the request
        # After a full acceptance: history + k drafts + the bonus token.
        k_next = draft_ahead_length(
            self.policy, k, tokens_left=self.spec.max_tokens - self.stats.completion_tokens - (k + 1),
            context_left=self.settings.max_context - (len(self.history) + k + 1) - 1,
            max_draft_tokens=self.settings.max_draft_tokens)
        if k_next < 1:
            return
        acceptance = acceptance_estimate(self.stats.accepted, self.stats.rejected_rounds)
        if not self._ahead_decision.worth_drafting_ahead(k, k_next, acceptance, self._last_obs):
            return
        # The draft holds history + the k drafts; k_next + 1 more: a guess at
        # the bonus token, then round r+1's drafts.
        self.stats.round_trips += 1
        self._pipeline.start(self._draft_session, len(self.history) + k, k_next, self._timeout())

    async def _settle_ahead(self, k: int, result: RoundResult) -> None:
        """Account for the speculative Propose of round r (k drafts) and, when
        its drafts are round r+1's, note what the draft now holds."""
        bonus = result.emitted_ids[-1] if result.emitted_ids else None
        settled = await self._pipeline.settle(k, result.num_accepted, bonus, self.spec.eos_ids)
        if settled.cost is not None:
            self._ahead_decision.observe_wait(settled.waited_s)
            self._account(settled.cost, "draft", "Propose", round_trip=False)  # counted when it was sent
            self.stats.draft_compute_s += _compute_s(settled.drafts)
            self.stats.draft_time_s += settled.waited_s
        if settled.kept:
            # The draft holds history + k drafts + the bonus + the drafts kept.
            self._draft_prefix = len(self.history) + k + 1

    async def _verify(self, drafts: list):
        keep = self._target_prefix
        item = target_pb2.VerifyItem(
            session_id=self._target_session, keep_length=keep, append_token_ids=self.history[keep:],
            draft_token_ids=[d.token_id for d in drafts],
        )
        if not self.spec.greedy:
            item.draft_q.extend(d.q for d in drafts)
        with self.telemetry.span(SPAN_TARGET_VERIFY, {A_K: len(drafts)}) as span:
            timeout = self._timeout()  # first: a passed deadline must not leave the verify coroutine unawaited
            try:
                reply = await asyncio.wait_for(self.batcher.verify(item), timeout)
            except asyncio.TimeoutError:
                raise DeadlineExceeded("the request's deadline passed while verifying") from None
            except NotFound as exc:  # the target restarted and forgot the session
                raise Unavailable(f"the target lost the session: {exc}") from None
            span.set_attributes({A_BATCH_ITEMS: reply.items, A_BATCH_SESSIONS: reply.batch_size})
        self._target_prefix = len(self.history)
        self.stats.round_trips += 1
        self.stats.wire_bytes += reply.wire_bytes
        self.stats.verify_time_s += reply.rtt_s
        self.stats.target_compute_s += reply.compute_s
        self.stats.batch_sizes.append(reply.batch_size)
        return reply

    def _accept(self, drafts: list, result: target_pb2.VerifyResult) -> RoundResult:
        ids = [d.token_id for d in drafts]
        if self.spec.greedy:
            return accept_greedy(ids, list(result.argmax_token_ids))
        outcome = VerifyOutcome(target_probs=list(result.target_probs),
                                recovery_ids=list(result.recovery_token_ids), bonus_id=result.bonus_token_id)
        q_of_x = [prob_of(d.q.token_ids, d.q.probs, d.token_id) for d in drafts]
        return accept_sampled(ids, q_of_x, outcome, self.spec.seed, first_position=len(self.history))

    def _advance_prefixes(self, k: int, accepted: int) -> None:
        # Both services hold history + the k drafts; they share history + the
        # accepted drafts with what comes next.
        shared = len(self.history) + accepted
        self._target_prefix = shared
        if k:
            self._draft_prefix = shared

    def _observe(self, k_chosen: int, k: int, accepted: int, draft_time: float, draft_compute: float,
                 reply) -> None:
        self.stats.record_round(k, accepted)
        if self.spec.speculate:
            self.telemetry.metrics.record_round(k_chosen, k, accepted)
        # The whole cycle since the previous round was observed (its tokens
        # streamed to the client included), less the two calls.
        now = time.perf_counter()
        cycle = now - self._last_round_end if self._last_round_end is not None else 0.0
        self._last_round_end = now
        obs = round_observation(k, accepted, draft_time, draft_compute, reply.rtt_s, reply.compute_s,
                                reply.batch_size, cycle, self._last_obs)
        self.policy.observe(obs)
        if k:
            self._last_obs = obs


def _compute_s(drafts: list) -> float:
    return sum(d.compute_micros for d in drafts) / 1e6


def _failed(span, exc: grpc.aio.AioRpcError) -> None:
    """Mark a span whose call failed but whose error the loop absorbs."""
    span.set_status(Status(StatusCode.ERROR, f"{exc.code().name}: {exc.details()}"))
