"""Drafters: what proposes the k tokens of a speculative round.

Two kinds behind one interface: `ModelDrafter` (here) runs a small causal LM
through the shared engine; `NgramDrafter` (prompt lookup, ngram_drafter.py)
needs no model and copies what followed the latest earlier occurrence of the
context's last n tokens.

A Propose is a `DraftStream`: validated when it is created, then advanced one
token at a time by `step_many`, which steps many streams (of different
sessions, each request's own) in ONE batched forward pass. The draft service
drives it from `draft_service/step_batcher.py`, so concurrent requests share the
draft's forward passes the way their verifications share the target's. A
stream is also an iterator (one step per `next()`), for direct use.

When the caller wants several steps at once, `ModelDrafter.chain_steps` runs
them ahead: each step is fed the step before's tokens on the device and queued
before the host reads them, so a GPU never idles between a Propose's steps
waiting for the host (`--run-ahead`).

Every drafted token comes with its exact proposal distribution q: the draft
model's distribution after the request's sampling transform, truncated to its
top `max_q_tokens` tokens and renormalized. Rejection sampling is exact for
any q sent exactly, so truncation costs acceptance, never correctness. Under
greedy decoding no q is sent.

A stream may end before its k tokens: once the product of its drafts'
confidences (each the draft's probability of its token; the product, the
draft's own estimate that every draft so far will be accepted) falls below
the call's `min_confidence`, the drafts after would likely be rejected, so
making them is wasted compute. (HF transformers' assisted generation stops
on one token's confidence; the product stops later on long runs of fairly
sure tokens and sooner after several unsure ones.) Which positions are
drafted never changes the output distribution.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

import torch

from draft_service.launched_step import LaunchedStep
from specdec.engine.engine import EngineInfo, ExtendItem, ModelEngine
from specdec.errors import Aborted, OutOfRange
from specdec.limits import DEFAULT_MAX_DRAFT_TOKENS, check_min_confidence, check_num_draft_tokens
from specdec.rpc.model_service import EngineBackend, SessionMeta
from specdec.sampling.draft_picks import DevicePicks, DraftPick, DraftRow
from specdec.sampling.pick_graphs import PickGraphs
from specdec.sampling.sparse import SparseDist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftToken:
    index: int  # position among this call's drafts, 0-based
    token_id: int
    q: SparseDist | None  # None under greedy decoding
    length: int  # session context length after this token
    confidence: float = 1.0  # the draft's probability of token_id (specdec.sampling.draft_picks)


class DraftStream:
    """One Propose call's drafting: k steps on one session, taken by the
    drafter's `step_many` (alone or batched with other streams)."""

    def __init__(self, drafter: "Drafter", session_id: str, k: int, owner: object,
                 first: ExtendItem | None = None, planned: Sequence[int] = (), min_confidence: float = 0.0,
                 first_is_guess: bool = False):
        self.drafter = drafter
        self.session_id = session_id
        self.k = k  # the most it drafts; lowered to what it made when it stops early
        self.min_confidence = min_confidence
        self.belief = 1.0  # the product of its drafts' confidences (a first that is a guess left out)
        self.unscored = 1 if first_is_guess else 0  # leading drafts that are not in the product
        self.owner = owner  # the StreamGuard token this stream holds
        self.first = first  # a model drafter's first step (cut + append), None once taken
        self.planned = list(planned)  # tokens decided up front (prompt lookup)
        self.produced = 0

    @property
    def done(self) -> bool:
        return self.produced >= self.k

    def made(self, token: DraftToken) -> DraftToken:
        """Count a drafted token; the stream ends here once the draft's
        belief that all its drafts will be accepted is below min_confidence."""
        self.produced += 1
        if self.produced > self.unscored:
            self.belief *= token.confidence
            if self.belief < self.min_confidence:
                self.k = self.produced
        return token

    def ends_with(self, confidence: float) -> bool:
        """Whether the next token, drafted with this confidence, is the
        stream's last (`made` would end it)."""
        if self.produced + 1 >= self.k:
            return True
        return self.produced >= self.unscored and self.belief * confidence < self.min_confidence

    def __iter__(self) -> Iterator[DraftToken]:
        return self

    def __next__(self) -> DraftToken:
        result = self.drafter.step_many([self])[0]
        if isinstance(result, Exception):
            raise result
        if result is None:
            raise StopIteration
        return result


