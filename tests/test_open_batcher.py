"""Session opens batched: prompts prefilled together (ModelEngine.open_sessions,
specdec/engine/prefill.py) and OpenSession calls that arrive together sharing one
job, one prefill pass an engine-thread job (specdec/rpc/open_batcher.py)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest
import torch

from specdec.errors import InvalidArgument, ResourceExhausted, Unavailable
from specdec.engine.engine import ExtendItem
from specdec.rpc.open_batcher import OpenBatcher
from specdec.rpc.serving import EngineWorker
from tests.conftest import tiny_engine
from tests.harness import running_target
from tests.service_calls import decode, open_session, tokens

PROMPTS = [tokens(5, 1), tokens(1, 2), tokens(23, 3), tokens(9, 4)]  # one prompt of a single token


def _next_logits(engine, session_ids, token=7):
    """Each session's logits for one more token (its context as the cache holds it)."""
    return engine.extend([ExtendItem(sid, None, [token], num_logits=1) for sid in session_ids])


@pytest.mark.parametrize("chunk", [512, 8])  # 8: prompts split across passes, and passes shared
def test_prompts_opened_together_give_what_each_opened_alone_gives(chunk):
    engine = tiny_engine(prefill_chunk=chunk)
    alone = [engine.open_session(p) for p in PROMPTS]
    passes = []
    real_run = engine._run
    engine._run = lambda sessions, stops, num_logits: passes.append(len(sessions)) or real_run(sessions, stops,
                                                                                                num_logits)
    together = engine.open_sessions([(p, 0) for p in PROMPTS])
    engine._run = real_run
    assert [s.tokens for s in together] == PROMPTS
    assert [s.length for s in together] == [len(p) for p in PROMPTS]
    # 4 + 0 + 22 + 8 tokens to compute (each prompt less its last): one pass of 512; or five
    # of 8, the oldest waiting prompt taking half of each and the shortest others the rest:
    # the first and the last prompt, then the third and the last, then the third alone
    assert passes == ([3] if chunk == 512 else [2, 2, 1, 1, 1])
    a = _next_logits(engine, [s.id for s in alone])
    b = _next_logits(engine, [s.id for s in together])
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
        assert torch.argmax(x) == torch.argmax(y)


