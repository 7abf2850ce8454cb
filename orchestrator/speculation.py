"""One request's speculative loop: propose, verify (batched), accept, repeat.

Per round, with lookahead k chosen by the request's γ policy:
  1. the draft proposes x_1..x_k (with their sparse q, unless greedy);
  2. the target scores them in the request's slot of a batched Verify;
  3. the orchestrator decides acceptance (`specdec.sampling.rejection`);
  4. both services are cut back to the accepted prefix by the keep_length
     riding on the NEXT call: no rollback round trip.

Bookkeeping: `history` is prompt + emitted tokens. For each service we track
the length of the prefix its context shares with `history`; each call sends
keep_length = that prefix and appends the rest of `history`.

If the draft fails, the round decodes plainly (a Verify with k = 0 draws the
same token a plain decode would) and the draft is re-opened on the full
history after `draft_retry_s`. Output stays exact either way.

Tracing (the span tree is in docs/observability.md): each round is a `round`
span holding `draft.propose`, `target.verify` and `accept`; session opens and
closes are `session.open` / `session.close`. No span is open across a `yield`
of `run()`, whose consumer may stop iterating at any point.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from orchestrator.batcher import VerifyBatcher
from orchestrator.downstream import CallCost, DraftClient, TargetClient, open_request
from orchestrator.gamma_policy import GammaPolicy, RoundObservation
from specdec.errors import DeadlineExceeded, NotFound, SpecdecError
from specdec.grpc_errors import from_rpc_error
from specdec.sampling.rejection import RoundResult, VerifyOutcome, accept_greedy, accept_sampled
from specdec.sampling.sparse import SparseDist
from specdec.telemetry import (A_ACCEPTED, A_BATCH_ITEMS, A_BATCH_SESSIONS, A_EMITTED, A_FALLBACK, A_K, A_PEER,
                               A_RETURNED, A_ROUND, NOOP, SPAN_ACCEPT, SPAN_DRAFT_PROPOSE, SPAN_ROUND,
                               SPAN_SESSION_CLOSE, SPAN_SESSION_OPEN, SPAN_TARGET_VERIFY, Telemetry)
from specdec.v1 import target_pb2

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class RequestSpec:
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    eos_ids: frozenset[int]
    speculate: bool
    request_id: str = ""
    # time.monotonic() by which the request must end; None: no deadline.
    deadline: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestStats:
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    completion_tokens: int = 0
    fallback_rounds: int = 0
    k_histogram: list[int] = field(default_factory=list)  # rounds per k used
    accepted_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    target_compute_s: float = 0.0
    wire_bytes: int = 0
    batch_sizes: list[int] = field(default_factory=list)

    def record_round(self, k: int, accepted: int) -> None:
        self.rounds += 1
        self.proposed += k
        self.accepted += accepted
        _bump(self.k_histogram, k)
        for i in range(accepted):
            _bump(self.accepted_per_position, i)


def _bump(counts: list[int], index: int) -> None:
    if len(counts) <= index:
        counts.extend([0] * (index + 1 - len(counts)))
    counts[index] += 1


@dataclass(frozen=True)
class LoopSettings:
    rpc_timeout_s: float = 60.0
    draft_retry_s: float = 2.0
    max_context: int = 4096  # the smaller of the two services' limits
    max_draft_tokens: int = 16  # the smaller of the two services' limits


class SpeculativeRequest:
    """Runs one request; `run()` yields the tokens each round emits."""

    def __init__(self, spec: RequestSpec, policy: GammaPolicy, target: TargetClient,
                 batcher: VerifyBatcher, draft: DraftClient | None, settings: LoopSettings,
                 telemetry: Telemetry = NOOP):
        self.spec = spec
        self.telemetry = telemetry
        self.policy = policy
        self.target = target
        self.batcher = batcher
        self.draft = draft
        self.settings = settings
        self.stats = RequestStats()
        self.finish_reason = "length"
        self.history = list(spec.prompt)
        self._target_session: str | None = None
        self._target_prefix = 0
        self._draft_session: str | None = None
        self._draft_prefix = 0
        self._draft_down_since: float | None = None

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
                self._target_session, cost = await self.target.open(self._open_request(), self._timeout())
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
                self._draft_session, cost = await self.draft.open(self._open_request(), self._timeout())
            except grpc.aio.AioRpcError as exc:
                _failed(span, exc)
                self._draft_failed(exc)
                return
        self._account(cost, "draft", "OpenSession")
        self._draft_prefix = len(self.history)
        self._draft_down_since = None

    def _draft_failed(self, exc: grpc.aio.AioRpcError) -> None:
        log.warning("draft unavailable (%s: %s); decoding with the target alone", exc.code().name, exc.details())
        if self._draft_session is not None:
            self._close_later(self.draft, self._draft_session)
        self._draft_session = None
        self._draft_down_since = time.monotonic()

    def close(self) -> None:
        """Close both sessions in the background: safe to call from a
        cancelled request, returns at once."""
        if self._target_session is not None:
            self._close_later(self.target, self._target_session)
            self._target_session = None
        if self._draft_session is not None:
            self._close_later(self.draft, self._draft_session)
            self._draft_session = None

    def _close_later(self, client, session_id: str) -> None:
        async def close():
            with self._client_span(SPAN_SESSION_CLOSE, client.name) as span:
                try:
                    await client.close(session_id, CLOSE_TIMEOUT_S)
                except grpc.aio.AioRpcError as exc:
                    _failed(span, exc)
                    log.info("closing %s session failed: %s", client.name, exc.code().name)

        asyncio.ensure_future(close())  # a task inherits the current trace context

    def _account(self, cost: CallCost, service: str, method: str) -> None:
        self.stats.wire_bytes += cost.wire_bytes
        self.telemetry.metrics.record_rpc(service, method, cost.seconds)

    # ----------------------------------------------------------------- loop

    async def run(self) -> AsyncIterator[list[int]]:
        await self._open_target()
        if self.spec.speculate:
            await self._open_draft()
        while self.stats.completion_tokens < self.spec.max_tokens:
            emitted = await self._round()
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
            drafts, draft_time = await self._propose(k)
            reply = await self._verify(drafts)
            with self.telemetry.span(SPAN_ACCEPT) as accept_span:
                result = self._accept(drafts, reply.result)
                accept_span.set_attribute(A_ACCEPTED, result.num_accepted)
            self._advance_prefixes(len(drafts), result.num_accepted)
            self._observe(k, len(drafts), result.num_accepted, draft_time, reply)
            span.set_attributes({A_K: k, A_RETURNED: len(drafts), A_ACCEPTED: result.num_accepted,
                                 A_EMITTED: len(result.emitted_ids),
                                 A_FALLBACK: self.stats.fallback_rounds > fallbacks})
        return result.emitted_ids

    async def _reopen_draft_if_due(self) -> None:
        if self.spec.speculate and self._draft_session is None:
            if self._draft_down_since is None or time.monotonic() - self._draft_down_since >= self.settings.draft_retry_s:
                await self._open_draft()

    async def _propose(self, k: int) -> tuple[list, float]:
        if k == 0:
            if self.spec.speculate:
                self.stats.fallback_rounds += self._draft_session is None
            return [], 0.0
        keep = self._draft_prefix
        with self._client_span(SPAN_DRAFT_PROPOSE, "draft", {A_K: k}) as span:
            try:
                drafts, cost = await self.draft.propose(self._draft_session, keep, self.history[keep:], k,
                                                        self._timeout())
            except grpc.aio.AioRpcError as exc:
                _failed(span, exc)
                self._draft_failed(exc)
                self.stats.fallback_rounds += 1
                return [], 0.0
            span.set_attribute(A_RETURNED, len(drafts))
        self._account(cost, "draft", "Propose")
        self.stats.draft_time_s += cost.seconds
        self._draft_prefix = len(self.history)  # the draft now holds history + drafts
        return drafts, cost.seconds

    async def _verify(self, drafts: list):
        keep = self._target_prefix
        item = target_pb2.VerifyItem(
            session_id=self._target_session, keep_length=keep, append_token_ids=self.history[keep:],
            draft_token_ids=[d.token_id for d in drafts],
        )
        if not self.spec.greedy:
            item.draft_q.extend(d.q for d in drafts)
        with self.telemetry.span(SPAN_TARGET_VERIFY, {A_K: len(drafts)}) as span:
            try:
                reply = await asyncio.wait_for(self.batcher.verify(item), self._timeout())
            except asyncio.TimeoutError:
                raise DeadlineExceeded("the request's deadline passed while verifying") from None
            except NotFound as exc:
                raise SpecdecError(str(exc)) from None
            span.set_attributes({A_BATCH_ITEMS: reply.items, A_BATCH_SESSIONS: reply.batch_size})
        self._target_prefix = len(self.history)
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
        q_of_x = [SparseDist.from_lists(d.q.token_ids, d.q.probs).prob(d.token_id) for d in drafts]
        return accept_sampled(ids, q_of_x, outcome, self.spec.seed, first_position=len(self.history))

    def _advance_prefixes(self, k: int, accepted: int) -> None:
        # Both services hold history + the k drafts; they share history + the
        # accepted drafts with what comes next.
        shared = len(self.history) + accepted
        self._target_prefix = shared
        if k:
            self._draft_prefix = shared

    def _observe(self, k_chosen: int, k: int, accepted: int, draft_time: float, reply) -> None:
        self.stats.record_round(k, accepted)
        if self.spec.speculate:
            self.telemetry.metrics.record_round(k_chosen, k, accepted)
        self.policy.observe(RoundObservation(
            k=k, accepted=accepted, draft_time_s=draft_time, verify_time_s=reply.rtt_s,
            verify_compute_s=reply.compute_s, batch_size=max(1, reply.batch_size),
            draft_rtt_s=0.0, target_rtt_s=max(0.0, reply.rtt_s - reply.compute_s),
        ))


def _failed(span, exc: grpc.aio.AioRpcError) -> None:
    """Mark a span whose call failed but whose error the loop absorbs."""
    span.set_status(Status(StatusCode.ERROR, f"{exc.code().name}: {exc.details()}"))
