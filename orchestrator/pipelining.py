"""Pipelined drafting (after PEARL / AMUSD): the draft proposes round r+1
while the target verifies round r.

While the target verifies round r's k drafts, the draft already proposes
m = k' + 1 more tokens, as if all k were accepted (k' being the k the policy
would choose after a full acceptance, `draft_ahead_length`). When round r is
fully accepted and the target's bonus token equals the first of them, the
other k' are round r+1's drafts, already made: round r+1 sends no Propose.
Otherwise the speculative work is dropped (the stream is cancelled; the draft
is cut back by the keep_length riding on its next call). A wrong guess is seen
on the first token drafted ahead, and the rest of that stream is cancelled at
once.

Exactness does not depend on it: round r is decided as without pipelining,
and round r+1's drafts are drafts from the same context. Greedy output is
identical with or without it; sampled output has the same distribution, and
for a seed the same tokens whenever the rounds' k are the same (a model
drafter's drafts are keyed by (seed, position); k drafted ahead is capped at
max_draft_tokens - 1, and a prompt-lookup drafter's continuation can differ).
The win is the draft time of the rounds that follow a full acceptance, hidden
behind verification.

Per request the loop (`orchestrator/speculation.py`) holds a `Pipeline`, the
mechanics, and an `AheadDecision`, the cost model that says whether drafting
ahead pays. Each round:

    drafts = pipeline.take(k)                   # round r's drafts, if made ahead
    k_next = draft_ahead_length(policy, k, ...)
    if decision.worth_drafting_ahead(k, k_next, ...):
        pipeline.start(session, keep, k_next, timeout)   # round r+1's drafts
    reply = verify(...)                         # (pipeline.drop() if it fails)
    decision.observe_verify(overlapped, ...)    # what drafting ahead cost the verify
    settled = await pipeline.settle(k, ...)     # keep or drop round r+1's drafts
    decision.observe_wait(settled.waited_s)     # when it completed
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from orchestrator.downstream import CallCost, DraftClient
from orchestrator.gamma_policy import GammaPolicy, RoundObservation, ewma, k_after_full_acceptance

log = logging.getLogger(__name__)

OVERLAP_WEIGHT = 0.3  # EWMA weight of the newest round in the decision's measurements


def draft_ahead_length(policy: GammaPolicy, k: int, tokens_left: int, context_left: int,
                       max_draft_tokens: int) -> int:
    """k': how many of round r+1's drafts to make while round r's k drafts are
    verified, counting from after a full acceptance of round r (its k drafts
    and the bonus token). It is the k the policy would choose next after that
    acceptance, capped like any round's k: by the tokens the request may still
    emit then (`tokens_left`, one of which is round r+1's own bonus), the room
    left in the context then (`context_left`), and max_draft_tokens - 1 (the
    bonus guess is drafted too). 0 or less: do not draft ahead."""
    # The what-if carries counts only (no timings): the policy's copy moves
    # its acceptance estimate, not its cost model.
    what_if = RoundObservation(k=k, accepted=k, draft_time_s=0.0, verify_time_s=0.0, verify_compute_s=0.0,
                               batch_size=1, draft_rtt_s=0.0, target_rtt_s=0.0)
    return min(k_after_full_acceptance(policy, what_if), tokens_left - 1, context_left, max_draft_tokens - 1)


class AheadDecision:
    """Whether drafting ahead pays, from one request's own measurements.

    Draft ahead when the expected saving beats the expected cost:

        saving = h * max(0, rtt_draft + k' * t_draft - wait)    h = a^(k+1), the hit chance
        cost   = call_cost + (1 - h) * min(t_draft, busy) + slowdown

    A hit saves round r+1's Propose (its round trip and drafting) less the time
    the loop still waited for the drafts made ahead once the verify had ended
    (`wait`, measured: `observe_wait`). k' is the number of drafts made ahead
    for round r+1 (`draft_ahead_length`). Every speculative call costs
    `call_cost` (the CPU of one more streamed call on both ends,
    `--pipeline-call-cost-ms`); a miss may find the draft still drafting ahead
    when round r+1 needs it: `busy` = (k' + 1) * t_draft - (verify time),
    capped at one step (the stream stops at its next step once cancelled); and
    when draft and target share hardware (one CPU, one GPU) drafting ahead
    slows the verification it overlaps: `slowdown` = the target's compute per
    round with drafting ahead minus without, both measured
    (`observe_verify`). The first round drafts ahead and the second does not,
    to measure both; after that one decision in EXPLORE_EVERY is reversed to
    keep the side not taken measured. `always` skips the weighing
    (`--pipeline-always`).
    """

    EXPLORE_EVERY = 10  # every so many decisions, take the other one to re-measure it

    def __init__(self, call_cost_s: float, always: bool = False):
        self.call_cost_s = call_cost_s
        self.always = always
        # Target compute per round with and without drafting ahead during it
        # (EWMA), to see whether the two compete for the same hardware.
        self.verify_alone_s: float | None = None
        self.verify_overlapped_s: float | None = None
        self.wait_s: float | None = None  # EWMA: waiting for drafts made ahead after the verify ended
        self._decisions = 0

    def worth_drafting_ahead(self, k: int, k_next: int, acceptance: float, last: RoundObservation | None) -> bool:
        """Decide for a round of k drafts whose next round would draft k_next
        ahead; `acceptance` is the per-draft acceptance estimate and `last` the
        request's last speculative round (its timings), None before the first."""
        if self.always or last is None or last.k == 0:
            return True
        if self.verify_alone_s is None:
            return False
        t_draft = (last.draft_compute_s or last.draft_time_s) / last.k
        hit = acceptance ** (k + 1)
        saving = hit * max(0.0, last.draft_rtt_s + k_next * t_draft - (self.wait_s or 0.0))
        busy = max(0.0, (k_next + 1) * t_draft - last.verify_time_s)
        slowdown = max(0.0, (self.verify_overlapped_s or 0.0) - self.verify_alone_s)
        cost = self.call_cost_s + (1 - hit) * min(t_draft, busy) + slowdown
        self._decisions += 1
        explore = self._decisions % self.EXPLORE_EVERY == 0
        return (saving > cost) != explore

    def observe_verify(self, overlapped: bool, compute_s: float) -> None:
        """The target's compute for one round's verification, with or without
        drafting ahead during it."""
        if overlapped:
            self.verify_overlapped_s = ewma(self.verify_overlapped_s, compute_s, OVERLAP_WEIGHT)
        else:
            self.verify_alone_s = ewma(self.verify_alone_s, compute_s, OVERLAP_WEIGHT)

    def observe_wait(self, waited_s: float) -> None:
        """How long the loop waited for drafts made ahead after the verify ended."""
        self.wait_s = ewma(self.wait_s, waited_s, OVERLAP_WEIGHT)


@dataclass(frozen=True)
class Settled:
    """How a round's speculative Propose ended (`Pipeline.settle`)."""

    cost: CallCost | None = None  # the call's cost when it completed (its round trip was counted when sent)
    drafts: tuple = ()  # everything it drafted, when it completed
    waited_s: float = 0.0  # time waited for it after the verify (draft time on the critical path)
    kept: bool = False  # the drafts after the guess are the next round's: take() returns them


class Pipeline:
    """One request's pipelined drafting: at most one speculative Propose in
    flight, and the drafts it made for the next round."""

    def __init__(self, draft: DraftClient | None):
        self.draft = draft
        self._ahead: asyncio.Task | None = None
        self._first: asyncio.Future | None = None  # the first token drafted ahead (the bonus guess)
        self._next_drafts: list | None = None

    @property
    def in_flight(self) -> bool:
        return self._ahead is not None

    def take(self, k: int) -> list | None:
        """The drafts the previous round's speculative Propose made, cut to k;
        None when there are none (or k == 0: the draft keeps them, and the next
        call's keep_length cuts them)."""
        drafts, self._next_drafts = self._next_drafts, None
        if not drafts or k == 0:
            return None
        return drafts[:k]

    def start(self, session_id: str, keep: int, k_next: int, timeout: float, min_confidence: float = 0.0,
              packed_q: bool = False, call_number: int = 0) -> None:
        """Start drafting a guess at this round's bonus token and then up to
        k_next drafts of the next round (fewer after an unsure one, as the
        Propose sent after the bonus would be: the guess is left out of the
        early stop's product), on a draft session that holds `keep` tokens (history + this
        round's drafts). `call_number` orders it before the request's next
        Propose: dropped, it may still reach the draft after that one, which
        then refuses it."""
        self._first = asyncio.get_running_loop().create_future()
        self._ahead = asyncio.ensure_future(self.draft.propose(session_id, keep, [], k_next + 1, timeout,
                                                               first=self._first, min_confidence=min_confidence,
                                                               packed_q=packed_q, call_number=call_number,
                                                               first_is_guess=True))

    async def settle(self, k: int, accepted: int, bonus: int | None, eos_ids: frozenset[int]) -> Settled:
        """Keep the speculative drafts if the round (k drafts, `accepted` of
        them accepted, then `bonus`: the last emitted token) was fully accepted
        and the bonus token is the draft's guess; drop them otherwise."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return Settled()
        if accepted < k or bonus is None or bonus in eos_ids:
            await _cancel(ahead)
            return Settled()
        start = time.perf_counter()
        try:
            # Judge the guess as soon as its first token arrives: a wrong guess
            # drops the rest of the stream instead of waiting for it.
            await asyncio.wait({self._first, ahead}, return_when=asyncio.FIRST_COMPLETED)
            if self._first.done() and self._first.result() != bonus:
                await _cancel(ahead)
                return Settled()
            drafts, cost = await ahead
        except grpc.aio.AioRpcError as exc:
            # Nothing to repair: the next Propose fails the same way if the
            # draft is down, and the loop falls back then.
            log.info("speculative Propose failed: %s", exc.code().name)
            return Settled()
        except asyncio.CancelledError:  # the request was cancelled meanwhile: the Propose goes too
            ahead.cancel()
            ahead.add_done_callback(_retrieve)
            raise
        waited = time.perf_counter() - start
        kept = len(drafts) >= 2 and drafts[0].token_id == bonus
        if kept:
            self._next_drafts = list(drafts[1:])
        return Settled(cost=cost, drafts=tuple(drafts), waited_s=waited, kept=kept)

    def drop(self) -> None:
        """Abandon the speculative Propose in flight and any drafts made ahead."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.cancel()
            ahead.add_done_callback(_retrieve)
        self._next_drafts = None


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
