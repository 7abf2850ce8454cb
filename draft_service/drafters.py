"""Drafters: what proposes the k tokens of a speculative round.

Two kinds behind one interface: `ModelDrafter` runs a small causal LM through
the shared engine; `NgramDrafter` (prompt lookup) needs no model and copies
what followed the latest earlier occurrence of the context's last n tokens.

A Propose is a `DraftStream`: validated when it is created, then advanced one
token at a time by `step_many`, which steps many streams (of different
sessions, each request's own) in ONE batched forward pass. The draft service
drives it from `draft_service/step_batcher.py`, so concurrent requests share the
draft's forward passes the way their verifications share the target's. A
stream is also an iterator (one step per `next()`), for direct use.

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

from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

import torch

from specdec.engine.engine import EngineInfo, ExtendItem, ModelEngine
from specdec.engine.sessions import ContextRules, Session, SessionTable, new_session_id
from specdec.errors import InvalidArgument, OutOfRange
from specdec.limits import DEFAULT_MAX_DRAFT_TOKENS, check_min_confidence, check_num_draft_tokens
from specdec.rpc.model_service import EngineBackend, SessionMeta
from specdec.sampling.draft_picks import DraftPick, DraftRow, pick_drafts
from specdec.sampling.sparse import SparseDist


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
                 first: ExtendItem | None = None, planned: Sequence[int] = (), min_confidence: float = 0.0):
        self.drafter = drafter
        self.session_id = session_id
        self.k = k  # the most it drafts; lowered to what it made when it stops early
        self.min_confidence = min_confidence
        self.belief = 1.0  # the product of its drafts' confidences
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
        self.belief *= token.confidence
        if self.belief < self.min_confidence:
            self.k = self.produced
        return token

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
                min_confidence: float = 0.0) -> DraftStream: ...
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
    """

    def __init__(self):
        self._owner: dict[str, object] = {}

    def take(self, session_id: str) -> object:
        token = object()
        self._owner[session_id] = token
        return token

    def holds(self, session_id: str, token: object) -> bool:
        return self._owner.get(session_id) is token

    def release(self, *session_ids: str) -> None:
        for session_id in session_ids:
            self._owner.pop(session_id, None)


class ModelDrafter(EngineBackend):
    """Drafts with a causal LM; one forward pass per drafted token."""

    def __init__(self, engine: ModelEngine, max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS, max_q_tokens: int = 32):
        super().__init__(engine)
        self.max_draft_tokens = max_draft_tokens
        self.max_q_tokens = max_q_tokens
        self._streams = StreamGuard()

    def propose(self, session_id, keep_length, append, k, min_confidence=0.0):
        """Validate now; the returned stream makes the k drafts one step at a
        time (`step_many`, or `next()` on it), ending early once the product
        of their confidences is below `min_confidence`."""
        check_num_draft_tokens(k, self.max_draft_tokens)
        check_min_confidence(min_confidence)
        session = self.engine.session(session_id)
        kept = session.length if keep_length is None else keep_length
        first = ExtendItem(session_id, keep_length, list(append), num_logits=1)
        self.engine.validate([first])
        if kept + len(append) + k > self.info.max_context:  # refuse now, not after streaming some drafts
            raise OutOfRange(f"drafting {k} tokens would take session {session_id!r} beyond the context "
                             f"limit of {self.info.max_context} tokens")
        return DraftStream(self, session_id, k, self._streams.take(session_id), first,
                           min_confidence=min_confidence)

    def step_many(self, streams):
        """One draft token for each stream, from one batched forward pass.

        Per stream: a DraftToken; None when the stream has ended (k tokens
        made, or a newer call took its session over); or the error that
        stream alone hit (a failing batch is retried stream by stream, so one
        request's problem never fails another's step)."""
        results: list = [None] * len(streams)
        live = [i for i, st in enumerate(streams) if not st.done and self._streams.holds(st.session_id, st.owner)]
        if not live:
            return results
        items = [streams[i].first or ExtendItem(streams[i].session_id, None, (), num_logits=1) for i in live]
        try:
            logits = self.engine.extend(items)
        except Exception as exc:  # noqa: BLE001 - isolate it: retry stream by stream
            if len(live) == 1:
                results[live[0]] = exc
                return results
            # Safe to retry: a stream's first step (cut + append) is repeated
            # whole until _commit clears it.
            for i in live:
                results[i] = self.step_many([streams[i]])[0]
            return results
        sessions, rows, where = [], [], []
        for i in live:
            try:
                session = self.engine.session(streams[i].session_id)
            except Exception as exc:  # noqa: BLE001 - closed meanwhile: this stream's problem only
                results[i] = exc
                continue
            sessions.append(session)
            rows.append(DraftRow(session.meta.params, session.meta.seed, session.length))
            where.append(i)
        if not where:
            return results
        row_of = dict(zip(live, logits))
        last = [row_of[i][-1:] for i in where]
        try:  # one sampling pass for every stream of the step, one transfer to the host
            picks = pick_drafts(torch.cat(last), rows, self.max_q_tokens)
        except Exception:  # noqa: BLE001 - unexpected: isolate it, stream by stream
            picks = [_pick_alone(row, r, self.max_q_tokens) for row, r in zip(last, rows)]
        for i, session, pick in zip(where, sessions, picks):
            try:
                results[i] = self._commit(streams[i], session, pick)
            except Exception as exc:  # noqa: BLE001 - this stream's problem only
                results[i] = exc
        return results

    def _commit(self, stream: DraftStream, session, pick: DraftPick | Exception) -> DraftToken:
        """Append a stream's drafted token to its session."""
        if isinstance(pick, Exception):
            raise pick
        self.engine.append_tokens(session.id, [pick.token_id])
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


