"""Sessions per caller: one caller (a certificate identity under mutual TLS,
else a calling host) may hold at most `limit` sessions of a service open at
once, so it cannot take every session slot from the others (64 sessions
opened by hand used to starve the orchestrator's own requests).

Counted on the event loop only (OpenSession, CloseSession, the idle reaper),
so no lock. With limit 0 nothing is counted.
"""
from __future__ import annotations

from collections import Counter

from specdec.errors import ResourceExhausted
from specdec.rpc.auth import caller_identity


class SessionQuota:
    def __init__(self, limit: int):
        if limit < 0:
            raise ValueError(f"--max-sessions-per-caller must be >= 0, got {limit}")
        self.limit = limit
        self._open: Counter[str] = Counter()  # caller -> sessions open or being opened
        self._owner: dict[str, str] = {}  # session id -> caller

    def admit(self, context) -> str | None:
        """Reserve a session for the calling identity (returned), or raise
        ResourceExhausted when it is at its quota; None when unlimited."""
        if not self.limit:
            return None
        caller = caller_identity(context)
        if self._open[caller] >= self.limit:
            raise ResourceExhausted(f"caller {caller} already has {self._open[caller]} sessions open, its quota "
                                    f"(--max-sessions-per-caller {self.limit}): close some or wait for them to end")
        self._open[caller] += 1
        return caller

    def opened(self, caller: str | None, session_id: str) -> None:
        if caller is not None:
            self._owner[session_id] = caller

    def abandon(self, caller: str | None) -> None:
        """The reserved session was never opened."""
        if caller is not None:
            self._release(caller)

    def closed(self, session_ids) -> None:
        for session_id in session_ids:
            caller = self._owner.pop(session_id, None)
            if caller is not None:
                self._release(caller)

    def open_by(self, caller: str) -> int:
        return self._open[caller]

    def _release(self, caller: str) -> None:
        self._open[caller] -= 1
        if self._open[caller] <= 0:
            del self._open[caller]
