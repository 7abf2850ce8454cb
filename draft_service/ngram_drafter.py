"""Prompt lookup: a drafter that needs no model (see `NgramDrafter`)."""
from __future__ import annotations

from draft_service.drafters import DraftStream, DraftToken, StreamGuard
from specdec.engine.engine import EngineInfo
from specdec.engine.sessions import ContextRules, Session, SessionTable, new_session_id
from specdec.errors import InvalidArgument
from specdec.limits import DEFAULT_MAX_DRAFT_TOKENS, check_min_confidence, check_num_draft_tokens
from specdec.sampling.sparse import SparseDist


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

    def propose(self, session_id, keep_length, append, k, min_confidence=0.0, call_number=0, first_is_guess=False):
        """A looked-up token is certain (confidence 1): `min_confidence` never
        ends it early, a guess or not. `call_number`: as the model drafter's
        (StreamGuard)."""
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
        owner = self._streams.take(session_id, call_number)  # before the cut: a late call is refused here
        del session.tokens[keep_length:]
        session.tokens.extend(append)
        drafts = self.lookup(session.tokens, k)
        return DraftStream(self, session_id, len(drafts), owner, planned=drafts)

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
