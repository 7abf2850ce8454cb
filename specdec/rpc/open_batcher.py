"""Session opens batched: the prefills of OpenSession calls that arrive
together share forward passes.

A burst of requests (a client's wave of streams, a soak's start, the
sessions of a failed replica re-opened here) opens its sessions at once, and
each open is a prefill. One after another on the engine thread, the last of
n opens waited for n forward passes. Here an open joins the open job that is
queued on the engine thread, as long as that job has not started: when it
starts, the job takes the opens waiting at that moment, up to `max_tokens`
prompt tokens (at least one open), and prefills their prompts together (the
backend's `start_opening`: a PrefillJob, specdec/engine/prefill.py, packs
them into passes of `prefill_chunk` tokens). What it leaves, and opens
arriving while it runs, go in the next job.

Each prefill pass is an engine-thread job of its own: what queued behind the
open (the open sessions' rounds, a draft step, the next opens) runs between
two passes, so a long prompt or a burst of them holds the engine for one
pass at a time, not for its whole prefill. The opens are answered when their
job's last pass is done.

There is no waiting window: a lone open's job starts as soon as the engine
thread is free and no other open job runs. Each open gets its own session or
its own error, whatever else shared its job; an open whose caller went away
before its job took it is dropped, not opened.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

from specdec.errors import Unavailable

log = logging.getLogger(__name__)

# Prompt tokens one open job takes at most: four of the engine's default
# prefill passes (512 tokens each). Its opens are answered after its last
# pass, so this bounds how long a short prompt waits on the others of its job.
MAX_JOB_TOKENS = 2048


class OpenBatcher:
    def __init__(self, worker, backend: Callable[[], object], max_tokens: int = MAX_JOB_TOKENS):
        self.worker = worker
        self.backend = backend  # the service's backend when the job runs (it attaches once loaded)
        self.max_tokens = max_tokens
        self._lock = threading.Lock()  # the waiting list is taken on the engine thread
        self._waiting: list[tuple[tuple, asyncio.Future]] = []
        self._busy = False  # an open job is queued or running: at most one at a time
        self.jobs = 0  # open jobs run (for tests)
        self.opens = 0  # opens they served

    async def open(self, prompt: list[int], meta, max_new_tokens: int) -> tuple[str, int, int, int]:
        """`backend.open(prompt, meta, max_new_tokens)`, in a job shared with
        the opens waiting beside it; with the number of opens its job took
        (the prefill span's `specdec.batch.sessions`)."""
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
        log.info("closing session %s: its OpenSession call was abandoned while it opened", session_id)
        asyncio.ensure_future(self.worker.run_quick(self.backend().close, session_id))

    async def _job(self) -> None:
        taken: list[tuple[tuple, asyncio.Future]] = []
        try:
            opening, results = await self.worker.run(self._take_and_start, taken)
            # One prefill pass an engine-thread job: what queued meanwhile (the
            # open sessions' rounds, the next opens) runs between two passes.
            while results is None:
                results = await self.worker.run(_advance, opening)
        except BaseException as exc:  # noqa: BLE001 - every open it holds gets an error, none waits forever
            with self._lock:  # (the engine thread takes under the lock too)
                started = bool(taken)
                if not started:  # it never ran (the service is stopping): what it would have taken
                    taken, self._waiting = self._waiting, []
            if not started or not isinstance(exc, Exception):
                exc = Unavailable("the service is stopping")
            results = [exc] * len(taken)
        for (_, future), result in zip(taken, results):
            if future.done():  # its caller went away: a session it opened is nobody's
                if not isinstance(result, BaseException):
                    self.close_orphan(result[0])
            elif isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result((*result, len(taken)))
        self._next_job()  # after the orphans' closes are queued: the next job may need their slots

    def _next_job(self) -> None:
        """A job ended: the opens that came meanwhile, or that it left for want
        of room, get the next one. One job at a time keeps one prefill pass at
        most queued ahead of the open sessions' rounds."""
        with self._lock:
            self._busy = bool(self._waiting)
        if self._busy:
            asyncio.ensure_future(self._job())

    def _take_and_start(self, taken: list):
        """On the engine thread: take the opens waiting now (up to
        `max_tokens` prompt tokens, one at least), open their sessions and
        run the first prefill pass: (the opening, with `done`, `step()` and
        `results()`; its results once done, else None)."""
        with self._lock:
            tokens, n = 0, 0
            for (prompt, _, _), _ in self._waiting:
                tokens += len(prompt)
                if n and tokens > self.max_tokens:
                    break
                n += 1
            taken.extend(self._waiting[:n])
            del self._waiting[:n]
        self.jobs += 1
        self.opens += len(taken)
        backend = self.backend()
        requests = [args for args, _ in taken]
        start_opening = getattr(backend, "start_opening", None)
        if start_opening is None:  # a backend without a model (prompt lookup): nothing to share
            return None, [_open_one(backend, args) for args in requests]
        opening = start_opening(requests)
        return opening, _advance(opening)


def _advance(opening) -> list | None:
    """On the engine thread: one prefill pass; each open's result once the last is done, else None."""
    opening.step()
    return opening.results() if opening.done else None


def _open_one(backend, args):
    try:
        return backend.open(*args)
    except Exception as exc:  # noqa: BLE001 - this open's problem only
        return exc
