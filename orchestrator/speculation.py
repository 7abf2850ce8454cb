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

Pipelined drafting (`RequestSpec.pipeline`, after PEARL / AMUSD): while the
target verifies round r's k drafts, the draft already proposes m = k' + 1 more
tokens, as if all k were accepted (k' being the k the policy would choose after
a full acceptance). When round r is fully accepted and the target's bonus token
equals the first of them, the other k' are round r+1's drafts, already made:
round r+1 sends no Propose. Otherwise the speculative work is dropped (the
stream is cancelled; the draft is cut back by the keep_length riding on its
next call). Exactness does not depend on it: round r is decided as without
pipelining, and round r+1's drafts are drafts from the same context. Greedy
output is identical with or without it; sampled output has the same
distribution, and for a seed the same tokens whenever the rounds' k are the
same (a model drafter's drafts are keyed by (seed, position); k drafted ahead
is capped at the services' max_draft_tokens - 1, and a prompt-lookup drafter's
continuation can differ). The win is the draft
time of the rounds that follow a full acceptance, hidden behind verification.

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
from orchestrator.gamma_policy import (GammaPolicy, RoundObservation, acceptance_estimate, ewma,
                                       k_after_full_acceptance)
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
OVERLAP_WEIGHT = 0.3  # EWMA weight of the newest round in the pipelining decision's measurements


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
    pipeline: bool = False  # pipelined drafting (see the module docstring)
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
    draft_time_s: float = 0.0  # time the request waited for drafts
    draft_compute_s: float = 0.0  # draft forward time the draft service reported (speculative drafting included)
    verify_time_s: float = 0.0
    target_compute_s: float = 0.0
    wire_bytes: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    round_trips: int = 0  # downstream RPCs: opens, proposes, verifies, closes
    pipelined_rounds: int = 0  # rounds whose drafts were made during the previous round's verify

    rejected_rounds: int = 0  # speculative rounds that ended in a rejection
    # speculative rounds (k > 0) by drafts accepted: [j] = rounds that accepted exactly j
    acceptance_histogram: list[int] = field(default_factory=list)
    k_per_round: list[int] = field(default_factory=list)  # drafts verified in each round, in order

    def record_round(self, k: int, accepted: int) -> None:
        self.rejected_rounds += accepted < k
        self.rounds += 1
        self.proposed += k
        self.accepted += accepted
        _bump(self.k_histogram, k)
        self.k_per_round.append(k)
        if k:
            _bump(self.acceptance_histogram, accepted)
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
    pipeline_call_cost_s: float = 0.002  # what one more speculative Propose costs, for the pipelining decision
    pipeline_always: bool = False  # draft ahead every round, without weighing it


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
        # Pipelined drafting: the speculative Propose in flight, and the drafts
        # it made that the next round will use.
        self._ahead: asyncio.Task | None = None
        self._next_drafts: list | None = None
        self._last_obs: RoundObservation | None = None
        # Target compute per round with and without drafting ahead during it
        # (EWMA), to see whether the two compete for the same hardware.
        self._verify_alone: float | None = None
        self._verify_overlapped: float | None = None
        self._ahead_decisions = 0
        self._ahead_wait: float | None = None  # EWMA: waiting for drafts made ahead after the verify ended
        self._ahead_first: asyncio.Future | None = None  # the first token drafted ahead (the bonus guess)
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
        self._drop_ahead()
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
                try:
                    await client.close(session_id, CLOSE_TIMEOUT_S)
                except grpc.aio.AioRpcError as exc:
                    _failed(span, exc)
                    log.info("closing %s session failed: %s", client.name, exc.code().name)

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
        for outcome in await asyncio.gather(*opens, return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome
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
            drafts, draft_time, draft_compute = self._take_next_drafts(k)
            if drafts is None:
                drafts, draft_time, draft_compute = await self._propose(k)
            self._draft_ahead(drafts)
            overlapped = self._ahead is not None
            try:
                reply = await self._verify(drafts)
            except BaseException:
                self._drop_ahead()
                raise
            if self.spec.pipeline and drafts:
                self._learn_overlap(overlapped, reply.compute_s / max(1, reply.items))
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
                await self._open_draft()

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

    def _take_next_drafts(self, k: int) -> tuple[list | None, float, float]:
        """The drafts the previous round's speculative Propose made, cut to k;
        None when there are none (or k == 0: the draft keeps them, and the next
        call's keep_length cuts them)."""
        drafts, self._next_drafts = self._next_drafts, None
        if not drafts or k == 0 or self._draft_session is None:
            return None, 0.0, 0.0
        self.stats.pipelined_rounds += 1
        return drafts[:k], 0.0, 0.0  # their time was counted when they were made

    def _draft_ahead(self, drafts: list) -> None:
        """Start drafting round r+1 while round r's drafts are verified, as if
        all of them will be accepted."""
        k = len(drafts)
        if not (self.spec.pipeline and k and self._draft_session is not None):
            return
        if any(d.token_id in self.spec.eos_ids for d in drafts):
            return  # a full acceptance would end the request
        # After a full acceptance: history + k drafts + the bonus token.
        history_after = len(self.history) + k + 1
        remaining_after = self.spec.max_tokens - self.stats.completion_tokens - (k + 1)
        room_after = self.settings.max_context - history_after - 1
        # The what-if carries counts only (no timings): the policy's copy moves
        # its acceptance estimate, not its cost model.
        what_if = RoundObservation(k=k, accepted=k, draft_time_s=0.0, verify_time_s=0.0, verify_compute_s=0.0,
                                   batch_size=1, draft_rtt_s=0.0, target_rtt_s=0.0)
        k_next = min(k_after_full_acceptance(self.policy, what_if), remaining_after - 1, room_after,
                     self.settings.max_draft_tokens - 1)
        if k_next < 1:
            return
        if not self._worth_drafting_ahead(k, k_next):
            return
        # The draft holds history + the k drafts; m = k_next + 1 more: a guess
        # at the bonus token, then round r+1's drafts.
        keep = len(self.history) + k
        self.stats.round_trips += 1
        self._ahead_first = asyncio.get_running_loop().create_future()
        self._ahead = asyncio.ensure_future(self.draft.propose(
            self._draft_session, keep, [], k_next + 1, self._timeout(), first=self._ahead_first))

    EXPLORE_EVERY = 10  # every so many decisions, take the other one to re-measure it

    def _worth_drafting_ahead(self, k: int, k_next: int) -> bool:
        """Draft ahead when the expected saving beats the expected cost:

            saving = h * max(0, rtt_draft + k_next * t_draft - wait)    h = a^(k+1), the hit chance
            cost   = call_cost + (1 - h) * min(t_draft, busy) + slowdown

        A hit saves round r+1's Propose (its round trip and drafting) less the
        time the loop still waited for the drafts made ahead once the verify
        had ended (`wait`, measured).
        Every speculative call costs `call_cost` (the CPU of one more streamed
        call on both ends, `--pipeline-call-cost-ms`); a miss may find the
        draft still drafting ahead when round r+1 needs it: `busy` = (k_next + 1)
        * t_draft - (verify time), capped at one step (the stream stops at its
        next step once cancelled); and when draft and target share hardware
        (one CPU, one GPU) drafting ahead slows the verification it overlaps:
        `slowdown` = the target's compute per round with drafting ahead minus
        without, both measured. The first round drafts ahead and the second
        does not, to measure both; after that one decision in EXPLORE_EVERY is
        reversed to keep the side not taken measured."""
        last = self._last_obs
        if self.settings.pipeline_always or last is None or last.k == 0:
            return True
        if self._verify_alone is None:
            return False
        t_draft = (last.draft_compute_s or last.draft_time_s) / last.k
        hit = acceptance_estimate(self.stats.accepted, self.stats.rejected_rounds) ** (k + 1)
        saving = hit * max(0.0, last.draft_rtt_s + k_next * t_draft - (self._ahead_wait or 0.0))
        busy = max(0.0, (k_next + 1) * t_draft - last.verify_time_s)
        slowdown = max(0.0, (self._verify_overlapped or 0.0) - self._verify_alone)
        cost = self.settings.pipeline_call_cost_s + (1 - hit) * min(t_draft, busy) + slowdown
        self._ahead_decisions += 1
        explore = self._ahead_decisions % self.EXPLORE_EVERY == 0
        return (saving > cost) != explore

    def _learn_overlap(self, overlapped: bool, compute_s: float) -> None:
        if overlapped:
            self._verify_overlapped = ewma(self._verify_overlapped, compute_s, OVERLAP_WEIGHT)
        else:
            self._verify_alone = ewma(self._verify_alone, compute_s, OVERLAP_WEIGHT)

    async def _settle_ahead(self, k: int, result: RoundResult) -> float:
        """Keep the speculative drafts if round r was fully accepted and the
        bonus token is the draft's guess; drop them otherwise. Returns the
        seconds spent waiting for them (draft time on the critical path,
        counted in the request's draft time)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return 0.0
        bonus = result.emitted_ids[-1] if result.emitted_ids else None
        if result.num_accepted < k or bonus is None or bonus in self.spec.eos_ids:
            await _cancel(ahead)
            return 0.0
        start = time.perf_counter()
        # Judge the guess as soon as its first token arrives: a wrong guess
        # drops the rest of the stream instead of waiting for it.
        await asyncio.wait({self._ahead_first, ahead}, return_when=asyncio.FIRST_COMPLETED)
        if self._ahead_first.done() and self._ahead_first.result() != bonus:
            await _cancel(ahead)
            return time.perf_counter() - start
        try:
            drafts, cost = await ahead
        except grpc.aio.AioRpcError as exc:
            # Nothing to repair: the next Propose fails the same way if the
            # draft is down, and the loop falls back then.
            log.info("speculative Propose failed: %s", exc.code().name)
            return time.perf_counter() - start
        waited = time.perf_counter() - start
        self._ahead_wait = ewma(self._ahead_wait, waited, OVERLAP_WEIGHT)
        self._account(cost, "draft", "Propose", round_trip=False)  # counted when it was sent
        self.stats.draft_compute_s += _compute_s(drafts)
        self.stats.draft_time_s += waited
        if len(drafts) >= 2 and drafts[0].token_id == result.emitted_ids[-1]:
            # The draft holds history + k drafts + the bonus + drafts[1:].
            self._next_drafts = list(drafts[1:])
            self._draft_prefix = len(self.history) + k + 1
        return waited

    def _drop_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.cancel()
            ahead.add_done_callback(_retrieve)
        self._next_drafts = None

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
        q_of_x = [SparseDist.from_lists(d.q.token_ids, d.q.probs).prob(d.token_id) for d in drafts]
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
        last = self._last_obs
        if k and draft_time == 0 and last is not None and last.k:
            # Pipelined drafts: their cost was hidden; the policy models an
            # unpipelined round, so it learns the draft's last measured costs
            # (per token, scaled to this k).
            draft_compute = (last.draft_compute_s or last.draft_time_s) / last.k * k
            draft_time = last.draft_rtt_s + draft_compute
        # The whole cycle since the previous round was observed (its tokens
        # streamed to the client included), less the two calls.
        now = time.perf_counter()
        cycle = now - self._last_round_end if self._last_round_end is not None else 0.0
        self._last_round_end = now
        obs = RoundObservation(
            k=k, accepted=accepted, draft_time_s=draft_time, verify_time_s=reply.rtt_s,
            verify_compute_s=reply.compute_s, batch_size=max(1, reply.batch_size),
            draft_rtt_s=max(0.0, draft_time - draft_compute), target_rtt_s=max(0.0, reply.rtt_s - reply.compute_s),
            draft_compute_s=draft_compute, overhead_s=max(0.0, cycle - draft_time - reply.rtt_s) if cycle else 0.0,
        )
        self.policy.observe(obs)
        if k:
            self._last_obs = obs


def _compute_s(drafts: list) -> float:
    return sum(d.compute_micros for d in drafts) / 1e6


async def _cancel(task: asyncio.Task) -> None:
    """Cancel a task and let it finish (its RPC is cancelled on the wire),
    without swallowing a cancellation of the caller."""
    task.cancel()
    await asyncio.wait({task})
    _retrieve(task)


def _retrieve(task: asyncio.Task) -> None:
    """Mark a dropped task's failure as seen: it was work no longer needed."""
    if not task.cancelled():
        task.exception()


def _failed(span, exc: grpc.aio.AioRpcError) -> None:
    """Mark a span whose call failed but whose error the loop absorbs."""
    span.set_status(Status(StatusCode.ERROR, f"{exc.code().name}: {exc.details()}"))