class Drafter(Protocol):
    info: EngineInfo

    def open(self, prompt: list[int], meta: SessionMeta, max_new_tokens: int) -> tuple[str, int, int]: ...
    def propose(self, session_id: str, keep_length: int, append: Sequence[int], k: int,
                min_confidence: float = 0.0, call_number: int = 0,
                first_is_guess: bool = False) -> DraftStream: ...
    def step_many(self, streams: Sequence[DraftStream]) -> list[DraftToken | Exception | None]: ...
    def rollback(self, session_id: str, length: int) -> int: ...
    def close(self, session_id: str) -> bool: ...
    def expire_idle(self, ttl_s: float) -> list[str]: ...
    def usage(self) -> tuple[int, int]: ...  # (open sessions, reserved KV bytes), from any thread


class StreamGuard:
    """At most one live Propose stream per session: the newest call wins.

    A client may abandon a stream (pipelined drafting cancels a speculative
    Propose it no longer needs) and send the next call on the same session at
    once. The abandoned stream's generator may still be asked for one more
    step by a server that has not seen the cancellation yet; that step would
    append a token to a context the new call has just cut. Every new call on a
    session (Propose, Rollback, Close) therefore takes the session over, and an
    older stream stops before its next step instead of touching the session.

    "Newest" is the caller's order where the caller numbers its Propose calls
    (`call_number`): the abandoned call may also START after the next one (it
    went on a gRPC stream, the next call on the lane), and it must then
    neither cut the context nor stop the newer call's stream. A numbered call
    below the highest number taken on its session is refused (Aborted).
    """

    def __init__(self):
        self._owner: dict[str, object] = {}
        self._numbers: dict[str, int] = {}  # the highest call number taken, per session

    def take(self, session_id: str, number: int = 0) -> object:
        """The session's new owner token for a call numbered `number` (0:
        unnumbered); Aborted, with nothing changed, if that call is older than
        one that already took the session. Take it before the call changes
        the session."""
        newest = self._numbers.get(session_id, 0)
        if number and number < newest:
            raise Aborted(f"Propose call {number} on the session arrived after call {newest}, "
                          "which took the session over")
        token = object()
        self._owner[session_id] = token
        if number:
            self._numbers[session_id] = number
        return token

    def holds(self, session_id: str, token: object) -> bool:
        return self._owner.get(session_id) is token

    def release(self, *session_ids: str) -> None:
        for session_id in session_ids:
            self._owner.pop(session_id, None)
            self._numbers.pop(session_id, None)


