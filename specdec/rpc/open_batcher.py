"""Session opens batched: the prefills of OpenSession calls that arrive
together share forward passes.

A burst of requests (a client's wave of streams, a soak's start, the
sessions of a failed replica re-opened here) opens its sessions at once, and
each open is a prefill. One after another on the engine thread, the last of
n opens waited for n forward passes. Here an open joins the open job that is
queued on the engine thread, as long as that job has not started: when it
starts, the job takes the opens waiting at that moment, up to `max_tokens`
prompt tokens (at least one open), and prefills their prompts together (the
backend's `open_many`; `ModelEngine.open_sessions` packs them into passes of
`prefill_chunk` tokens). What it leaves, and opens arriving while it runs,
go in the next job.

There is no waiting window: a lone open's job starts as soon as the engine
thread is free, as before. An open that joins a queued job runs ahead of
jobs queued after that one (a round's verify, a draft step): `max_tokens`
bounds how far. Each open gets its own session or its own error, whatever
else shared its job.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

from specdec.errors import Unavailable

log = logging.getLogger(__name__)

# Prompt tokens one open job takes at most: four of the engine's default
# prefill passes (512 tokens each).
MAX_JOB_TOKENS = 2048


class OpenBatcher:
    def __init__(self, worker, backend: Callable[[], object], max_tokens: int = MAX_JOB_TOKENS):
        self.worker = worker
        self.backend = backend  # the service's backend when the job runs (it attaches once loaded)
        self.max_tokens = max_tokens
        self._lock = threading.Lock()  # the waiting list is taken on the engine thread
        self._waiting: list[tuple[tuple, asyncio.Future]] = []
        self._queued = False  # a job is queued on the engine thread and has not taken its opens yet
        self.jobs = 0  # open jobs run (for tests)
        self.opens = 0  # opens they served

    async def open(self, prompt: list[int], meta, max_new_tokens: int) -> tuple[str, int, int, int]:
        """`backend.open(prompt, meta, max_new_tokens)`, in a job shared with
        the opens waiting beside it; with the number of opens its job took
        (the prefill span's `specdec.batch.sessions`)."""
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._waiting.append(((prompt, meta, max_new_tokens), future))
            queue_a_job = not self._queued  # else the job queued already takes this one too
            self._queued = True
        if queue_a_job:
            asyncio.ensure_future(self._job())
        try:
            return await future
        except asyncio.CancelledError:
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
            results = await self.worker.run(self._take_and_open, taken)
        except BaseException as exc:  # noqa: BLE001 - every open it holds gets an error, none waits forever
            if not taken:  # it never started (the service is stopping): what it would have taken
                with self._lock:
                    taken, self._waiting, self._queued = self._waiting, [], False
            results = [exc if isinstance(exc, Exception) else Unavailable("the service is stopping")] * len(taken)
        with self._lock:  # opens it left behind for want of room get a job of their own
            queue_a_job = bool(self._waiting) and not self._queued
            self._queued = self._queued or queue_a_job
        if queue_a_job:
            asyncio.ensure_future(self._job())
        for (_, future), result in zip(taken, results):
            if future.done():  # its caller went away: a session it opened is nobody's
                if not isinstance(result, BaseException):
                    self.close_orphan(result[0])
            elif isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result((*result, len(taken)))

    def _take_and_open(self, taken: list) -> list:
        """On the engine thread: take the opens waiting now (up to
        `max_tokens` prompt tokens, one at least), and open them."""
        with self._lock:
            tokens, n = 0, 0
            for (prompt, _, _), _ in self._waiting:
                tokens += len(prompt)
                if n and tokens > self.max_tokens:
                    break
                n += 1
            taken.extend(self._waiting[:n])
            del self._waiting[:n]
            self._queued = False
        self.jobs += 1
        self.opens += len(taken)
        backend = self.backend()
        requests = [args for args, _ in taken]
        open_many = getattr(backend, "open_many", None)
        if open_many is not None:
            return open_many(requests)
        out = []
        for args in requests:  # a backend without a model (prompt lookup): nothing to share
            try:
                out.append(backend.open(*args))
            except Exception as exc:  # noqa: BLE001 - this open's problem only
                out.append(exc)
        return out
