"""One request's speculative loop: propose, verify (batched), accept, repeat.

Per round, with k = num_draft_tokens chosen by the request's policy:
  1. the draft proposes x_1..x_k (with their sparse q, unless greedy), or
     fewer: it stops once it is unsure that all its drafts will be accepted
     (the policy's `min_confidence()`), and the policy learns from the
     drafts the round had;
  2. the target scores them in the request's slot of a batched Verify;
  3. the orchestrator decides acceptance (`specdec.sampling.rejection`);
  4. both services are cut back to the accepted prefix by the keep_length
     riding on the NEXT call: no rollback round trip.

Bookkeeping: `history` is prompt + emitted tokens. For each service the
request's `RequestSessions` (`orchestrator/sessions.py`) tracks the length of
the prefix its context shares with `history`; each call sends keep_length =
that prefix and appends the rest of `history`.

Whether a round drafts at all is decided above the request: under
concurrency the requests on one target replica speculate or decode plainly
together, whichever that replica's speculation gate measured faster
(`orchestrator/speculation_gate.py`, held by the replica's verify batcher).
A plain round is the k = 0 round below; the draft catches up on its next
Propose. A request that starts while its replica decodes plainly opens its
draft session only when it first speculates, so a load that stays plain costs
the draft nothing. Only requests whose tokens cannot change with it follow the gate
(greedy ones, and goodput's, whose k already follows timings); a sampled
request under fixed or adaptive always drafts, so that its seed reproduces it.

Pipelined drafting (`RequestSpec.pipeline`): while the target verifies round
r, the draft already proposes round r+1 as if round r will be fully accepted;
`orchestrator/pipelining.py` holds it and the decision whether it pays.

If the draft fails, the round decodes plainly (a Verify with k = 0 draws the
same token a plain decode would) and the draft is re-opened on the full
history after `draft_retry_s`. Output stays exact either way. If the target
fails (UNAVAILABLE, or it lost the session), the session is re-opened on a
live replica by prefilling the history (`orchestrator/recovery.py`), and the
round runs again. Opening, closing, the draft's fallback and the target's
recovery are `orchestrator/sessions.py`.

Tracing (the span tree is in docs/observability.md): each round is a `round`
span holding `draft.propose`, `target.verify` and `accept`; session opens and
closes are `session.open` / `session.close`. No span is open across a `yield`
of `run()`, whose consumer may stop iterating at any point.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from orchestrator.accept_prep import AcceptPrep
from orchestrator.batcher import VerifyBatcher
from orchestrator.downstream import DraftClient, TargetClient
from orchestrator.gamma_policy import GammaPolicy, RoundObservation, acceptance_estimate, round_observation
from orchestrator.pipelining import AheadDecision, Pipeline, draft_ahead_length
from orchestrator.request_stats import RequestSpec, RequestStats
from orchestrator.sessions import RequestSessions, failed
from specdec import hops
from specdec.errors import NotFound, Unavailable
from specdec.limits import DEFAULT_MAX_DRAFT_TOKENS
from specdec.sampling.rejection import RoundResult, VerifyOutcome, accept_greedy, accept_sampled
from specdec.telemetry import (A_ACCEPTED, A_BATCH_ITEMS, A_BATCH_SESSIONS, A_EMITTED, A_FALLBACK, A_K, A_MIN_CONFIDENCE,
                               A_PLAIN, A_RETURNED, A_ROUND, NOOP, SPAN_ACCEPT, SPAN_DRAFT_PROPOSE, SPAN_ROUND, SPAN_TARGET_VERIFY,
                               Telemetry)
from specdec.v1 import target_pb2


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
        self.settings = settings
        self.stats = RequestStats()
        self.finish_reason = "length"
        self.history = list(spec.prompt)
        # lease: orchestrator.recovery.TargetLease, which re-opens a failed target session; None: fail
        self.sessions = RequestSessions(spec, self.history, target, batcher, draft, self.stats, telemetry, lease,
                                        settings.rpc_timeout_s, settings.draft_retry_s)
        self._pipeline = Pipeline(draft)
        self._ahead_decision = AheadDecision(settings.pipeline_call_cost_s, settings.pipeline_always)
        self._last_obs: RoundObservation | None = None  # the last speculative round
        self._last_round_end: float | None = None  # when the previous round was observed
        self._prefill_at_last_round = 0.0  # stats.prefill_time_s then: session opens are not a round's overhead
        self._accept_prep: AcceptPrep | None = None  # a sampled round's, made while its Verify is out
        # Whether the replica's speculation gate may have this request decode
        # plainly: only where that cannot change its tokens. A seeded sampled
        # request under fixed or adaptive reproduces its tokens, and which
        # positions are drafted changes them; under goodput k already follows
        # timings, and greedy tokens do not depend on k.
        self._gated = spec.speculate and (spec.greedy or policy.name == "goodput")
        self._hop_kind = ("greedy" if spec.greedy else "sampled") + ("+traced" if telemetry.tracing else "")

    @property
    def target(self) -> TargetClient:
        """The client of the target replica the request is on now."""
        return self.sessions.target

    @property
    def draft(self) -> DraftClient | None:
        return self.sessions.draft

    def close(self) -> None:
        """Close both sessions in the background: safe to call from a
        cancelled request, returns at once."""
        self._pipeline.drop()
        self.sessions.close()

    async def _recover_target(self, cause: Unavailable) -> None:
        """Move the target session to a live replica (orchestrator/sessions.py);
        what was drafted ahead for the failed round is dropped."""
        self._pipeline.drop()
        await self.sessions.recover_target(cause)

    # ----------------------------------------------------------------- loop

    async def run(self) -> AsyncIterator[list[int]]:
        # Both prefills at once: the time to first token pays the slower one,
        # not their sum. A draft failure is absorbed by open_draft; a target
        # failure is raised once both calls have ended, so close() sees every
        # session that was opened. A request that the replica's gate has
        # decoding plainly opens no draft session yet: it opens one at its
        # first speculative round, if one comes (`open_draft_if_due`).
        batcher = self.sessions.batcher
        lazy_draft = self._gated and batcher.gate.plain_now(batcher.active)
        opens = [self.sessions.open_target()]
        if self.spec.speculate and not lazy_draft:
            opens.append(self.sessions.open_draft())
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
                emitted, eos = await self._round()
            except Unavailable as exc:  # only the target's failures reach here: the draft's are absorbed
                await self._recover_target(exc)
                continue
            if eos:
                self.finish_reason = "eos"
            self.history.extend(emitted)
            self.stats.completion_tokens += len(emitted)
            if emitted:
                yield emitted
            if eos:
                return

    def _choose_k(self) -> int:
        remaining = self.spec.max_tokens - self.stats.completion_tokens
        room = self.settings.max_context - len(self.history) - 1
        return max(0, min(self.policy.next_k(), remaining - 1, room, self.settings.max_draft_tokens))

    async def _round(self) -> tuple[list[int], bool]:
        """The round's tokens, cut before an EOS, and whether one ended the request."""
        number = self.stats.rounds
        hops.record("round.start", self._hop_kind, number)
        with self.telemetry.span(SPAN_ROUND, {A_ROUND: number}) as span:
            batcher = self.sessions.batcher
            # Whether this round drafts at all is the replica's choice (orchestrator/speculation_gate.py).
            speculating = self.spec.speculate and (not self._gated or batcher.gate.speculate(batcher.active))
            plain = self._gated and not speculating
            if speculating:
                await self.sessions.open_draft_if_due()
            fallback = speculating and self.sessions.draft_id is None  # the draft is down: decode plainly
            k = self._choose_k() if speculating and not fallback else 0
            drafts = self._pipeline.take(k)
            pipelined = drafts is not None
            if pipelined:  # made during the previous round; their time was counted then
                draft_time, draft_compute = 0.0, 0.0
            else:
                drafts, draft_time, draft_compute, failed = await self._propose(k)
                fallback = fallback or failed
            self._draft_ahead(drafts)
            overlapped = self._pipeline.in_flight
            try:
                reply = await self._verify(drafts)
            except BaseException:
                self._pipeline.drop()
                raise
            # Counted once the round's verify is through: a round the target's
            # recovery runs again is one round, not two.
            self.stats.plain_rounds += plain
            self.stats.fallback_rounds += fallback
            self.stats.pipelined_rounds += pipelined
            if self.spec.pipeline and drafts:
                self._ahead_decision.observe_verify(overlapped, reply.compute_s / max(1, reply.items))
            with self.telemetry.leaf_span(SPAN_ACCEPT) as accept_span:
                result = self._accept(drafts, reply.result)
                accept_span.set_attribute(A_ACCEPTED, result.num_accepted)
            emitted = result.emitted_ids
            end = _eos_index(emitted, self.spec.eos_ids)  # the tokens after an EOS are not the output
            # Drafts accepted after an accepted EOS are not counted: the request ended at it.
            counted = result.num_accepted if end is None else min(result.num_accepted, end + 1)
            self._advance_prefixes(len(drafts), result.num_accepted)
            await self._settle_ahead(len(drafts), result)
            self._observe(k, len(drafts), result.num_accepted, counted, draft_time, draft_compute, reply)
            batcher = self.sessions.batcher  # (a recovery may have moved the request)
            batcher.gate.record(batcher.active, speculating if self._gated else None,
                                len(emitted) if end is None else end + 1)
            span.set_attributes({A_K: k, A_RETURNED: len(drafts), A_ACCEPTED: result.num_accepted,
                                 A_EMITTED: len(result.emitted_ids),
                                 A_FALLBACK: fallback, A_PLAIN: plain})
        hops.record("round.end", self._hop_kind, number)
        return (emitted, False) if end is None else (emitted[:end], True)

    async def _propose(self, k: int) -> tuple[list, float, float, bool]:
        """(drafts, wall seconds, draft compute seconds, whether the draft
        failed: the round then decodes plainly)"""
        if k == 0:
            return [], 0.0, 0.0, False
        keep = self.sessions.draft_prefix
        stop = self.policy.min_confidence()
        with self.sessions.client_span(SPAN_DRAFT_PROPOSE, "draft", {A_K: k, A_MIN_CONFIDENCE: stop}) as span:
            try:
                drafts, cost = await self.sessions.draft.propose(self.sessions.draft_id, keep, self.history[keep:],
                                                                 k, self.sessions.timeout(),
                                                                 min_confidence=stop, packed_q=self.sessions.packed_q,
                                                                 call_number=self.sessions.next_draft_call())
            except grpc.aio.AioRpcError as exc:
                failed(span, exc)
                self.sessions.draft_failed(exc)
                return [], 0.0, 0.0, True
            span.set_attribute(A_RETURNED, len(drafts))
        self.sessions.account(cost, "draft", "Propose")
        compute = _compute_s(drafts)
        self.stats.draft_time_s += cost.seconds
        self.stats.draft_compute_s += compute
        if drafts:  # the draft now holds history + drafts (with none, the cut may not have happened)
            self.sessions.draft_prefix = len(self.history)
        return drafts, cost.seconds, compute, False

    # ------------------------------------------------------ pipelined drafting

    def _draft_ahead(self, drafts: list) -> None:
        """Start drafting round r+1 while round r's drafts are verified, as if
        all of them will be accepted."""
        k = len(drafts)
        if not (self.spec.pipeline and k and self.sessions.draft_id is not None):
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
        self._pipeline.draft = self.sessions.draft  # the replica the request is on now (a failed draft's moves)
        self._pipeline.start(self.sessions.draft_id, len(self.history) + k, k_next, self.sessions.timeout(),
                             self.policy.min_confidence(), self.sessions.packed_q, self.sessions.next_draft_call())

    async def _settle_ahead(self, k: int, result: RoundResult) -> None:
        """Account for the speculative Propose of round r (k drafts) and, when
        its drafts are round r+1's, note what the draft now holds."""
        bonus = result.emitted_ids[-1] if result.emitted_ids else None
        settled = await self._pipeline.settle(k, result.num_accepted, bonus, self.spec.eos_ids)
        if settled.cost is not None:
            self._ahead_decision.observe_wait(settled.waited_s)
            self.sessions.account(settled.cost, "draft", "Propose", round_trip=False)  # counted when it was sent
            self.stats.draft_compute_s += _compute_s(settled.drafts)
            self.stats.draft_time_s += settled.waited_s
        if settled.kept:
            # The draft holds history + k drafts + the bonus + the drafts kept.
            self.sessions.draft_prefix = len(self.history) + k + 1

    async def _verify(self, drafts: list):
        keep = self.sessions.target_prefix
        item = target_pb2.VerifyItem(
            session_id=self.sessions.target_id, keep_length=keep, append_token_ids=self.history[keep:],
            draft_token_ids=[d.token_id for d in drafts],
        )
        if not self.spec.greedy:
            item.draft_q.extend(d.q for d in drafts)
        with self.telemetry.span(SPAN_TARGET_VERIFY, {A_K: len(drafts)}) as span:
            timeout = self.sessions.timeout()  # first: a passed deadline must not leave the verify coroutine unawaited
            # What the accept test needs from the drafts, made on the loop's next turn: once the Verify is out.
            self._accept_prep = (AcceptPrep.schedule(drafts, self.spec.seed, len(self.history))
                                 if drafts and not self.spec.greedy else None)
            try:
                reply = await self.sessions.batcher.verify(item, timeout)  # DeadlineExceeded past it
            except NotFound as exc:  # the target restarted and forgot the session
                raise Unavailable(f"the target lost the session: {exc}") from None
            span.set_attributes({A_BATCH_ITEMS: reply.items, A_BATCH_SESSIONS: reply.batch_size})
        self.sessions.target_prefix = len(self.history)
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
        # The reply's repeated fields as they are: the accept test reads a few of their entries.
        outcome = VerifyOutcome(target_probs=result.target_probs, recovery_ids=result.recovery_token_ids,
                                bonus_id=result.bonus_token_id)
        prep, self._accept_prep = self._accept_prep, None
        if prep is None or prep.drafts is not drafts or prep.first_position != len(self.history):
            prep = AcceptPrep(drafts, self.spec.seed, len(self.history))
        q_of_x, accept_uniforms = prep.values()
        return accept_sampled(ids, q_of_x, outcome, self.spec.seed, first_position=len(self.history),
                              accept_uniforms=accept_uniforms)

    def _advance_prefixes(self, k: int, accepted: int) -> None:
        # Both services hold history + the k drafts; they share history + the
        # accepted drafts with what comes next.
        shared = len(self.history) + accepted
        self.sessions.target_prefix = shared
        if k:
            self.sessions.draft_prefix = shared

    def _observe(self, k_chosen: int, k: int, accepted: int, counted: int, draft_time: float,
                 draft_compute: float, reply) -> None:
        """`accepted`: the drafts the target accepted; `counted`: those up to an EOS, the statistics'."""
        self.stats.record_round(k, accepted)
        self.stats.uncount_last_round(accepted - counted)
        if self.spec.speculate:
            self.telemetry.metrics.record_round(k_chosen, k, counted)
        # The whole cycle since the previous round was observed (its tokens
        # streamed to the client included), less the two calls.
        # Less any session open since (a draft opened when the gate turned to
        # speculation, a re-open, a target's recovery): a prefill learned as
        # overhead sent the goodput policy's k to its maximum for rounds.
        now = time.perf_counter()
        opened = self.stats.prefill_time_s - self._prefill_at_last_round
        cycle = max(0.0, now - self._last_round_end - opened) if self._last_round_end is not None else 0.0
        self._last_round_end, self._prefill_at_last_round = now, self.stats.prefill_time_s
        obs = round_observation(k, accepted, draft_time, draft_compute, reply.rtt_s, reply.compute_s,
                                reply.batch_size, cycle, self._last_obs)
        self.policy.observe(obs)
        if k:
            self._last_obs = obs


def _eos_index(emitted: list[int], eos_ids: frozenset[int]) -> int | None:
    for i, token in enumerate(emitted):
        if token in eos_ids:
            return i
    return None


def _compute_s(drafts: list) -> float:
    return sum(d.compute_micros for d in drafts) / 1e6
