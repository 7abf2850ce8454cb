"""Start a coroutine now, on the caller's turn of the event loop.

`asyncio.ensure_future(coro)` runs none of `coro` until the loop's next turn.
A lane's call (specdec/rpc/lane_server.py) arrives in the connection's
`data_received`, and a lone round's call never has to wait: the draft's steps
and the target's verify run right on the loop when they are short
(`EngineWorker.run_short`). Started at once, such a call is answered inside
the `data_received` that read it, without the task's turn of the loop (a
turn that ran cold, just after the wake-up: ~0.1 ms a call on the dev VM).

`start_now` is what Python 3.12's eager tasks do (`asyncio.eager_task_factory`),
for 3.11 too: the first step runs here, in a copy of the current context; if
the coroutine then waits, a Task takes over the rest, in that same context,
and drives it exactly as if it had run from the start (what it waits on, a
cancellation thrown in). Unlike 3.12's, the first step runs in no task:
`asyncio.current_task()` is the caller's (none, in a protocol's callback), so
it must not open an `asyncio.timeout`, which needs one; after the first wait
it runs in its Task.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Coroutine

log = logging.getLogger(__name__)


def start_now(coro: Coroutine) -> asyncio.Task | None:
    """Run `coro` until it first waits. None when it finished meanwhile (its
    result dropped; an exception it raised logged, a cancellation not: a
    protocol's callback that calls this never sees either), else the Task
    running the rest of it."""
    context = contextvars.copy_context()
    try:
        awaited = context.run(coro.send, None)
    except (StopIteration, asyncio.CancelledError):  # done, or cancelled as a task would end: quietly
        return None
    except Exception:  # noqa: BLE001 - as a task would have held it: logged, not raised into our caller
        log.exception("a coroutine started at once failed")
        return None
    return asyncio.get_running_loop().create_task(_rest(coro, awaited), context=context)


async def _rest(coro: Coroutine, awaited):
    return await _Resumed(coro, awaited)


class _Resumed:
    """Awaiting it continues `coro`, which last yielded `awaited`: what the
    coroutine yields goes to the Task driving this one, and what the Task
    sends or throws (a result, a cancellation) goes back to the coroutine,
    as `yield from` would pass them had it started the coroutine itself."""

    __slots__ = ("coro", "awaited")

    def __init__(self, coro: Coroutine, awaited):
        self.coro = coro
        self.awaited = awaited

    def __await__(self):
        coro, value = self.coro, self.awaited
        self.coro = self.awaited = None
        while True:
            try:
                sent = yield value
            except BaseException as exc:  # noqa: BLE001 - thrown in by the Task (a cancellation): the coroutine's to handle
                try:
                    value = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as done:
                    return done.value