class ModelDrafter(EngineBackend):
    """Drafts with a causal LM; one forward pass per drafted token."""

    def __init__(self, engine: ModelEngine, max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS, max_q_tokens: int = 32,
                 run_ahead: str = "auto", pick_graphs: bool = True):
        super().__init__(engine)
        self.max_draft_tokens = max_draft_tokens
        self.max_q_tokens = max_q_tokens
        self._streams = StreamGuard()
        # Whether a job of several steps runs ahead (chain_steps). auto: on a
        # GPU, where the device runs while the host reads; on a CPU each step
        # runs as it is called, so a step queued ahead is a whole step's
        # compute spent before the host knows whether the stream still wants it.
        if run_ahead not in ("auto", "on", "off"):
            raise ValueError(f"run_ahead must be auto, on or off, not {run_ahead!r}")
        self.run_ahead = run_ahead == "on" or (run_ahead == "auto" and engine.device.type == "cuda")
        self.steps_fed = 0  # steps run ahead: fed the step before's tokens on the device
        # The picks as CUDA graph replays, unless turned off here (or by
        # SPECD_PICK_GRAPHS=off): decided once, when it can be (`pick_graphs`).
        self._pick_graphs: PickGraphs | None = None
        self._pick_graphs_decided = not (pick_graphs and engine.device.type == "cuda")

    @property
    def pick_graphs(self) -> PickGraphs | None:
        """The step's picks as CUDA graph replays (specdec/sampling/pick_graphs.py),
        on a GPU whose engine replays its steps as graphs; None elsewhere. The
        choice is made once the engine's steps are captured (its warmup), or
        once it is known they never will be, and the switch read then."""
        if not self._pick_graphs_decided:
            steps = self.engine.steps
            if steps is None or steps.captured:
                self._pick_graphs = PickGraphs.for_engine(self.engine)
                self._pick_graphs_decided = True
        return self._pick_graphs

    def propose(self, session_id, keep_length, append, k, min_confidence=0.0, call_number=0, first_is_guess=False):
        """Validate now; the returned stream makes the k drafts one step at a
        time (`step_many`, or `next()` on it), ending early once the product
        of their confidences (the first's left out when it is a guess) is
        below `min_confidence`. `call_number`: the caller's count of its
        Propose calls on the session (StreamGuard)."""
        check_num_draft_tokens(k, self.max_draft_tokens)
        check_min_confidence(min_confidence)
        session = self.engine.session(session_id)
        kept = session.length if keep_length is None else keep_length
        # The cut as a length, also when the call keeps the whole context: a
        # batched first step that fails is retried stream by stream, and
        # repeats the cut + append whole (an unset keep_length would append
        # the tokens a second time).
        first = ExtendItem(session_id, kept, list(append), num_logits=1)
        self.engine.validate([first])
        if kept + len(append) + k > self.info.max_context:  # refuse now, not after streaming some drafts
            raise OutOfRange(f"drafting {k} tokens would take the session beyond the context "
                             f"limit of {self.info.max_context} tokens")
        return DraftStream(self, session_id, k, self._streams.take(session_id, call_number), first,
                           min_confidence=min_confidence, first_is_guess=first_is_guess)

    def step_many(self, streams):
        """One draft token for each stream, from one batched forward pass.

        Per stream: a DraftToken; None when the stream has ended (k tokens
        made, or a newer call took its session over); or the error that
        stream alone hit (a failing batch is retried stream by stream, so one
        request's problem never fails another's step)."""
        return self._settle(streams, self._launch(streams))

    def chain_steps(self, streams, more=None, on_step=None) -> list[tuple[list, float]]:
        """Several of `step_many`'s steps in one engine job, run ahead: each
        step after the first is fed the tokens the step before picked while
        they are still on the device (`ModelEngine.feed`), and is queued on the
        device before the host reads the step before's picks, so the device
        never waits for the host between steps (on a GPU the host's work per
        step, ~0.2 ms, otherwise leaves it idle; run_ahead below).

        Returns [(results, seconds)] per step, each results list as
        `step_many`'s. Like the draft service's job of several steps
        (step_batcher._timed_steps): it steps while a stream still wants
        tokens and either `more()` says no stream has arrived since or one
        step is left; `more=None`: one step. The tokens, q and confidences
        are those of `step_many` called step after step: the same forward
        passes on the same inputs and the same picks. A step queued ahead
        for a stream that then ends (its k, min_confidence, an error) is
        dropped: its keys/values lie beyond the stream's context, and the
        cost is that step's compute. `on_step(results, seconds)`, if given,
        is called with each step as soon as it is read, while the next one
        runs (a streamed Propose's tokens, handed on during the job)."""
        clock = time.perf_counter()
        launched = self._launch(streams)
        out = []
        while True:
            launched.start_copy()  # before the next step is queued behind it
            ahead = self._launch_ahead(streams, launched, more)
            results = self._settle(streams, launched, fed=set(ahead.where) if ahead is not None else ())
            now = time.perf_counter()
            out.append((results, now - clock))
            clock = now
            if on_step is not None:
                on_step(list(results), out[-1][1])
            if ahead is None:
                return out
            ended = {i for i in launched.where if not isinstance(results[i], DraftToken) or streams[i].done}
            if ended:
                # A stream that ended here (its k, min_confidence, an error) ends
                # the job after the step already queued (stepping one at a time
                # ends it at once), so its caller is not kept waiting for the others.
                more = None
            launched = ahead.only(lambda i: i not in ended)
            if not launched.where:
                return out

    def _launch(self, streams) -> LaunchedStep:
        """A step's forward pass and the device half of its picks (nothing is
        read back yet)."""
        step = LaunchedStep([None] * len(streams))
        live = [i for i, st in enumerate(streams) if not st.done and self._streams.holds(st.session_id, st.owner)]
        if not live:
            return step
        items = [streams[i].first or ExtendItem(streams[i].session_id, None, (), num_logits=1) for i in live]
        try:
            logits = self.engine.extend(items)
        except Exception as exc:  # noqa: BLE001 - isolate it: retry stream by stream
            if len(live) == 1:
                step.results[live[0]] = exc
                return step
            # Safe to retry: a stream's first step (cut + append) is repeated
            # whole until _commit clears it.
            for i in live:
                step.results[i] = self.step_many([streams[i]])[0]
            return step
        row_of = dict(zip(live, logits))
        last = []
        for i in live:
            try:
                session = self.engine.session(streams[i].session_id)
            except Exception as exc:  # noqa: BLE001 - closed meanwhile: this stream's problem only
                step.results[i] = exc
                continue
            step.add(i, session, DraftRow(session.meta.params, session.meta.seed, session.length))
            last.append(row_of[i][-1:])
        if step.where:
            step.pick(torch.cat(last), self.max_q_tokens, self.pick_graphs)
        return step

    def _launch_ahead(self, streams, step: LaunchedStep, more) -> LaunchedStep | None:
        """The next step for the streams of `step` that want a token after
        it, fed `step`'s picks on the device and queued before they are read;
        None when the job ends with `step` (see chain_steps) or the next step
        could not be queued (`step`'s tokens are then appended as not yet
        computed, as after `step_many`)."""
        if more is None or not step.where or not isinstance(step.picks, DevicePicks):
            return None
        left = {i: streams[i].k - streams[i].produced - 1 for i in step.where}  # after `step`
        going = step.only(lambda i: left[i] >= 1)
        if not going.where or not (more() or min(left[i] for i in going.where) <= 1):
            return None
        try:
            logits = self.engine.feed([s.id for s in going.sessions], going.tokens())
        except Exception:  # noqa: BLE001 - then `step` ends the job, and step_many's path takes over
            log.exception("a chained draft step could not be queued")
            return None
        self.steps_fed += 1
        ahead = LaunchedStep([None] * len(streams))
        for i, session, row in zip(going.where, going.sessions, going.rows):
            ahead.add(i, session, DraftRow(row.params, row.seed, row.position + 1))
        ahead.pick(logits, self.max_q_tokens, self.pick_graphs)
        return ahead

    def _settle(self, streams, step: LaunchedStep, fed=()) -> list:
        """Read a launched step's picks (the step's one host sync) and append
        each stream's token; `fed`: the streams whose token the step after
        has fed already."""
        if not step.where:
            return step.results
        for i, session, pick in zip(step.where, step.sessions, step.read()):
            try:
                step.results[i] = self._commit(streams[i], session, pick, i in fed)
            except Exception as exc:  # noqa: BLE001 - this stream's problem only
                step.results[i] = exc
        return step.results

    def _commit(self, stream: DraftStream, session, pick: DraftPick | Exception, fed: bool = False) -> DraftToken:
        """Append a stream's drafted token to its session. `fed`: its
        keys/values are in the slot already (ModelEngine.feed), and count as
        computed unless the stream ends with it: the next Propose's first
        pass then computes it with the tokens it appends, as after
        `step_many`, so that the contexts' caches hold the same values bit
        for bit whether steps ran ahead or not."""
        if isinstance(pick, Exception):
            raise pick
        computed = 1 if fed and not stream.ends_with(pick.confidence) else 0
        self.engine.append_tokens(session.id, [pick.token_id], computed=computed)
        stream.first = None
        return stream.made(DraftToken(index=stream.produced, token_id=pick.token_id, q=pick.q,
                                      length=session.length, confidence=pick.confidence))

    def rollback(self, session_id, length):
        length = super().rollback(session_id, length)
        self._streams.take(session_id)
        return length

    def close(self, session_id):
        self._streams.release(session_id)
        return super().close(session_id)

    def expire_idle(self, ttl_s):
        stale = super().expire_idle(ttl_s)
        self._streams.release(*stale)
        return stale
