"""The target's work: batched verification of drafts, and plain decoding.

`verify()` runs ONE forward pass over every valid item of a batch (sessions of
different lengths and different k), then the target's half of rejection
sampling for every item at once (`specdec.sampling.scoring.score_many`, one
transfer to the host for the whole batch). What goes back
is O(k) numbers per item, never a distribution. A bad item (expired session,
malformed q, ...) gets its own error and does not fail the others.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdec.engine.engine import EngineSession, ExtendItem, ModelEngine
from specdec.errors import InvalidArgument, SpecdecError
from specdec.limits import DEFAULT_MAX_DRAFT_TOKENS, check_num_draft_tokens
from specdec.rpc.model_service import EngineBackend, SessionMeta
from specdec.sampling.rejection import VerifyOutcome
from specdec.sampling.scoring import ScoreJob, sample_token, score_many
from specdec.sampling import q_checks, q_wire
from specdec.sampling.sparse import SparseDist
from specdec.sampling.transform import argmax_tokens, logits_to_probs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyRequestItem:
    session_id: str
    keep_length: int | None  # None: keep the whole context
    append: Sequence[int]
    drafts: Sequence[int]  # x_1..x_k
    # q_1..q_k as received (specdec/sampling/q_wire.py: packed bytes or
    # (token_ids, probs) lists); empty under greedy.
    draft_q: Sequence[q_wire.Received] = ()


@dataclass
class VerifyItemResult:
    outcome: VerifyOutcome | None = None
    length: int = 0
    error: Exception | None = None  # a SpecdecError; any other (the model's NaN) is INTERNAL


@dataclass
class VerifyBatchResult:
    items: list[VerifyItemResult] = field(default_factory=list)
    batch_size: int = 0  # sessions in the forward pass


class Verifier(EngineBackend):
    """Sessions of the target model, with batched Verify and plain Decode."""

    def __init__(self, engine: ModelEngine, max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
                 max_verify_batch: int = 64):
        super().__init__(engine)
        self.max_draft_tokens = max_draft_tokens
        self.max_verify_batch = max_verify_batch

    # verify -------------------------------------------------------------------

    def verify(self, items: Sequence[VerifyRequestItem]) -> VerifyBatchResult:
        if not items:
            raise InvalidArgument("Verify needs at least one item")
        if len(items) > self.max_verify_batch:
            raise InvalidArgument(f"Verify carries {len(items)} items; the limit is {self.max_verify_batch}")
        results = [VerifyItemResult() for _ in items]
        valid: list[tuple[int, ExtendItem, list[SparseDist]]] = []
        seen: set[str] = set()
        # Each item's session, looked up once (or the NotFound its item fails with).
        sessions = [self._session(item.session_id) for item in items]
        # The q's of every item that will need them, at once (the packed ones of
        # one size are checked together); a greedy session's are never read.
        checked_q = q_checks.check_items([(it.draft_q, it.drafts) if self._reads_q(it, s) else ((), ())
                                        for it, s in zip(items, sessions)], self.engine.usable_vocab_size)
        for i, item in enumerate(items):
            try:
                if item.session_id in seen:
                    raise InvalidArgument(f"item {i}'s session appears twice in one Verify")
                seen.add(item.session_id)
                valid.append((i, *self._check_item(item, sessions[i], checked_q[i])))
            except SpecdecError as exc:
                results[i].error = exc
        if valid:
            logits = self.engine.extend([extend for _, extend, _ in valid])
            jobs = [self._job(items[i], sessions[i], q, rows) for (i, _, q), rows in zip(valid, logits)]
            for (i, _, _), (job, length), outcome in zip(valid, jobs, score_many([job for job, _ in jobs])):
                if isinstance(outcome, Exception):  # this session's logits (NaN, inf): its item fails alone
                    log.warning("Verify item %d of %d: %s", i, len(items), outcome)
                    results[i] = VerifyItemResult(error=outcome, length=length)
                    continue
                results[i] = VerifyItemResult(outcome=outcome, length=length)
        return VerifyBatchResult(items=results, batch_size=len(valid))

    def _session(self, session_id: str) -> EngineSession | SpecdecError:
        try:
            return self.engine.session(session_id)
        except SpecdecError as exc:
            return exc

    def _check_item(self, item: VerifyRequestItem, session: EngineSession | SpecdecError,
                    checked_q: list[SparseDist] | ValueError) -> tuple[ExtendItem, list[SparseDist]]:
        k = len(item.drafts)
        check_num_draft_tokens(k, self.max_draft_tokens, lowest=0)
        if isinstance(session, SpecdecError):
            raise session
        meta: SessionMeta = session.meta
        q = [] if meta.params.greedy else self._check_q(item, checked_q)
        extend = ExtendItem(item.session_id, item.keep_length, [*item.append, *item.drafts], num_logits=k + 1)
        self.engine.validate([extend])
        return extend, q

    def _reads_q(self, item: VerifyRequestItem, session: EngineSession | SpecdecError) -> bool:
        """Whether the item's q's are to be checked: its session exists and
        samples, and it has one q per draft and no more drafts than allowed
        (the item fails otherwise, and says why in `_check_item`)."""
        if len(item.draft_q) != len(item.drafts) or len(item.drafts) > self.max_draft_tokens:
            return False
        return not isinstance(session, SpecdecError) and not session.meta.params.greedy

    @staticmethod
    def _check_q(item: VerifyRequestItem, checked_q: list[SparseDist] | ValueError) -> list[SparseDist]:
        """The item's q's as `q_checks.check_items` found them."""
        if len(item.draft_q) != len(item.drafts):
            raise InvalidArgument(
                f"{len(item.drafts)} drafted tokens but {len(item.draft_q)} proposal distributions"
            )
        if isinstance(checked_q, ValueError):
            raise InvalidArgument(str(checked_q)) from None
        return checked_q

    @staticmethod
    def _job(item, session: EngineSession, q: list[SparseDist], rows: torch.Tensor) -> tuple[ScoreJob, int]:
        """The scoring of one item, and its session's length after the Verify."""
        meta: SessionMeta = session.meta
        first_position = session.length - len(item.drafts)  # x_1's index in the context
        return ScoreJob(rows, list(item.drafts), q, meta.params, meta.seed, first_position), session.length

    # decode -------------------------------------------------------------------

    def decode(self, session_id: str, keep_length: int | None, append: Sequence[int], num_tokens: int,
               stop_ids: Sequence[int] = ()) -> tuple[list[int], int]:
        """Plain autoregressive decoding of up to num_tokens tokens. Every
        generated token but the last is appended to the context."""
        if num_tokens < 1:
            raise InvalidArgument(f"num_tokens must be >= 1, got {num_tokens}")
        session = self.engine.session(session_id)
        kept = session.length if keep_length is None else keep_length
        first = ExtendItem(session_id, keep_length, list(append), num_logits=1)
        self.engine.validate([first])
        if kept + len(append) + num_tokens - 1 > self.info.max_context:
            raise InvalidArgument(f"decoding {num_tokens} tokens would exceed the context limit")
        meta: SessionMeta = session.meta
        stops = set(stop_ids)
        tokens: list[int] = []
        logits = self.engine.extend([first])[0]
        while True:
            position = session.length
            if meta.params.greedy:
                token = int(argmax_tokens(logits)[0])
            else:
                token = sample_token(logits_to_probs(logits, meta.params)[0], meta.seed, position)
            tokens.append(token)
            if len(tokens) == num_tokens or token in stops:
                return tokens, session.length
            logits = self.engine.extend([ExtendItem(session_id, None, [token], num_logits=1)])[0]