def _pick_alone(logits, row: DraftRow, max_q_tokens: int) -> DraftPick | Exception:
    try:
        return pick_drafts(logits, [row], max_q_tokens)[0]
    except Exception as exc:  # noqa: BLE001 - reported as this stream's error
        return exc


class NgramDrafter:
    """Prompt lookup: propose the continuation of the latest earlier match of
    the context's last n tokens (n from max_ngram down to min_ngram).

    Its proposal is deterministic, so q is a point mass on each drafted token:
    acceptance is then p(x), and a rejection resamples from norm(max(0, p - q)).
    It may propose fewer than k tokens, or none when nothing matches.
    Limitation: the search is a linear scan of the context per round.
    """

    def __init__(self, vocab_size: int, max_context: int = 4096, max_sessions: int = 256,
                 max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS, min_ngram: int = 1, max_ngram: int = 3):
        self.info = EngineInfo(
            model_name="ngram", vocab_size=vocab_size, max_context=max_context, eos_token_ids=(),
            tokenizer_fingerprint="", device="cpu", dtype="none", kv_bytes_per_token=0,
        )
        self.max_draft_tokens = max_draft_tokens
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._sessions: SessionTable[Session] = SessionTable(max_sessions)
        self.rules = ContextRules(vocab_size, max_context)
        self._streams = StreamGuard()

    def open(self, prompt, meta, max_new_tokens):
        self.rules.check_open(prompt, max_new_tokens)
        session = self._sessions.add(Session(id=new_session_id(), tokens=list(prompt), meta=meta))
        return session.id, session.length, 0

    def propose(self, session_id, keep_length, append, k, min_confidence=0.0):
        """A looked-up token is certain (confidence 1): `min_confidence` never ends it early."""
        check_num_draft_tokens(k, self.max_draft_tokens)
        check_min_confidence(min_confidence)
        session = self._sessions.get(session_id)
        if keep_length is None:
            keep_length = session.length
        self.rules.check_keep(session, keep_length)
        self.rules.check_tokens(append, "appended tokens")
        if keep_length + len(append) < 1:  # as the model drafter: an empty context has nothing to draft from
            raise InvalidArgument("nothing to draft from (a context of 0 tokens): keep or append at least one token")
        self.rules.check_length(session, keep_length + len(append) + k)
        del session.tokens[keep_length:]
        session.tokens.extend(append)
        drafts = self.lookup(session.tokens, k)
        return DraftStream(self, session_id, len(drafts), self._streams.take(session_id), planned=drafts)

    def step_many(self, streams):
        """The next looked-up token of each stream (no model: nothing to batch)."""
        results: list = []
        for st in streams:
            session = self._sessions.peek(st.session_id)
            if st.done or session is None or not self._streams.holds(st.session_id, st.owner):
                results.append(None)
                continue
            token = st.planned[st.produced]
            session.tokens.append(token)
            q = None if session.meta.params.greedy else SparseDist.from_lists([token], [1.0])
            results.append(st.made(DraftToken(index=st.produced, token_id=token, q=q, length=len(session.tokens))))
        return results

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The up-to-k tokens that followed the latest earlier occurrence of
        the longest matching suffix n-gram."""
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []

    def rollback(self, session_id, length):
        session = self._sessions.get(session_id)
        self.rules.check_rollback(session, length)
        self._streams.take(session_id)
        del session.tokens[length:]
        return session.length

    def close(self, session_id):
        self._streams.release(session_id)
        return self._sessions.pop(session_id) is not None

    def expire_idle(self, ttl_s):
        stale = [s.id for s in self._sessions.idle(ttl_s)]
        for sid in stale:
            self._sessions.pop(sid)
        self._streams.release(*stale)
        return stale

    def usage(self):
        return len(self._sessions), 0
