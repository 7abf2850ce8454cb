"""Session opens batched: the prefills of OpenSession calls that arrive
together share forward passes.

A burst of requests (a client's wave of streams, a soak's start, the
sessions of a failed replica re-opened here) opens its sessions at once, and
each open is a prefill. One after another on the engine thread, the last of
n opens waited for n forward passes. Here an open joins the open job that is
queued on the engine thread, as long as that job has not started: when it
starts, the job takes every open waiting at that moment and prefills their
prompts together (the backend's `open_many`; `ModelEngine.open_sessions`
packs them into passes of `prefill_chunk` tokens). Opens arriving while it
runs wait for it, as they would have anyway, and go together in the next.

There is no waiting window: a lone open's job starts as soon as the engine
thread is free, as before. Each open gets its own session or its own error,
whatever else shared its job.
"""
from __future__ import annotations

import asyncio
import threading

from specdec.errors import Unavailable


class OpenBatcher:
    def __init__(self, worker):
        self.worker = worker
        self._lock = threading.Lock()  # the waiting list is taken on the engine thread
        self._waiting: list[tuple[tuple, asyncio.Future]] = []
        self.jobs = 0  # open jobs run (for tests)
        self.opens = 0  # opens they served

    async def open(self, backend, prompt: list[int], meta, max_new_tokens: int) -> tuple[str, int, int]:
        """`backend.open(prompt, meta, max_new_tokens)`, in a job shared with
        the opens waiting beside it."""
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._waiting.append(((prompt, meta, max_new_tokens), future))
            queue_a_job = len(self._waiting) == 1  # else the job queued for the others takes this one too
        if queue_a_job:
            asyncio.ensure_future(self._job(backend))
        return await future

    async def _job(self, backend) -> None:
        taken: list[tuple[tuple, asyncio.Future]] = []
        try:
            results = await self.worker.run(self._take_and_open, backend, taken)
        except BaseException as exc:  # noqa: BLE001 - every open it holds gets the error, none waits forever
            if not taken:  # it never started (the service is stopping): what it would have taken
                with self._lock:
                    taken, self._waiting = self._waiting, []
            error = exc if isinstance(exc, Exception) else Unavailable("the service is stopping")
            results = [error] * len(taken)
        for (_, future), result in zip(taken, results):
            if future.done():  # its caller went away: a session it opened is nobody's
                if not isinstance(result, BaseException):
                    asyncio.ensure_future(self.worker.run_quick(backend.close, result[0]))
            elif isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    def _take_and_open(self, backend, taken: list) -> list:
        """On the engine thread: take every open waiting now, and open them."""
        with self._lock:
            taken.extend(self._waiting)
            self._waiting = []
        requests = [args for args, _ in taken]
        self.jobs += 1
        self.opens += len(requests)
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
