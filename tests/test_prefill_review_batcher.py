"""Review of batched session opens (OpenBatcher over a real tiny engine):
opens that share a job, with different lengths, identical prompts, refusals
(too long, bad ids, no room) and cancellations mid-prefill, each answered with
its own session or error, every session's logits those of a fresh forward,
and no KV slot leaked."""
from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from specdec.engine.engine import ExtendItem
from specdec.errors import InvalidArgument, ResourceExhausted
from specdec.rpc.model_service import EngineBackend
from specdec.rpc.open_batcher import OpenBatcher
from specdec.rpc.serving import EngineWorker
from tests.conftest import TINY_VOCAB, tiny_engine

ATOL = 1e-4


def reference_logits(engine, tokens):
    with torch.inference_mode():
        return engine.model(torch.tensor([tokens])).logits[0]


def check_next_logits(engine, sid, prompt):
    (logits,) = engine.extend([ExtendItem(sid, None, [], 1)])
    torch.testing.assert_close(logits, reference_logits(engine, prompt)[-1:], atol=ATOL, rtol=0)


def _prompt(rng, n):
    return [rng.randrange(3, TINY_VOCAB) for _ in range(n)]


async def _settle(worker, engine, want_sessions, timeout=10.0):
    """Wait until the orphans' closes have run."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        n = await worker.run(lambda: engine.num_sessions)
        if n == want_sessions or loop.time() > deadline:
            return n
        await asyncio.sleep(0.01)


def test_opens_sharing_a_job_each_get_their_own_session_or_error():
    engine = tiny_engine(max_context=48, prefill_chunk=5, max_sessions=6)
    rng = random.Random(1)
    same = _prompt(rng, 17)
    prompts = [same, _prompt(rng, 3), list(same), [], _prompt(rng, 4) + [TINY_VOCAB],
               _prompt(rng, 48), _prompt(rng, 40), [7], list(same), _prompt(rng, 30), _prompt(rng, 2)]
    max_new = [0, 0, 5, 0, 0, 0, 9, 0, 31, 0, 0]  # 48 tokens exactly; 40 + 9 > 48; 17 + 31 = 48

    async def main():
        worker = EngineWorker()
        backend = EngineBackend(engine)
        batcher = OpenBatcher(worker, lambda: backend)
        busy, release = threading.Event(), threading.Event()
        blocker = asyncio.ensure_future(worker.run(lambda: busy.set() or release.wait(10)))
        await asyncio.get_running_loop().run_in_executor(None, busy.wait, 10)
        opens = [asyncio.ensure_future(batcher.open(p, None, m)) for p, m in zip(prompts, max_new)]
        await asyncio.sleep(0.05)
        release.set()
        results = await asyncio.gather(*opens, return_exceptions=True)
        await blocker
        worker.shutdown()
        return results, batcher.jobs

    results, jobs = asyncio.run(main())
    kinds = [type(r).__name__ if isinstance(r, Exception) else "ok" for r in results]
    # the empty prompt, the bad id and the over-long one refused; six slots: the last two find none
    assert kinds == ["ok", "ok", "ok", "InvalidArgument", "InvalidArgument", "ok", "InvalidArgument",
                     "ok", "ok", "ResourceExhausted", "ResourceExhausted"], kinds
    ids = [r[0] for r in results if not isinstance(r, Exception)]
    assert len(set(ids)) == len(ids) == engine.num_sessions == engine.store.slots_in_use == 6
    for r, p in zip(results, prompts):
        if not isinstance(r, Exception):
            assert r[1] == len(p)
            check_next_logits(engine, r[0], p)


@pytest.mark.parametrize("seed", range(4))
def test_random_opens_with_cancellations_leak_no_slot_and_match_a_fresh_forward(seed):
    rng = random.Random(seed)
    engine = tiny_engine(max_context=64, prefill_chunk=6, max_sessions=8)

    async def main():
        worker = EngineWorker()
        backend = EngineBackend(engine)
        batcher = OpenBatcher(worker, lambda: backend, max_tokens=rng.choice([8, 40, 2048]),
                              max_opens=rng.choice([2, 64]))
        kept = {}
        for _ in range(4):  # waves of opens, some cancelled at random points
            prompts = [_prompt(rng, rng.randrange(1, 64)) for _ in range(rng.randrange(1, 7))]
            opens = []
            for p in prompts:
                opens.append(asyncio.ensure_future(batcher.open(p, None, 0)))
                if rng.random() < 0.5:
                    await asyncio.sleep(0)
            cancelled = set()
            for _ in range(rng.randrange(0, 6)):
                await asyncio.sleep(rng.choice([0, 0.001, 0.003]))
                i = rng.randrange(len(opens))
                opens[i].cancel()
                cancelled.add(i)
            results = await asyncio.gather(*opens, return_exceptions=True)
            for i, (p, r) in enumerate(zip(prompts, results)):
                if isinstance(r, asyncio.CancelledError):
                    assert i in cancelled
                elif isinstance(r, ResourceExhausted):
                    pass
                else:
                    assert not isinstance(r, BaseException), r
                    kept[r[0]] = p
            assert await _settle(worker, engine, len(kept)) == len(kept)
            # close some of what is open
            for sid in rng.sample(sorted(kept), len(kept) // 2):
                assert await worker.run(engine.close, sid)
                del kept[sid]
        worker.shutdown()
        return kept

    kept = asyncio.run(main())
    assert engine.num_sessions == len(kept) == engine.store.slots_in_use
    assert {s.id for s in engine._sessions.values()} == set(kept)
    assert not any(s.opening for s in engine._sessions.values())
    for sid, p in kept.items():
        check_next_logits(engine, sid, p)


def test_a_job_after_the_engine_thread_stopped_is_unavailable_not_internal():
    """A job handed to the engine thread after a drain stopped it (an open's
    next prefill pass, say) raised the pool's RuntimeError, which callers
    saw as INTERNAL; the service is going away, so it is UNAVAILABLE."""
    import asyncio

    from specdec.errors import Unavailable
    from specdec.rpc.serving import EngineWorker

    async def run():
        worker = EngineWorker()
        assert await worker.run(lambda: 3) == 3
        worker.shutdown()
        with pytest.raises(Unavailable, match="shutting down"):
            await worker.run(lambda: 4)
        assert worker.pending == 0

    asyncio.run(run())


def test_an_open_cancelled_mid_prefill_leaves_the_job_at_the_next_pass():
    """A long prompt whose caller went away while it was being computed used
    to hold the engine for all its passes, for nobody; now it leaves the job
    at the next pass, its session closed, and an open sharing the job is
    answered as before."""
    engine = tiny_engine(max_context=256, prefill_chunk=4, max_sessions=4)
    rng = random.Random(3)
    long_prompt, short = _prompt(rng, 200), _prompt(rng, 9)
    passes = []
    compute = engine.compute_up_to

    def counted(batch, stops):
        passes.append([len(s.tokens) for s in batch])
        return compute(batch, stops)

    engine.compute_up_to = counted

    async def main():
        worker = EngineWorker()
        backend = EngineBackend(engine)
        batcher = OpenBatcher(worker, lambda: backend)
        gone = asyncio.ensure_future(batcher.open(long_prompt, None, 0))
        kept = asyncio.ensure_future(batcher.open(short, None, 0))
        while len(passes) < 3:  # a few passes into the long prompt's 50
            await asyncio.sleep(0.001)
        gone.cancel()
        result = await kept
        with pytest.raises(asyncio.CancelledError):
            await gone
        left = await _settle(worker, engine, 1)
        done_passes = len(passes)
        await asyncio.sleep(0.1)
        worker.shutdown()
        return result, left, done_passes

    (sid, *_), left, done_passes = asyncio.run(main())
    assert left == 1 and engine.store.slots_in_use == 1, "the abandoned open's session is closed"
    assert done_passes < 20, f"{done_passes} passes: the cancelled prompt's 200 tokens were computed anyway"
    check_next_logits(engine, sid, short)
