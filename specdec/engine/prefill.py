"""Sessions opened together and prefilled one forward pass at a time.

`ModelEngine.open_sessions` opens a group of requests at once: each forward
pass takes up to `prefill_chunk` prompt tokens, from as many sessions as they
come from. A `PrefillJob` is that work cut at its passes: `step()` runs one,
so a service can put each pass in an engine-thread job of its own and let
what queued meanwhile (the running sessions' rounds) run between two passes.
A long prompt, or a burst of them, then holds the engine for one pass at a
time instead of for its whole prefill.

Requests may join a job between two passes (`add`), and each session is
ready as soon as its own prompt is computed (`take_ready`), not when the
whole job is: a short prompt that arrives while a long one is prefilled
shares the long one's next pass and is answered after it. A pass gives the
oldest waiting session at least half of its tokens and the rest to the
others, shortest first, so short prompts go through quickly and a stream of
them cannot starve a long one.

Each request gets its own session or its own error (a prompt refused, no
room). If a shared pass fails, every session of the job that is not ready yet
is closed and opened again alone, so that one request's problem never fails
another's (those prefills run whole, within the failed step); when only one
was not ready, it gets the pass's error. A session being
opened is never idle: the reaper (`expire_idle`) does not take it between two
passes.
"""
from __future__ import annotations

import time
from typing import Sequence

from specdec.engine.sessions import EngineSession


class PrefillJob:
    """Open a session for each (prompt, max_new_tokens); compute their
    prompts one pass a `step()`, taking each request's result with
    `take_ready()` as it is ready (or all of them with `results()`). Runs on
    the engine's thread, like every engine call."""

    def __init__(self, engine, requests: Sequence[tuple[Sequence[int], int]] = ()):
        """`engine`: the ModelEngine whose sessions these are."""
        self.engine = engine
        self.requests: list[tuple[list[int], int]] = []
        self._out: list[EngineSession | Exception | None] = []  # None: not ready yet
        self._sessions: dict[int, EngineSession] = {}  # request index -> its session, until it is ready
        self._order: list[int] = []  # the waiting requests' indexes, oldest first
        self._ready: list[int] = []  # settled since take_ready last ran
        self.add(requests)

    def add(self, requests: Sequence[tuple[Sequence[int], int]]) -> list[int]:
        """Open a session for each (prompt, max_new_tokens) now, its prompt
        to be computed by the next passes; their request indexes. A refused
        request is ready at once, with its error."""
        added = []
        for prompt, max_new_tokens in requests:
            prompt, index = list(prompt), len(self.requests)
            self.requests.append((prompt, max_new_tokens))
            self._out.append(None)
            added.append(index)
            try:
                session = self.engine.reserve_session(prompt, max_new_tokens)
            except Exception as exc:  # noqa: BLE001 - this request's problem only
                self._settle(index, exc)
                continue
            self._sessions[index] = session
            self._order.append(index)
            self._ready_if_computed(index)
        return added

    @property
    def done(self) -> bool:
        """Every prompt added so far is computed (or its request has its error)."""
        return not self._order

    @property
    def pending_tokens(self) -> int:
        """Prompt tokens still to compute."""
        return sum(len(s.tokens) - s.cached for s in self._sessions.values())

    def step(self) -> None:
        """One forward pass of up to `prefill_chunk` tokens: at least half of
        them (or all it has left) to the oldest waiting session, then to the
        others, shortest first, as much of each as fits."""
        if self.done:
            return
        chunk = self.engine.cfg.prefill_chunk
        left = {i: len(self._sessions[i].tokens) - self._sessions[i].cached for i in self._order}
        oldest = self._order[0]
        share = {oldest: min(left[oldest], max(1, chunk // 2))}
        room = chunk - share[oldest]
        for i in sorted(self._order[1:], key=lambda i: (left[i], i)):
            if not room:
                break
            share[i] = min(room, left[i])
            room -= share[i]
        if room:
            extra = min(room, left[oldest] - share[oldest])
            share[oldest] += extra
        batch = [self._sessions[i] for i in share]
        stops = [self._sessions[i].cached + n for i, n in share.items()]
        try:
            self.engine.compute_up_to(batch, stops)
        except BaseException as exc:
            self._fail(exc)
            return
        for i in list(share):
            self._ready_if_computed(i)

    def take_ready(self) -> list[tuple[int, EngineSession | Exception]]:
        """The requests ready since the last call: (index, its session or its error)."""
        out, self._ready = [(i, self._out[i]) for i in self._ready], []
        return out

    def results(self) -> list[EngineSession | Exception]:
        """Every request's session (its whole prompt as its context) or its
        error, in order, after computing what is left."""
        while not self.done:
            self.step()
        return list(self._out)

    def drop(self, indexes) -> None:
        """Close the sessions of these requests that are not ready yet (their
        callers went away): the passes after compute only the others."""
        for i in indexes:
            if i in self._sessions:
                self.engine.close(self._sessions.pop(i).id)
                self._order.remove(i)
                self._settle(i, RuntimeError("its open was abandoned"))

    def abandon(self) -> None:
        """Close the sessions not ready yet (their opens will not be answered)."""
        for i in self._order:
            self.engine.close(self._sessions.pop(i).id)
            self._settle(i, RuntimeError("the open job was abandoned"))
        self._order = []

    def _ready_if_computed(self, index: int) -> None:
        session = self._sessions[index]
        if session.cached < len(session.tokens):
            return
        session.tokens = self.requests[index][0]
        session.opening, session.last_used = False, time.monotonic()  # idle from now on, for the reaper
        self._settle(index, session)
        del self._sessions[index]
        self._order.remove(index)

    def _settle(self, index: int, result: EngineSession | Exception) -> None:
        self._out[index] = result
        self._ready.append(index)

    def _fail(self, exc: BaseException) -> None:
        """A pass failed: close every session not ready yet. An interrupt
        raises; a lone such session gets the error; several are opened
        again, each alone."""
        failed = list(self._order)
        for i in failed:
            self.engine.close(self._sessions.pop(i).id)
        self._order = []
        if not isinstance(exc, Exception):
            for i in failed:
                self._settle(i, RuntimeError(f"interrupted: {exc!r}"))
            raise exc
        for i in failed:
            self._settle(i, exc if len(failed) == 1 else self._open_alone(*self.requests[i]))

    def _open_alone(self, prompt: list[int], max_new_tokens: int) -> EngineSession | Exception:
        try:
            return self.engine.open_session(prompt, max_new_tokens)
        except Exception as exc:  # noqa: BLE001 - this request's problem only
            return exc
