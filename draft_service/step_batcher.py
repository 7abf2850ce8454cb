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

# The kinds of job for EngineWorker.run_short / is_short: one draft step, and
# a lone stream's steps run ahead as one job (ModelDrafter.chain_steps).
STEP = "draft step"
CHAIN = "draft steps, run ahead"

# A session whose Propose came within this many seconds of another session's
# may be drafting beside it: its steps go where they can share passes.
ALONE_S = 1.0

# A Propose whose first step appends more tokens than this (a request back to
# speculating after plain rounds, a client's long append) runs on the engine
# thread: `is_short` times one token's step, and that catch-up pass on the
# event loop held every other call (health checks included) for all of it.
LOOP_APPEND_TOKENS = 2


class DraftStepBatcher:
    def __init__(self, worker, drafter, max_batch: int = 64):
        self.worker = worker
        self.drafter = drafter
        self.max_batch = max_batch
        self._active: dict[DraftStream, asyncio.Queue] = {}
        self._driver: asyncio.Task | None = None
        self._collecting: set[DraftStream] = set()  # streams whose caller wants all tokens at once
        # Propose calls noted and streams registered so far; a job of several
        # steps stops when it moves (see note_caller).
        self._arrivals = 0
        self._recent: dict[str, float] = {}  # session id -> when it last asked for drafts (note_caller)
        self.passes = 0  # forward passes run (for tests and metrics)
        self.steps = 0  # draft tokens made
        self._run_ahead = bool(getattr(drafter, "run_ahead", False))
        # Calls whose start (their validation, an engine job) is queued or
        # running: the next pass waits for them (`_one_pass`).
        self._starting = 0
        self._no_starts = asyncio.Event()

    async def stream(self, stream: DraftStream) -> AsyncIterator[tuple[DraftToken, float]]:
        """Yield (token, compute seconds of the pass that made it) until the stream ends;
        raises the stream's own error if it hits one."""
        queue: asyncio.Queue = asyncio.Queue()
        self._active[stream] = queue
        self._arrivals += 1
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

    async def collect(self, stream: DraftStream) -> list[tuple[DraftToken, float]]:
        """All of the stream's (token, compute seconds), at once. A caller
        that uses no token before the last needs no hand-off per token: while
        every stream of a pass is collected, the pass's steps run back to back
        in one engine-thread job, until a stream ends or a new one arrives
        (which then joins the next step, as with streaming)."""
        self._collecting.add(stream)
        try:
            return [item async for item in self.stream(stream)]
        finally:
            self._collecting.discard(stream)

    def note_caller(self, session_id: str) -> bool:
        """Note that `session_id` asks for drafts now; True when no other
        session did in the last `ALONE_S` seconds (then no other request is
        drafting, and there are no passes to share).

        It also counts as an arrival: a job running several steps back to
        back stops after its current step (unless one step is left), so that
        the new call's start (the catch-up forward of its appended tokens, a
        job of its own) runs next and its stream joins the following pass.
        Counted only when the stream registered, a call waited behind a whole
        multi-step job of the other streams (on the CPU pair at 4 streams
        under goodput, ~0.3 s a round beyond its own compute)."""
        self._arrivals += 1
        now = time.monotonic()
        self._recent[session_id] = now
        if len(self._recent) > 1:
            for sid in [sid for sid, t in self._recent.items() if t < now - ALONE_S]:
                del self._recent[sid]
        return len(self._recent) == 1

    def forget(self, session_ids) -> None:
        """`session_ids` were closed: they draft beside no one any more. A
        request that follows another's on its own is alone from its first
        round, not ALONE_S after the other's last one (on the tiny pair,
        the whole of a 256-token request would otherwise have taken the
        shared passes' two thread hand-offs a round)."""
        for session_id in session_ids:
            self._recent.pop(session_id, None)

    async def start_and_collect(self, start, session_id: str = "",
                                appended: int = 0) -> list[tuple[DraftToken, float]]:
        """`collect(start())`, where `start` makes the DraftStream on the
        engine thread. With no other stream active, the start and the steps
        run as ONE engine-thread job, which a stream arriving meanwhile stops
        after its current step, the rest of the call then joining the shared
        passes. When no other session has asked for drafts lately
        (`note_caller`), nothing could share them: if its steps are short
        (`EngineWorker.is_short`) and its first appends at most
        LOOP_APPEND_TOKENS (`appended`: tokens the call appends), each runs
        right on the event loop, which saves the two thread hand-offs of a
        job, and the loop serves other calls between steps; otherwise the one
        job does."""
        alone = self.note_caller(session_id)
        if self._active or not alone:
            # Others draft now, or may any moment (their Verify batch answered
            # them together): the shared passes. A job of its own here would
            # be a pass for this stream alone, and each call arriving while it
            # ran would queue one more: after a Verify of 8 sessions, 5-8 solo
            # passes a round before any was shared (12 passes for 4 tokens).
            self._starting += 1
            try:
                stream = await self.worker.run_quick(start)  # on the loop when the engine is idle
            finally:
                self._starting -= 1
                if not self._starting:
                    self._no_starts.set()
            return await self.collect(stream)  # registers it before the driver runs again
        arrivals = self._arrivals
        more = lambda: self._arrivals == arrivals  # noqa: E731
        if alone and appended <= LOOP_APPEND_TOKENS and self.worker.is_short(CHAIN if self._run_ahead else STEP):
            return await self._steps_on_the_loop(start, arrivals, more)
        stream, steps = await self.worker.run(_start_and_step, start, self._job, more)
        if steps:  # what the loop path's is_short reads: one step, or a whole job run ahead
            self.worker.note(*((CHAIN, sum(s for _, s in steps)) if self._run_ahead
                               else (STEP, max(s for _, s in steps))))
        return await self._take(stream, steps, [])

    async def _steps_on_the_loop(self, start, arrivals: int, more) -> list[tuple[DraftToken, float]]:
        """A lone stream's steps on the event loop while the engine is idle
        and its steps short (on the engine thread, queued, otherwise): run
        ahead, all of them as one job; else as many back to back as fit in
        about the worker's `inline_max_s` (one at least), yielding to the
        loop between such jobs. A stream arriving meanwhile makes the rest
        join the shared passes."""
        stream = await self.worker.run_quick(start)
        tokens: list[tuple[DraftToken, float]] = []
        while True:
            if self._run_ahead:
                steps = await self.worker.run_short(CHAIN, self._job, [stream], more)
            else:
                # On the loop when short, as run_short would; noted as is_short weighs it: a step, not the job.
                steps = (self._lone_steps(stream, more) if self.worker.is_short(STEP)
                         else await self.worker.run(self._lone_steps, stream, more))
                self.worker.note(STEP, max(s for _, s in steps))
            if stream.done or self._arrivals != arrivals or any(not isinstance(r, DraftToken) for (r,), _ in steps):
                return await self._take(stream, steps, tokens)
            await self._take(None, steps, tokens)
            await asyncio.sleep(0)  # let the loop answer other calls between jobs

    def _lone_steps(self, stream: DraftStream, more) -> list[tuple[list, float]]:
        """A lone stream's steps back to back while the next would still end
        within `inline_max_s` of the first's start (one step at least), or
        is the stream's last, and `more()` says no stream has arrived (on the
        engine thread one may). Each step on a turn of the loop of its own
        paid that turn's Python cold after the forward pass: ~0.09 ms a step
        on the dev VM. A last step left to a job of its own paid a whole turn
        of the loop between the two jobs, 155 µs there (`specd overhead
        --hops` with probes in the handler: four 3 ms steps against the 10 ms
        limit), for a wait of at most one more step; `_timed_steps` keeps a
        job's last step the same way."""
        until = time.perf_counter() + self.worker.inline_max_s
        steps = []
        while True:
            start = time.perf_counter()
            results = self.drafter.step_many([stream])
            now = time.perf_counter()
            steps.append((results, now - start))
            if (stream.done or not isinstance(results[0], DraftToken) or not more()
                    or (now + (now - start) > until and stream.k - stream.produced > 1)):
                return steps

    def _job(self, streams: list[DraftStream], more) -> list[tuple[list, float]]:
        """An engine-thread job of one or several steps (see _timed_steps):
        run ahead on the device when the drafter does (ModelDrafter.chain_steps),
        else step after step."""
        if self._run_ahead:
            return self.drafter.chain_steps(streams, more)
        return _timed_steps(self.drafter.step_many, streams, more)

    async def _take(self, stream: DraftStream | None, steps, tokens: list) -> list[tuple[DraftToken, float]]:
        """Append the tokens of a lone stream's `steps` to `tokens`; raise its
        error; with `stream` given and not done, collect the rest of its
        tokens from the shared passes."""
        for (result,), seconds in steps:
            self.passes += 1
            if result is None:
                return tokens
            if isinstance(result, BaseException):
                raise result
            self.steps += 1
            tokens.append((result, seconds))
        if stream is not None and not stream.done:
            tokens += await self.collect(stream)
        return tokens

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
        # Calls that arrived while the last pass ran have their starts queued
        # on the engine thread ahead of this pass: waiting for them costs the
        # engine nothing, and they take part in this pass instead of the next
        # (after a Verify of 8 sessions the first passes were 1 row each).
        while self._starting:
            self._no_starts.clear()
            await self._no_starts.wait()
        streams = list(self._active)[: self.max_batch]
        if not streams:  # every caller left while the starts ran
            return
        arrivals = self._arrivals
        if self._run_ahead:
            await self._pass_ahead(streams, arrivals)
            return
        # Read on the engine thread between steps: an int read is atomic.
        more = (lambda: self._arrivals == arrivals) if all(s in self._collecting for s in streams) else None
        try:
            steps = await self.worker.run(self._job, streams, more)
        except Exception as exc:  # a bug, not one stream's problem: fail this pass, keep serving
            log.exception("draft step failed")
            steps = [([exc] * len(streams), 0.0)]
        for results, seconds in steps:
            self._deliver(streams, results, seconds)

    async def _pass_ahead(self, streams: list[DraftStream], arrivals: int) -> None:
        """A pass whose steps run ahead: streamed callers too get several
        steps in one job, each step's tokens handed to them as the job reads
        it (while the next step runs), so a stream's consumer sees each token
        as soon as stepping one at a time would show it. The job stops after
        its current step once a stream arrives or one of its streams' callers
        goes away (pipelining drops a wrong guess's stream), as a collected
        pass stops for an arrival."""
        loop = asyncio.get_running_loop()

        def on_step(results: list, seconds: float) -> None:  # on the engine thread
            loop.call_soon_threadsafe(self._deliver, streams, results, seconds)

        # Read on the engine thread between steps: an int read and a dict lookup are atomic.
        more = lambda: self._arrivals == arrivals and all(s in self._active for s in streams)  # noqa: E731
        try:
            await self.worker.run(self.drafter.chain_steps, streams, more, on_step)
        except Exception as exc:  # a bug, not one stream's problem: fail this pass, keep serving
            log.exception("draft step failed")
            self._deliver(streams, [exc] * len(streams), 0.0)

    def _deliver(self, streams: list[DraftStream], results: list, seconds: float) -> None:
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
            if result.index + 1 >= stream.k:  # its last token (later steps of the job may have run)
                queue.put_nowait(None)
                self._active.pop(stream, None)
            elif len(self._active) > self.max_batch:
                # Served streams go to the back, so that a full batch does not
                # always leave the same streams out.
                self._active[stream] = self._active.pop(stream)


def _timed_steps(step_many, streams: list[DraftStream], more) -> list[tuple[list, float]]:
    """(results, seconds) of one step of `streams`, or of several while every
    stream got a token and is not done, and `more()` says no stream has
    arrived since (or the job has at most one step left: a call arriving
    then waits that step rather than split the job); each step's duration
    measured on the engine thread itself (not the wait for the thread)."""
    steps = []
    while True:
        start = time.perf_counter()
        results = step_many(streams)
        steps.append((results, time.perf_counter() - start))
        # A stream that is done leaves now: its tokens are delivered after the job, and
        # another step would make it wait a forward pass it has no part in.
        if (more is None or any(not isinstance(r, DraftToken) for r in results)
                or any(s.done for s in streams)):
            return steps
        if not more() and min(s.k - s.produced for s in streams) > 1:
            return steps


def _start_and_step(start, job, more) -> tuple[DraftStream, list[tuple[list, float]]]:
    stream = start()
    return stream, job([stream], more)
