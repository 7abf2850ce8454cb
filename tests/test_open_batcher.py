"""Session opens batched: prompts prefilled together (ModelEngine.open_sessions)
and OpenSession calls that arrive together sharing one job (specdec/rpc/open_batcher.py)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest
import torch

from specdec.errors import InvalidArgument, ResourceExhausted
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
    # of 8, the first shared by the first and the third prompt, the fourth by the third and the last
    assert passes == ([3] if chunk == 512 else [2, 1, 1, 2, 1])
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


class _Backend:
    """Records each open_many call's requests; fails the prompt [0]."""

    def __init__(self):
        self.calls = []
        self.closed = []

    def open_many(self, requests):
        self.calls.append([r[0] for r in requests])
        return [InvalidArgument("prompt [0]") if r[0] == [0] else (f"s{r[0][0]}", len(r[0]), 1) for r in requests]

    def close(self, session_id):
        self.closed.append(session_id)


def test_opens_arriving_while_the_engine_is_busy_share_one_job():
    async def main():
        worker = EngineWorker()
        batcher, backend = OpenBatcher(worker), _Backend()
        busy, release = threading.Event(), threading.Event()
        blocker = asyncio.ensure_future(worker.run(lambda: busy.set() or release.wait(10)))
        await asyncio.get_running_loop().run_in_executor(None, busy.wait, 10)
        opens = [asyncio.ensure_future(batcher.open(backend, [i], None, 0)) for i in (1, 2, 0, 3)]
        await asyncio.sleep(0.05)
        assert backend.calls == []  # all four wait behind the busy engine
        release.set()
        results = await asyncio.gather(*opens, return_exceptions=True)
        await blocker
        # alone afterwards: a job of its own, at once
        assert await batcher.open(backend, [4], None, 0) == ("s4", 1, 1)
        worker.shutdown()
        return results

    results = asyncio.run(main())
    assert results[:2] == [("s1", 1, 1), ("s2", 1, 1)] and results[3] == ("s3", 1, 1)
    assert isinstance(results[2], InvalidArgument)


def test_a_lone_open_runs_at_once_and_an_abandoned_one_is_closed():
    async def main():
        worker = EngineWorker()
        batcher, backend = OpenBatcher(worker), _Backend()
        assert await batcher.open(backend, [5], None, 0) == ("s5", 1, 1)
        assert batcher.jobs == 1 and backend.calls == [[[5]]]
        waiting = asyncio.ensure_future(batcher.open(backend, [6], None, 0))
        await asyncio.sleep(0)
        waiting.cancel()  # its caller went away before the job answered
        for _ in range(100):
            if backend.closed:
                break
            await asyncio.sleep(0.01)
        worker.shutdown()
        return backend.closed

    assert asyncio.run(main()) == ["s6"]


def test_concurrent_open_session_calls_share_prefill_passes_and_decode_as_alone():
    engine = tiny_engine(seed=0)
    prompts = [tokens(4 + i, 10 + i) for i in range(12)]
    with running_target(engine) as (service, stub, _):
        expected = []
        for p in prompts:  # one at a time: a job each
            sid = open_session(stub, p).session_id
            expected.append(list(decode(stub, sid, 3).token_ids))
        jobs_before = service.servicer.opens.jobs
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            sids = list(pool.map(lambda p: open_session(stub, p).session_id, prompts))
        jobs = service.servicer.opens.jobs - jobs_before
        assert len(set(sids)) == len(prompts)
        assert [list(decode(stub, sid, 3).token_ids) for sid in sids] == expected
    assert jobs < len(prompts), "no two of twelve concurrent opens shared a job"
