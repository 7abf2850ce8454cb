"""Session opens batched: the prefills of OpenSession calls that arrive
together share forward passes.

A burst of requests (a client's wave of streams, a soak's start, the
sessions of a failed replica re-opened here) opens its sessions at once, and
each open is a prefill. One after another on the engine thread, the last of
n opens waited for n forward passes. Here an open joins the open job that is
queued on the engine thread: when it starts, the job takes the opens waiting
at that moment, up to `max_tokens` prompt tokens (at least one open), and
prefills their prompts together (the backend's `start_opening`: a
PrefillJob, specdec/engine/prefill.py, packs them into passes of
`prefill_chunk` tokens).

Each prefill pass is an engine-thread job of its own: what queued behind the
open (the open sessions' rounds, a draft step) runs between two passes, so a
long prompt or a burst of them holds the engine for one pass at a time, not
for its whole prefill. One open job runs at a time, and the opens that
arrive while it runs join it between two passes, as long as its prompt
tokens still to compute stay within `max_tokens` and it has taken fewer than
`max_opens` (in order of arrival: a long prompt is not passed over). Each
open is answered as soon as its own prompt is computed: a pass gives the
oldest prompt at least half of its tokens and the shortest others the rest,
so a short prompt that can join a long one's prefill is answered after its
next pass (specdec/engine/prefill.py).

What a job cannot take goes in the next one. There is no waiting window: a
lone open's job starts as soon as the engine thread is free. Each open gets
its own session or its own error, whatever else shared its job; an open whose
caller went away before its job took it is dropped, not opened, and one whose
caller went away while its prompt was being computed leaves the job at the
next pass, its session closed (a cancelled 32k-token prompt held the engine
for all its passes, for nobody).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

from specdec.errors import Unavailable

log = logging.getLogger(__name__)

# Prompt tokens still to compute that one open job holds at most: four of the
# engine's default prefill passes (512 tokens each). A job takes at least one
# open, whatever its length; later opens join it only within this budget.
MAX_JOB_TOKENS = 2048
# Opens one job takes in all: then it admits no more, drains and ends, so that
# a steady stream of opens still comes in jobs of bounded size.
MAX_JOB_OPENS = 64


class OpenBatcher:
    def __init__(self, worker, backend: Callable[[], object], max_tokens: int = MAX_JOB_TOKENS,
                 max_opens: int = MAX_JOB_OPENS):
        self.worker = worker
        self.backend = backend  # the service's backend when the job runs (it attaches once loaded)
        self.max_tokens = max_tokens
        self.max_opens = max_opens
        self._lock = threading.Lock()  # the waiting list is taken on the engine thread
        self._waiting: list[tuple[tuple, asyncio.Future]] = []
        self._busy = False  # an open job is queued or running: at most one at a time
        self.jobs = 0  # open jobs run (for tests)
        self.opens = 0  # opens they served

    async def open(self, prompt: list[int], meta, max_new_tokens: int) -> tuple[str, int, int, int]:
        """`backend.open(prompt, meta, max_new_tokens)`, in a job shared with
        the opens waiting beside it; with the number of opens its job had
        taken when it was answered (the prefill span's `specdec.batch.sessions`)."""
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._waiting.append(((prompt, meta, max_new_tokens), future))
            queue_a_job = not self._busy  # else the job queued takes it, or the next one will
            self._busy = True
        if queue_a_job:
            asyncio.ensure_future(self._job())
        try:
            return await future
        except asyncio.CancelledError:
            with self._lock:  # not taken by a job yet: nothing to open
                self._waiting = [entry for entry in self._waiting if entry[1] is not future]
            # Cancelled after its job had answered, before this task woke: the
            # session is open and its caller will never learn of it.
            if future.done() and not future.cancelled() and future.exception() is None:
                self.close_orphan(future.result()[0])
            raise

    def close_orphan(self, session_id: str) -> None:
        """Close a session whose OpenSession call went away while it opened,
        instead of holding its KV slot until it expires."""
        log.info("closing a session whose OpenSession call was abandoned while it opened")
        asyncio.ensure_future(self.worker.run_quick(self.backend().close, session_id))

    async def _job(self) -> None:
        taken: list[tuple[tuple, asyncio.Future]] = []  # by request index in the opening
        answered: set[int] = set()
        opening = None
        try:
            opening, ready = await self.worker.run(self._take_and_start, taken)
            self._answer(taken, ready, answered)
            # One prefill pass an engine-thread job: what queued meanwhile (the
            # open sessions' rounds) runs between two passes, and the opens that
            # arrived join the job's next pass.
            while opening is not None and not opening.done:
                # Opens whose callers went away meanwhile stop here: their
                # prompts' remaining passes would hold the engine for nobody.
                gone = [i for i, (_, future) in enumerate(taken) if future.done() and i not in answered]
                self._answer(taken, await self.worker.run(self._admit_and_step, opening, taken, gone), answered)
        except BaseException as exc:  # noqa: BLE001 - every open it holds gets an error, none waits forever
            with self._lock:  # (the engine thread takes under the lock too)
                started = bool(taken)
                if not started:  # it never ran (the service is stopping): what it would have taken
                    taken, self._waiting = self._waiting, []
            if not started or not isinstance(exc, Exception):
                exc = Unavailable("the service is stopping")
            self._answer(taken, [(i, exc) for i in range(len(taken)) if i not in answered], answered)
            if opening is not None and not opening.done:  # its sessions still opening are nobody's
                asyncio.ensure_future(self._abandon(opening))
        self._next_job()  # after the orphans' closes are queued: the next job may need their slots

    async def _abandon(self, opening) -> None:
        try:
            await self.worker.run_quick(opening.abandon)
        except Exception:  # noqa: BLE001 - the service is stopping: its engine goes with it
            log.debug("could not close the sessions of an abandoned open job", exc_info=True)

    def _answer(self, taken: list, ready: list, answered: set) -> None:
        """Give each ready open its result; close the session of one whose caller went away."""
        for index, result in ready:
            answered.add(index)
            future = taken[index][1]
            if future.done():  # its caller went away: a session it opened is nobody's
                if not isinstance(result, BaseException):
                    self.close_orphan(result[0])
            elif isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result((*result, len(taken)))

    def _next_job(self) -> None:
        """A job ended: the opens it could not take get the next one. One job
        at a time keeps one prefill pass at most queued ahead of the open
        sessions' rounds."""
        with self._lock:
            self._busy = bool(self._waiting)
        if self._busy:
            asyncio.ensure_future(self._job())

    def _take(self, taken: list, budget: int, at_least_one: bool) -> list:
        """Under the lock: the waiting opens, oldest first, while their
        prompts fit in `budget` tokens and the job's opens in `max_opens`;
        moved to `taken`."""
        tokens, n = 0, 0
        for (prompt, _, _), _ in self._waiting:
            tokens += len(prompt)
            if (tokens > budget or len(taken) + n >= self.max_opens) and not (at_least_one and n == 0):
                break  # in order: a long prompt is not passed over by the ones behind it
            n += 1
        new = self._waiting[:n]
        del self._waiting[:n]
        taken.extend(new)
        self.opens += n
        return [args for args, _ in new]

    def _take_and_start(self, taken: list):
        """On the engine thread: take the opens waiting now (up to
        `max_tokens` prompt tokens, one at least), open their sessions and
        run the first prefill pass: (the opening, or None for a backend that
        opens each at once; the opens ready, as (index, result))."""
        with self._lock:
            requests = self._take(taken, self.max_tokens, at_least_one=True)
        self.jobs += 1
        backend = self.backend()
        start_opening = getattr(backend, "start_opening", None)
        if start_opening is None:  # a backend without a model (prompt lookup): nothing to share
            return None, [(i, _open_one(backend, args)) for i, args in enumerate(requests)]
        opening = start_opening(requests)
        opening.step()
        return opening, opening.take_ready()

    def _admit_and_step(self, opening, taken: list, gone=()) -> list:
        """On the engine thread: the opens whose callers went away (`gone`)
        leave the job, their sessions closed; the opens that arrived join it,
        as many as keep its prompt tokens still to compute within
        `max_tokens`; then one prefill pass. The opens ready now."""
        if gone:
            opening.drop(gone)
        with self._lock:
            requests = self._take(taken, self.max_tokens - opening.pending_tokens, at_least_one=False)
        if requests:
            opening.add(requests)
        opening.step()
        return opening.take_ready()


def _open_one(backend, args):
    try:
        return backend.open(*args)
    except Exception as exc:  # noqa: BLE001 - this open's problem only
        return exc
