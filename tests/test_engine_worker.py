"""EngineWorker: jobs on the engine thread, short ones on the event loop when
the engine is idle, and an exact count of what the thread still holds."""
from __future__ import annotations

import asyncio
import threading

from specdec.rpc.serving import EngineWorker

T = 10.0


def _thread_name() -> str:
    return threading.current_thread().name


def test_run_short_learns_then_runs_short_jobs_on_the_loop():
    async def main():
        worker = EngineWorker("eng", inline_max_s=1.0)
        try:
            loop_thread = _thread_name()
            # The first job of a kind goes to the thread: its cost is unknown.
            assert (await worker.run_short("k", _thread_name)).startswith("eng")
            # Known to be short, engine idle: right here on the loop.
            assert await worker.run_short("k", _thread_name) == loop_thread
            assert worker.idle
            # Another kind is learned on its own.
            assert (await worker.run_short("other", _thread_name)).startswith("eng")
        finally:
            worker.shutdown()

    asyncio.run(main())


def test_run_short_keeps_long_jobs_and_a_busy_engine_on_the_thread():
    async def main():
        worker = EngineWorker("eng", inline_max_s=0.0)  # every job is too long to inline
        gate = threading.Event()
        try:
            await worker.run_short("k", _thread_name)
            assert (await worker.run_short("k", _thread_name)).startswith("eng")
            worker.inline_max_s = 1.0
            blocker = asyncio.ensure_future(worker.run(gate.wait, T))
            await asyncio.sleep(0.05)
            assert not worker.idle
            # Short, but a job holds the engine: queued behind it, order kept.
            behind = asyncio.ensure_future(worker.run_short("k", _thread_name))
            quick = asyncio.ensure_future(worker.run_quick(_thread_name))
            await asyncio.sleep(0.05)
            assert not behind.done() and not quick.done()
            gate.set()
            assert await blocker
            assert (await behind).startswith("eng") and (await quick).startswith("eng")
            assert worker.idle
        finally:
            gate.set()
            worker.shutdown()

    asyncio.run(main())


def test_a_cancelled_caller_leaves_the_engine_busy_until_its_job_ends():
    """Cancelling the awaiting coroutine does not stop a running job: the
    worker must not report idle (and run another job on the loop beside it)
    until the thread is done; a job cancelled before it started is not
    counted as pending forever."""
    async def main():
        worker = EngineWorker("eng")
        gate = threading.Event()
        try:
            running = asyncio.ensure_future(worker.run(gate.wait, T))
            queued = asyncio.ensure_future(worker.run(_thread_name))
            await asyncio.sleep(0.05)
            running.cancel()
            queued.cancel()
            await asyncio.sleep(0.05)
            assert not worker.idle  # gate.wait still runs on the thread
            gate.set()
            for _ in range(200):
                if worker.idle:
                    break
                await asyncio.sleep(0.01)
            assert worker.idle
            assert await worker.run_quick(_thread_name) == _thread_name()
        finally:
            gate.set()
            worker.shutdown()

    asyncio.run(main())


def test_a_services_inline_limit_is_its_inline_max_ms():
    """--inline-max-ms reaches the service's worker: 0 keeps every Verify on
    the engine thread, however short."""
    from tests.conftest import tiny_engine
    from tests.harness import local_config, running_target
    from tests.service_calls import TARGET_MODEL, open_session, verify
    from specdec.v1 import target_pb2

    for limit_ms, inline in ((0.0, False), (1e4, True)):
        with running_target(tiny_engine(model=TARGET_MODEL), server_cfg=local_config(inline_max_ms=limit_ms)) as (
                service, stub, _):
            assert service.worker.inline_max_s == limit_ms / 1e3
            sid = open_session(stub, [5, 6, 7], temperature=0).session_id
            for _ in range(2):  # the first Verify is learned on the thread
                verify(stub, target_pb2.VerifyItem(session_id=sid, draft_token_ids=[8]))
            assert service.worker.is_short("verify") is inline
