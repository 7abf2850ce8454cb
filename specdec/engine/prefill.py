"""Sessions opened together and prefilled one forward pass at a time.

`ModelEngine.open_sessions` opens a group of requests at once: each forward
pass takes up to `prefill_chunk` prompt tokens, from as many sessions as they
come from. A `PrefillJob` is that work cut at its passes: `step()` runs one,
so a service can put each pass in an engine-thread job of its own and let
what queued meanwhile (the running sessions' rounds) run between two passes.
A long prompt, or a burst of them, then holds the engine for one pass at a
time instead of for its whole prefill.

Each request gets its own session or its own error (a prompt refused, no
room). If a shared pass fails, every session of the job is closed and opened
again alone, so that one request's problem never fails another's (those
prefills run whole, within the failed step). A session being opened is never
idle: the reaper (`expire_idle`) does not take it between two passes.
"""
from __future__ import annotations

import time
from typing import Sequence

from specdec.engine.sessions import EngineSession, new_session_id


class PrefillJob:
    """Open a session for each (prompt, max_new_tokens) at once; compute
    their prompts one pass a `step()`, then take each request's result with
    `results()`. Runs on the engine's thread, like every engine call."""

    def __init__(self, engine, requests: Sequence[tuple[Sequence[int], int]]):
        """`engine`: the ModelEngine whose sessions these are."""
        self.engine = engine
        self.requests = [(list(prompt), max_new_tokens) for prompt, max_new_tokens in requests]
        self._out: list[EngineSession | Exception] = []
        for prompt, max_new_tokens in self.requests:
            try:
                engine.rules.check_open(prompt, max_new_tokens)
                engine._sessions.check_room()
                # The last prompt token is left to the first extend, which needs its logits anyway.
                self._out.append(engine._sessions.add(EngineSession(id=new_session_id(), tokens=prompt[:-1],
                                                                    slot=engine.store.allocate(), opening=True)))
            except Exception as exc:  # noqa: BLE001 - this request's problem only
                self._out.append(exc)
        self._fresh = [s for s in self._out if isinstance(s, EngineSession)]
        self._waiting = [s for s in self._fresh if s.cached < len(s.tokens)]
        self._finished = False

    @property
    def done(self) -> bool:
        """Every prompt is computed (or the job failed and settled each request)."""
        return self._finished or not self._waiting

    def step(self) -> None:
        """One forward pass of up to `prefill_chunk` tokens, taking the
        waiting sessions in order, as much of each as fits."""
        if self.done:
            return
        room, batch, stops = self.engine.cfg.prefill_chunk, [], []
        for session in self._waiting:
            take = min(room, len(session.tokens) - session.cached)
            batch.append(session)
            stops.append(session.cached + take)
            room -= take
            if not room:
                break
        try:
            self.engine._run(batch, stops, [0] * len(batch))
        except BaseException as exc:
            self._fail(exc)
            return
        self._waiting = [s for s in self._waiting if s.cached < len(s.tokens)]

    def results(self) -> list[EngineSession | Exception]:
        """Each request's session (its whole prompt as its context) or its error, in order."""
        while not self.done:
            self.step()
        if not self._finished:
            now = time.monotonic()
            for session, (prompt, _) in zip(self._out, self.requests):
                if isinstance(session, EngineSession):
                    session.tokens = prompt
                    session.opening, session.last_used = False, now  # idle from now on, for the reaper
            self._finished = True
        return self._out

    def _fail(self, exc: BaseException) -> None:
        """A pass failed: close every session of the job; a lone request (or
        an interrupt) raises, a fresh session that ran alone gets the error,
        and the others are opened again, each alone."""
        for session in self._fresh:
            self.engine.close(session.id)
        self._finished = True
        if len(self.requests) == 1 or not isinstance(exc, Exception):
            self._out = [exc if isinstance(s, EngineSession) else s for s in self._out]
            raise exc
        if len(self._fresh) == 1:  # its own pass failed: its own error
            self._out = [exc if isinstance(s, EngineSession) else s for s in self._out]
            return
        self._out = [self._open_alone(prompt, n) if isinstance(s, EngineSession) else s
                     for s, (prompt, n) in zip(self._out, self.requests)]

    def _open_alone(self, prompt: list[int], max_new_tokens: int) -> EngineSession | Exception:
        try:
            return self.engine.open_session(prompt, max_new_tokens)
        except Exception as exc:  # noqa: BLE001 - this request's problem only
            return exc
