"""Session bookkeeping shared by every backend that holds sessions: the model
engine (whose sessions own a KV slot) and the prompt-lookup drafter (whose
sessions are token lists only).

One place decides what a session id looks like, how an unknown id is
reported, how many sessions may be open, when an idle one expires, and how a
context is checked (token ids in range, keep lengths, the context limit), so
the two backends answer the same mistakes with the same messages.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Generic, Iterator, Sequence, TypeVar

from specdec.errors import InvalidArgument, NotFound, OutOfRange, ResourceExhausted


@dataclass
class Session:
    """A token context. Backends subclass it to add their own state."""

    id: str
    # The context: prompt, accepted tokens, and any tokens drafted since.
    tokens: list[int]
    last_used: float = field(default_factory=time.monotonic)
    # The service's own per-session state (sampling parameters, seed, ...).
    meta: object = None
    # Still being opened (its prompt prefilled pass by pass): in use, never idle.
    opening: bool = False

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class EngineSession(Session):
    """A session of the model engine: its context, and the KV slot that
    holds the keys/values of a prefix of it."""

    # The session's slot in the KV store.
    slot: int = -1
    # Positions [0, cached) of the slot hold valid keys/values.
    cached: int = 0


S = TypeVar("S", bound=Session)


def new_session_id() -> str:
    """Unguessable, so one client cannot reach another's session: the id is
    the session's credential (docs/security.md), so no error message, log
    line or span carries it."""
    return secrets.token_urlsafe(18)


class SessionTable(Generic[S]):
    """Open sessions by id, with a count limit and idle expiry.

    Not thread-safe for writes (each service changes it from one worker
    thread); `len()` and `values()` snapshot safely from other threads.
    """

    def __init__(self, max_sessions: int):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self._sessions: dict[str, S] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def values(self) -> list[S]:
        # list() snapshots in one step: metrics threads read while the
        # worker thread opens and closes sessions.
        return list(self._sessions.values())

    def __iter__(self) -> Iterator[S]:
        return iter(self.values())

    def check_room(self) -> None:
        if len(self._sessions) >= self.max_sessions:
            raise ResourceExhausted(f"too many open sessions (limit {self.max_sessions})")

    def add(self, session: S) -> S:
        self.check_room()
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> S:
        """The session, marked as used now; NotFound if unknown or expired."""
        try:
            session = self._sessions[session_id]
        except KeyError:
            raise NotFound("unknown or expired session") from None
        session.last_used = time.monotonic()
        return session

    def peek(self, session_id: str) -> S | None:
        """The session without marking it used, or None."""
        return self._sessions.get(session_id)

    def pop(self, session_id: str) -> S | None:
        return self._sessions.pop(session_id, None)

    def idle(self, ttl_s: float) -> list[S]:
        """Sessions unused for more than ttl_s seconds (not removed)."""
        now = time.monotonic()
        return [s for s in self._sessions.values() if now - s.last_used > ttl_s and not s.opening]


class ContextRules:
    """The checks every session context obeys, with one message each."""

    def __init__(self, vocab_size: int, max_context: int):
        self.vocab_size = vocab_size
        self.max_context = max_context

    def check_tokens(self, tokens: Sequence[int], what: str) -> None:
        for t in tokens:
            if not 0 <= int(t) < self.vocab_size:
                raise InvalidArgument(f"{what}: token id {int(t)} outside the vocabulary [0, {self.vocab_size})")

    def check_open(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        if not prompt:
            raise InvalidArgument("the prompt is empty: at least one token is needed")
        self.check_tokens(prompt, "prompt")
        if max_new_tokens < 0:
            raise InvalidArgument(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if len(prompt) + max_new_tokens > self.max_context:
            raise InvalidArgument(
                f"prompt ({len(prompt)} tokens) plus max_new_tokens ({max_new_tokens}) exceeds "
                f"the context limit of {self.max_context} tokens"
            )

    def check_keep(self, session: Session, length: int) -> None:
        if length < 0:
            raise InvalidArgument(f"length must be >= 0, got {length}")
        if length > session.length:
            raise OutOfRange(f"cannot keep {length} tokens: the session holds only {session.length}")

    def check_rollback(self, session: Session, length: int) -> None:
        """An explicit Rollback keeps at least one token: a session of length
        0 has nothing to decode from, so every later call on it would fail.
        (A keep_length of 0 riding on Propose/Verify is fine: tokens are
        appended in the same call.)"""
        if length < 1:
            raise InvalidArgument(f"a rollback must keep at least 1 token, got length {length}")
        self.check_keep(session, length)

    def check_length(self, session: Session, new_length: int) -> None:
        if new_length > self.max_context:
            raise OutOfRange(
                f"the session would hold {new_length} tokens, beyond the context "
                f"limit of {self.max_context}"
            )
