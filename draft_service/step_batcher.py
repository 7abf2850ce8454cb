"""Continuous batching of draft steps across concurrent Propose streams.

Each Propose call registers its `DraftStream`; while any stream is active, one
driver task runs `drafter.step_many(all active streams)` on the engine thread,
one batched forward pass per step, and hands each stream its token as soon as
the pass ends. A stream joins at the next pass after it arrives and leaves
when it has its k tokens, fails, or its caller goes away. One stream alone
costs what it did before batching (no waiting window); n streams share each
pass, so the draft's throughput grows with concurrency the way the target's
does with batched verification.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

from draft_service.drafters import DraftStream, DraftToken

log = logging.getLogger(__name__)


class DraftStepBatcher:
    def __init__(self, worker, drafter, max_batch: int = 64):
        self.worker = worker
        self.drafter = drafter
        self.max_batch = max_batch
        self._active: dict[DraftStream, asyncio.Queue] = {}
        self._driver: asyncio.Task | None = None
        self.passes = 0  # forward passes run (for tests and metrics)
        self.steps = 0  # draft tokens made

    async def stream(self, stream: DraftStream) -> AsyncIterator[tuple[DraftToken, float]]:
        """Yield (token, compute seconds of the pass that made it) until the stream ends;
        raises the stream's own error if it hits one."""
        queue: asyncio.Queue = asyncio.Queue()
        self._active[stream] = queue
        if self._driver is None or self._driver.done():
            self._driver = asyncio.ensure_future(self._drive())
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._active.pop(stream, None)

    async def _drive(self) -> None:
        try:
            while self._active:
                await self._one_pass()
        except BaseException as exc:
            # Never leave a caller waiting on a driver that is gone.
            log.exception("the draft step driver stopped")
            for queue in self._active.values():
                queue.put_nowait(exc if isinstance(exc, Exception) else None)
            self._active.clear()
            raise

    async def _one_pass(self) -> None:
        streams = list(self._active)[: self.max_batch]
        try:
            results, seconds = await self.worker.run(_timed, self.drafter.step_many, streams)
        except Exception as exc:  # a bug, not one stream's problem: fail this pass, keep serving
            log.exception("draft step failed")
            results, seconds = [exc] * len(streams), 0.0
        self.passes += 1
        for stream, result in zip(streams, results):
            queue = self._active.get(stream)
            if queue is None:  # its caller went away during the pass
                continue
            if result is None or isinstance(result, BaseException):
                queue.put_nowait(result)
                self._active.pop(stream, None)
                continue
            self.steps += 1
            queue.put_nowait((result, seconds))
            if stream.done:
                queue.put_nowait(None)
                self._active.pop(stream, None)
            elif len(self._active) > self.max_batch:
                # Served streams go to the back, so that a full batch does not
                # always leave the same streams out.
                self._active[stream] = self._active.pop(stream)


def _timed(fn, *args):
    """fn(*args) and its duration, measured on the engine thread itself (not
    the wait for the thread)."""
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start
