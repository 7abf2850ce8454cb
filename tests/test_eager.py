"""specdec.eager.start_now: a coroutine's first step at once, the rest as a Task."""
from __future__ import annotations

import asyncio
import contextvars
import logging

import pytest

from specdec.eager import start_now

VAR = contextvars.ContextVar("VAR", default="unset")


def run(main):
    return asyncio.run(main())


def test_a_coroutine_that_never_waits_finishes_before_start_now_returns():
    async def main():
        seen = []

        async def ready():
            return "ready"

        async def handler():
            seen.append(await ready())  # an await that never suspends
            seen.append("done")
            return 42

        assert start_now(handler()) is None
        assert seen == ["ready", "done"]

    run(main)


def test_the_rest_after_a_wait_runs_as_a_task_that_gets_what_it_waited_for():
    async def main():
        order = []
        fut = asyncio.get_running_loop().create_future()

        async def handler():
            order.append("first step")
            value = await fut
            order.append(("resumed with", value))
            await asyncio.sleep(0)  # a bare yield too
            order.append("after a bare yield")
            return value * 2

        task = start_now(handler())
        assert order == ["first step"] and isinstance(task, asyncio.Task) and not task.done()
        fut.set_result(21)
        assert await task == 42
        assert order == ["first step", ("resumed with", 21), "after a bare yield"]

    run(main)


def test_an_exception_from_what_it_awaited_reaches_the_coroutine():
    async def main():
        fut = asyncio.get_running_loop().create_future()

        async def handler():
            try:
                await fut
            except KeyError as exc:
                return f"caught {exc.args[0]}"

        task = start_now(handler())
        fut.set_exception(KeyError("x"))
        assert await task == "caught x"

        async def fails_later():
            await asyncio.sleep(0)
            raise ValueError("later")

        with pytest.raises(ValueError, match="later"):
            await start_now(fails_later())

    run(main)


def test_cancelling_the_task_cancels_the_coroutine_where_it_waits():
    async def main():
        fut = asyncio.get_running_loop().create_future()
        cleaned = []

        async def handler():
            try:
                await fut
            finally:
                cleaned.append("finally ran")

        task = start_now(handler())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cleaned == ["finally ran"] and fut.cancelled()

    run(main)


def test_an_exception_in_the_first_step_is_logged_not_raised(caplog):
    async def main():
        async def handler():
            raise RuntimeError("at once")

        cancelled = asyncio.get_running_loop().create_future()
        cancelled.cancel()

        async def awaits_a_cancelled_future():
            await cancelled  # raises at once, without waiting

        with caplog.at_level(logging.ERROR, logger="specdec.eager"):
            assert start_now(handler()) is None
            assert start_now(awaits_a_cancelled_future()) is None  # ends as a cancelled task would: quietly
        assert "at once" in caplog.text and caplog.text.count("failed") == 1

    run(main)


def test_both_steps_share_one_context_of_their_own():
    async def main():
        fut = asyncio.get_running_loop().create_future()

        async def handler():
            VAR.set("set in the first step")
            await fut
            return VAR.get()

        task = start_now(handler())
        assert VAR.get() == "unset", "the caller's context is not touched"
        fut.set_result(None)
        assert await task == "set in the first step"

    run(main)