def test_a_refused_prompt_fails_alone_and_the_others_open():
    engine = tiny_engine(max_sessions=3)
    results = engine.open_sessions([(PROMPTS[0], 0), ([], 0), (PROMPTS[2], 0), (PROMPTS[3], 0), (PROMPTS[1], 0)])
    assert isinstance(results[1], InvalidArgument)
    assert isinstance(results[4], ResourceExhausted)  # three sessions were open by then
    assert [r.tokens for i, r in enumerate(results) if i in (0, 2, 3)] == [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    assert engine.num_sessions == 3


def test_a_failed_shared_pass_opens_each_session_alone():
    engine = tiny_engine()
    real_run = engine._run

    def run(sessions, stops, num_logits):
        if len(sessions) > 1:
            raise RuntimeError("injected: a shared pass failed")
        return real_run(sessions, stops, num_logits)

    engine._run = run
    results = engine.open_sessions([(p, 0) for p in PROMPTS])
    assert [r.tokens for r in results] == PROMPTS
    assert engine.num_sessions == len(PROMPTS)  # the shared pass's sessions were closed, then opened again
    engine._run = lambda *a: (_ for _ in ()).throw(RuntimeError("injected: every pass fails"))
    with pytest.raises(RuntimeError, match="every pass"):
        engine.open_session(PROMPTS[0])
    assert engine.num_sessions == len(PROMPTS)  # nothing held by the failed open
    opening = engine.start_opening([(PROMPTS[0], 0)])
    opening.step()
    assert opening.done and isinstance(opening.results()[0], RuntimeError)  # its error, its session closed
    assert engine.num_sessions == len(PROMPTS)


def test_an_opening_runs_one_pass_a_step_and_other_sessions_run_between():
    engine = tiny_engine(prefill_chunk=8)
    alone = [engine.open_session(p) for p in PROMPTS]
    running = engine.open_session(tokens(6, 9))
    before = _next_logits(engine, [running.id])[0]
    engine.rollback(running.id, 6)
    opening = engine.start_opening([(p, 0) for p in PROMPTS])
    steps = 0
    while not opening.done:
        opening.step()
        steps += 1
        # another session's round between two passes: its logits as without the opening
        torch.testing.assert_close(_next_logits(engine, [running.id])[0], before)
        engine.rollback(running.id, 6)
    assert steps == 5  # 34 tokens to compute, 8 a pass (the first test's split)
    together = opening.results()
    assert [s.tokens for s in together] == PROMPTS
    for x, y in zip(_next_logits(engine, [s.id for s in alone]), _next_logits(engine, [s.id for s in together])):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_a_short_prompt_joins_a_long_ones_prefill_and_is_ready_after_one_pass():
    engine = tiny_engine(prefill_chunk=8)
    long, short = tokens(31, 6), tokens(4, 7)
    alone = [engine.open_session(p) for p in (long, short)]
    opening = engine.start_opening([(long, 0)])
    opening.step()
    assert opening.take_ready() == [] and opening.pending_tokens == 30 - 8
    assert opening.add([(short, 0), ([], 0)]) == [1, 2]
    assert [(i, type(r)) for i, r in opening.take_ready()] == [(2, InvalidArgument)]  # refused at once
    opening.step()  # half the pass for the long prompt, the rest for the short one: all of it
    ((index, session),) = opening.take_ready()
    assert index == 1 and session.tokens == short and not session.opening
    passes = 0
    while not opening.done:
        opening.step()
        passes += 1
    assert passes == 3  # the long prompt's 22 - 5 tokens left (the pass's last token was its), 8 a pass
    ((_, long_session),) = opening.take_ready()
    assert long_session.tokens == long
    for x, y in zip(_next_logits(engine, [s.id for s in alone]), _next_logits(engine, [long_session.id, session.id])):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_an_abandoned_opening_closes_what_is_not_ready():
    engine = tiny_engine(prefill_chunk=8)
    opening = engine.start_opening([(tokens(3, 8), 0), (tokens(30, 9), 0)])
    opening.step()  # the short one is ready, the long one is not
    ((index, ready),) = opening.take_ready()
    assert index == 0
    opening.abandon()
    assert opening.done and engine.num_sessions == 1 and engine.session(ready.id) is ready
    assert isinstance(opening.results()[1], RuntimeError)


def test_a_session_being_opened_is_never_taken_as_idle():
    engine = tiny_engine(prefill_chunk=8)
    opening = engine.start_opening([(tokens(30, 5), 0)])
    while not opening.done:
        time.sleep(0.06)  # the engine busy elsewhere between two passes, past the idle limit
        assert engine.expire_idle(0.05) == []
        opening.step()
    (session,) = opening.results()
    assert engine.expire_idle(0.05) == []  # opened just now
    assert engine.session(session.id).length == 30
    time.sleep(0.06)
    assert engine.expire_idle(0.05) == [session.id]  # idle once open


def test_a_failed_pass_gives_its_error_to_its_own_request_only():
    engine = tiny_engine()
    real_run = engine._run
    engine._run = lambda *a: (_ for _ in ()).throw(RuntimeError("injected: the pass failed"))
    results = engine.open_sessions([([], 0), (PROMPTS[0], 0)])  # the first refused, the second's pass fails
    engine._run = real_run
    assert isinstance(results[0], InvalidArgument)
    assert isinstance(results[1], RuntimeError)
    assert engine.num_sessions == 0


class _Opening:
    """A fake opening: one pass per 512 prompt tokens (at least one), each
    noted in `log`; every open ready when the last pass is done."""

    def __init__(self, backend, label):
        self.backend, self.label, self.left, self.results, self.given = backend, label, 0, [], 0

    def add(self, requests):
        self.backend.calls.append([r[0] for r in requests])
        self.results += [InvalidArgument("prompt [0]") if r[0] == [0] else (f"s{r[0][0]}", len(r[0]), 1)
                         for r in requests]
        self.left += max(1, -(-sum(len(r[0]) for r in requests) // 512))

    @property
    def done(self):
        return self.left == 0

    @property
    def pending_tokens(self):
        return 512 * self.left

    def step(self):
        self.backend.log.append((self.label, self.left))
        self.left -= 1

    def abandon(self):
        self.backend.log.append((self.label, "abandoned"))
        self.left = 0

    def take_ready(self):
        if not self.done:
            return []
        ready = list(enumerate(self.results))[self.given:]
        self.given = len(self.results)
        return ready


class _Backend:
    """Records each opening's requests; fails the prompt [0]; one pass per
    512 prompt tokens, as the engine's default chunk."""

    def __init__(self):
        self.calls = []
        self.closed = []
        self.log = []

    def start_opening(self, requests):
        opening = _Opening(self, f"s{requests[0][0][0]}")
        opening.add(requests)
        return opening

    def close(self, session_id):
        self.closed.append(session_id)


class _NoModelBackend(_Backend):
    """A backend that opens each request at once (as the prompt-lookup drafter)."""

    start_opening = None

    def open(self, prompt, meta, max_new_tokens):
        self.calls.append(prompt)
        if prompt == [0]:
            raise InvalidArgument("prompt [0]")
        return f"s{prompt[0]}", len(prompt), 0


def _blocked(worker):
    """Occupy the engine thread until the returned event is set."""
    busy, release = threading.Event(), threading.Event()
    blocker = asyncio.ensure_future(worker.run(lambda: busy.set() or release.wait(10)))
    return blocker, busy, release


async def _opens_behind_a_busy_engine(batcher, prompts):
    blocker, busy, release = _blocked(batcher.worker)
    await asyncio.get_running_loop().run_in_executor(None, busy.wait, 10)
    opens = [asyncio.ensure_future(batcher.open(p, None, 0)) for p in prompts]
    await asyncio.sleep(0.05)
    release.set()
    results = await asyncio.gather(*opens, return_exceptions=True)
    await blocker
    return results


@pytest.mark.parametrize("kind", [_Backend, _NoModelBackend])
def test_opens_arriving_while_the_engine_is_busy_share_one_job(kind):
    backend = kind()

    async def main():
        worker = EngineWorker()
        batcher = OpenBatcher(worker, lambda: backend)
        results = await _opens_behind_a_busy_engine(batcher, [[1], [2], [0], [3]])
        assert batcher.jobs == 1 and batcher.opens == 4
        # alone afterwards: a job of its own, at once
        assert (await batcher.open([4], None, 0))[::3] == ("s4", 1)
        assert batcher.jobs == 2
        worker.shutdown()
        return results

    results = asyncio.run(main())
    # (session, its job's opens)
    assert [r[::3] for i, r in enumerate(results) if i != 2] == [("s1", 4), ("s2", 4), ("s3", 4)]
    assert isinstance(results[2], InvalidArgument)
    if kind is _Backend:
        assert backend.calls == [[[1], [2], [0], [3]], [[4]]]


def test_a_job_takes_at_most_its_tokens_and_leaves_the_rest_to_the_next():
    backend = _Backend()

    async def main():
        worker = EngineWorker()
        batcher = OpenBatcher(worker, lambda: backend, max_tokens=5)
        prompts = [[1, 1], [2, 2], [3, 3], [4] * 9, [5]]
        results = await _opens_behind_a_busy_engine(batcher, prompts)
        worker.shutdown()
        return results

    results = asyncio.run(main())
    assert [(r[0], r[3]) for r in results] == [("s1", 2), ("s2", 2), ("s3", 1), ("s4", 1), ("s5", 1)]
    # 2 + 2 fit in 5 tokens; a prompt longer than the budget goes alone
    assert backend.calls == [[[1, 1], [2, 2]], [[3, 3]], [[4] * 9], [[5]]]


def test_what_queues_behind_an_open_runs_between_its_passes_and_new_opens_join_it():
    backend = _Backend()
    pass_runs, release = threading.Event(), threading.Event()
    real_start = backend.start_opening

    def start_opening(requests):
        opening = real_start(requests)
        step = opening.step

        def second_pass_waits():
            if opening.left == 2:  # the first open's second pass: hold it
                pass_runs.set()
                release.wait(10)
            step()

        opening.step = second_pass_waits
        return opening

    backend.start_opening = start_opening

    async def main():
        worker = EngineWorker()
        batcher = OpenBatcher(worker, lambda: backend)
        opening = asyncio.ensure_future(batcher.open([1] * 1100, None, 0))  # three passes of 512
        await asyncio.get_running_loop().run_in_executor(None, pass_runs.wait, 10)
        rounds = asyncio.ensure_future(worker.run(lambda: backend.log.append("a round")))
        later = asyncio.ensure_future(batcher.open([2] * 10, None, 0))  # an open arriving meanwhile
        await asyncio.sleep(0.05)
        release.set()
        await rounds
        results = await asyncio.gather(opening, later)
        worker.shutdown()
        return results

    results = asyncio.run(main())
    # A round queued during a pass runs before the next pass; the open that arrived joins
    # the running job (one more pass to go), which answers both: one open job, never two.
    assert [r[::3] for r in results] == [("s1", 2), ("s2", 2)]
    assert backend.calls == [[[1] * 1100], [[2] * 10]]
    assert backend.log == [("s1", 3), ("s1", 2), "a round", ("s1", 2), ("s1", 1)]


def test_a_job_takes_at_most_its_opens_and_the_rest_come_in_the_next():
    backend = _Backend()

    async def main():
        worker = EngineWorker()
        batcher = OpenBatcher(worker, lambda: backend, max_opens=3)
        results = await _opens_behind_a_busy_engine(batcher, [[i] for i in range(1, 8)])
        worker.shutdown()
        return results

    results = asyncio.run(main())
    assert [r[0] for r in results] == [f"s{i}" for i in range(1, 8)]
    assert backend.calls == [[[1], [2], [3]], [[4], [5], [6]], [[7]]]


def test_a_lone_open_runs_at_once_and_an_abandoned_one_is_closed():
    backend = _Backend()

    async def main():
        worker = EngineWorker()
        batcher = OpenBatcher(worker, lambda: backend)
        assert await batcher.open([5], None, 0) == ("s5", 1, 1, 1)
        assert batcher.jobs == 1 and backend.calls == [[[5]]]
        opening, release = threading.Event(), threading.Event()
        real_start = backend.start_opening
        backend.start_opening = lambda requests: opening.set() or release.wait(10) and real_start(requests)
        waiting = asyncio.ensure_future(batcher.open([6], None, 0))
        await asyncio.get_running_loop().run_in_executor(None, opening.wait, 10)
        waiting.cancel()  # its caller went away while its job ran: the job opens it all the same
        release.set()
        for _ in range(100):
            if backend.closed:
                break
            await asyncio.sleep(0.01)
        worker.shutdown()

    asyncio.run(main())
    assert backend.closed == ["s6"]


def test_an_open_cancelled_after_its_job_answered_closes_its_session():
    """grpc cancels the handler when the call's deadline passes: that can land
    after the job set the open's result and before the handler woke to take it."""
    backend = _Backend()

    class AnsweredThenCancelled(asyncio.Future):
        def set_result(self, result):
            super().set_result(result)
            if isinstance(result, tuple):  # the open's answer, not the engine job's
                opening.cancel()  # the same loop turn, before the awaiting task wakes

    async def main():
        nonlocal opening
        worker = EngineWorker()
        batcher = OpenBatcher(worker, lambda: backend)
        loop = asyncio.get_running_loop()
        loop.create_future = lambda: AnsweredThenCancelled(loop=loop)
        opening = asyncio.ensure_future(batcher.open([7], None, 0))
        with pytest.raises(asyncio.CancelledError):
            await opening
        for _ in range(100):
            if backend.closed:
                break
            await asyncio.sleep(0.01)
        worker.shutdown()

    opening = None
    asyncio.run(main())
    assert backend.calls == [[[7]]] and backend.closed == ["s7"]


def test_an_open_abandoned_before_its_job_took_it_is_not_opened():
    backend = _Backend()

    async def main():
        worker = EngineWorker()
        batcher = OpenBatcher(worker, lambda: backend)
        blocker, busy, release = _blocked(worker)
        await asyncio.get_running_loop().run_in_executor(None, busy.wait, 10)
        gone = asyncio.ensure_future(batcher.open([8], None, 0))
        await asyncio.sleep(0.02)
        gone.cancel()  # its caller went away while the open waited for the engine
        staying = asyncio.ensure_future(batcher.open([9], None, 0))
        await asyncio.sleep(0.02)
        release.set()
        result = await staying
        await blocker
        worker.shutdown()
        return result

    assert asyncio.run(main())[::3] == ("s9", 1)
    assert backend.calls == [[[9]]] and backend.closed == []


def test_opens_whose_job_cannot_run_get_an_error_and_no_one_waits():
    def loading():
        raise Unavailable("the model is still loading")

    async def main():
        worker = EngineWorker()
        batcher = OpenBatcher(worker, loading)
        results = await _opens_behind_a_busy_engine(batcher, [[1], [2]])
        worker.shutdown()  # a job that cannot even be queued: the service is stopping
        with pytest.raises(Unavailable, match="stopping"):
            await asyncio.wait_for(batcher.open([3], None, 0), 5)
        return results

    assert all(isinstance(r, Unavailable) for r in asyncio.run(main()))


def test_concurrent_open_session_calls_share_prefill_passes_and_decode_as_alone():
    engine = tiny_engine(seed=0)
    prompts = [tokens(4 + i, 10 + i) for i in range(12)]
    with running_target(engine) as (service, stub, loop):
        expected = []
        for p in prompts:  # one at a time: a job each
            sid = open_session(stub, p).session_id
            expected.append(list(decode(stub, sid, 3).token_ids))
        batcher = service.servicer.opens
        jobs_before = batcher.jobs

        async def hold_the_engine():
            return _blocked(batcher.worker)

        blocker, busy, release = loop.run(hold_the_engine())
        assert busy.wait(10)
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            opening = [pool.submit(lambda p=p: open_session(stub, p).session_id) for p in prompts]
            deadline = time.monotonic() + 30
            while len(batcher._waiting) < len(prompts):  # every call has reached the service
                assert time.monotonic() < deadline, "the opens never arrived"
                time.sleep(0.01)
            release.set()
            sids = [f.result(30) for f in opening]
        assert batcher.jobs - jobs_before == 1  # 150 prompt tokens: one job
        assert len(set(sids)) == len(prompts)
        assert [list(decode(stub, sid, 3).token_ids) for sid in sids] == expected
