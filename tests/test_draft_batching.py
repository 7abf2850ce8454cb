"""Draft steps of concurrent Propose streams share forward passes
(draft_service/step_batcher.py): the same drafts as alone, fewer passes than
tokens, one stream's failure confined to it."""
from __future__ import annotations

import concurrent.futures

import pytest

from draft_service.drafters import ModelDrafter
from specdec.errors import NotFound
from specdec.rpc.model_service import SessionMeta
from specdec.sampling.params import SamplingParams
from tests.conftest import tiny_engine, tiny_model
from tests.harness import running_draft
from tests.test_services import open_session, propose

PROMPTS = [[5 + (3 * i + j) % 100 for j in range(4 + 3 * i)] for i in range(6)]


@pytest.fixture
def peaked_engine():
    return tiny_engine(model=tiny_model(seed=2, init_range=0.3))


def test_batched_steps_make_the_drafts_each_stream_makes_alone(peaked_engine):
    greedy = SessionMeta(params=SamplingParams(0.0, 0, 1.0), seed=1)
    sampled = SessionMeta(params=SamplingParams(0.9, 0, 1.0), seed=7)
    alone, batched = ModelDrafter(peaked_engine), ModelDrafter(tiny_engine(model=tiny_model(seed=2, init_range=0.3)))

    def drafts_alone(i):
        sid, _, _ = alone.open(PROMPTS[i], greedy if i % 2 else sampled, 16)
        return [d.token_id for d in alone.propose(sid, None, [], 5)]

    expected = [drafts_alone(i) for i in range(len(PROMPTS))]
    streams = []
    for i, prompt in enumerate(PROMPTS):
        sid, _, _ = batched.open(prompt, greedy if i % 2 else sampled, 16)
        streams.append(batched.propose(sid, None, [], 5 if i != 2 else 2))
    got = [[] for _ in PROMPTS]
    for _ in range(5):
        for i, result in enumerate(batched.step_many(streams)):
            if result is not None:
                got[i].append(result.token_id)
    assert got[2] == expected[2][:2], "a stream ends after its own k"
    assert [g for i, g in enumerate(got) if i != 2] == [e for i, e in enumerate(expected) if i != 2]
    assert all(s.done for s in streams)
    assert batched.step_many(streams) == [None] * len(streams)


def test_a_stream_whose_step_fails_gets_the_error_and_the_others_their_tokens(peaked_engine):
    drafter = ModelDrafter(peaked_engine)
    meta = SessionMeta(params=SamplingParams(0.0, 0, 1.0), seed=1)
    sids = [drafter.open(p, meta, 16)[0] for p in PROMPTS[:3]]
    streams = [drafter.propose(sid, None, [], 3) for sid in sids]
    peaked_engine.close(sids[1])  # gone behind the drafter's back: the batch fails validation
    results = drafter.step_many(streams)
    assert isinstance(results[1], NotFound)
    assert results[0] is not None and results[2] is not None
    assert not isinstance(results[0], Exception) and not isinstance(results[2], Exception)


def test_a_batched_first_step_that_fails_is_retried_alone_without_appending_twice(peaked_engine, monkeypatch):
    """A batched pass that fails after the cuts and appends (out of memory on
    the batch, say) is retried stream by stream: each stream's first step
    repeats its cut and append whole, also for a call that kept the whole
    context (keep_length unset), and drafts what it drafts alone."""
    meta = SessionMeta(params=SamplingParams(0.0, 0, 1.0), seed=1)
    alone = ModelDrafter(tiny_engine(model=tiny_model(seed=2, init_range=0.3)))
    sid = alone.open([5, 6, 7, 8], meta, 16)[0]
    expected = alone.step_many([alone.propose(sid, None, [20, 21], 2)])[0].token_id

    drafter = ModelDrafter(peaked_engine)
    a, b = drafter.open([5, 6, 7, 8], meta, 16)[0], drafter.open([9, 10, 11], meta, 16)[0]
    forward = peaked_engine._forward

    def no_batches(sessions, *args, **kwargs):
        if len(sessions) > 1:
            raise RuntimeError("out of memory for the batch (simulated)")
        return forward(sessions, *args, **kwargs)

    monkeypatch.setattr(peaked_engine, "_forward", no_batches)
    results = drafter.step_many([drafter.propose(a, None, [20, 21], 2), drafter.propose(b, 3, [30], 2)])
    assert not any(isinstance(r, Exception) for r in results), results
    assert results[0].token_id == expected
    assert peaked_engine.session(a).tokens == [5, 6, 7, 8, 20, 21, expected]
    assert peaked_engine.session(b).tokens[:4] == [9, 10, 11, 30]


def test_concurrent_propose_calls_share_forward_passes(peaked_engine):
    with running_draft(peaked_engine) as (service, stub, _loop):
        sids = [open_session(stub, p, temperature=0).session_id for p in PROMPTS]
        expected = {sid: [d.token_id for d in propose(stub, sid, 6)] for sid in sids}
        steps = service.servicer.steps
        passes, made = steps.passes, steps.steps
        keep = {sid: len(p) for sid, p in zip(sids, PROMPTS)}

        def again(sid):  # cut back to the prompt and draft the same 6 tokens again
            return sid, [d.token_id for d in propose(stub, sid, 6, keep=keep[sid])]

        with concurrent.futures.ThreadPoolExecutor(len(sids)) as pool:
            results = dict(pool.map(again, sids))
        assert results == expected
        assert steps.steps - made == 6 * len(sids)
        assert steps.passes - passes < steps.steps - made, "no two streams ever shared a pass"


def test_an_unexpected_error_in_one_streams_step_stays_with_that_stream(peaked_engine, monkeypatch):
    drafter = ModelDrafter(peaked_engine)
    meta = SessionMeta(params=SamplingParams(0.0, 0, 1.0), seed=1)
    streams = [drafter.propose(drafter.open(p, meta, 16)[0], None, [], 3) for p in PROMPTS[:3]]
    append_tokens = peaked_engine.append_tokens

    def flaky(session_id, tokens, **kwargs):  # the step's batched pass succeeds; keeping one stream's draft fails
        if session_id == streams[1].session_id:
            raise RuntimeError("a fault in one stream's step")
        return append_tokens(session_id, tokens, **kwargs)

    monkeypatch.setattr(peaked_engine, "append_tokens", flaky)
    results = drafter.step_many(streams)
    assert isinstance(results[1], RuntimeError)
    assert [r.index for r in (results[0], results[2])] == [0, 0]


def test_more_streams_than_a_pass_holds_all_finish_with_their_own_drafts(peaked_engine):
    with running_draft(peaked_engine) as (service, stub, _loop):
        sids = [open_session(stub, p, temperature=0).session_id for p in PROMPTS]
        expected = {sid: [d.token_id for d in propose(stub, sid, 5)] for sid in sids}
        service.servicer.steps.max_batch = 2
        keep = {sid: len(p) for sid, p in zip(sids, PROMPTS)}
        with concurrent.futures.ThreadPoolExecutor(len(sids)) as pool:
            results = dict(pool.map(lambda sid: (sid, [d.token_id for d in propose(stub, sid, 5, keep=keep[sid])]),
                                    sids))
        assert results == expected


def test_a_session_drafting_alone_is_told_so_until_another_session_drafts(monkeypatch):
    """Only a session with no other drafting beside it may run its steps on
    the event loop (nothing could share its passes)."""
    import draft_service.step_batcher as sb

    now = [100.0]
    monkeypatch.setattr(sb.time, "monotonic", lambda: now[0])
    batcher = sb.DraftStepBatcher(worker=None, drafter=None)
    assert batcher.note_caller("a") and batcher.note_caller("a")
    now[0] += 0.5
    assert not batcher.note_caller("b")  # a drafted half a second ago
    assert not batcher.note_caller("a")
    now[0] += sb.ALONE_S + 0.1
    assert batcher.note_caller("b")  # a has been quiet long enough


def test_a_closed_session_drafts_beside_no_one(monkeypatch):
    """A request that follows another's on its own is alone from its first
    Propose once the other's session is closed, not ALONE_S later."""
    import draft_service.step_batcher as sb

    now = [100.0]
    monkeypatch.setattr(sb.time, "monotonic", lambda: now[0])
    batcher = sb.DraftStepBatcher(worker=None, drafter=None)
    assert batcher.note_caller("a")
    now[0] += 0.1
    assert not batcher.note_caller("b"), "a drafted a tenth of a second ago"
    batcher.forget(["a", "never-seen"])
    assert batcher.note_caller("b"), "a is closed: b drafts alone"


def test_a_session_closed_or_expired_on_the_service_no_longer_counts_as_drafting(peaked_engine):
    """CloseSession (and idle expiry, through the same hook) tells the step
    batcher: the next session's Propose is alone, so its short steps may run
    on the event loop instead of the shared passes' engine-thread job."""
    from tests.service_calls import close

    with running_draft(peaked_engine) as (service, stub, loop):
        first = open_session(stub, PROMPTS[0], temperature=0).session_id
        propose(stub, first, 3)
        second = open_session(stub, PROMPTS[1], temperature=0).session_id
        close(stub, first)
        steps = service.servicer.steps
        assert loop.run(_alone(steps, second)), "the closed session still counted as drafting beside it"
        service.servicer.sessions_closed([second])  # what the reaper calls for expired sessions
        assert loop.run(_alone(steps, "third"))


async def _alone(steps, session_id: str) -> bool:
    return steps.note_caller(session_id)


class _CountingDrafter:
    """Makes token 7 for every live stream, noting the thread of each step,
    the streams it took, and how often the event loop ran other work."""

    def __init__(self, loop_ticks: list[int]):
        self.loop_ticks = loop_ticks
        self.steps: list[tuple[str, int, int]] = []  # (thread, streams in the pass, loop ticks so far)
        self.on_step = None

    def propose(self, k: int, sid: str = "s"):
        from draft_service.drafters import DraftStream

        return DraftStream(self, sid, k, owner=None)

    def step_many(self, streams):
        import threading

        from draft_service.drafters import DraftToken

        self.steps.append((threading.current_thread().name, len(streams), self.loop_ticks[0]))
        if self.on_step is not None:
            self.on_step()
        out = []
        for st in streams:
            if st.done:
                out.append(None)
                continue
            st.produced += 1
            out.append(DraftToken(index=st.produced - 1, token_id=7, q=None, length=10 + st.produced))
        return out


def test_a_lone_streams_short_steps_run_on_the_event_loop_as_many_as_fit_in_its_budget(monkeypatch):
    """Once a draft step is known to be short, a stream drafting alone runs
    its steps right on the event loop (no engine-thread hand-off): back to
    back while the next would end within the worker's inline_max_s, and the
    loop serves other work between such jobs; a stream arriving meanwhile
    makes the rest of the call share passes with it."""
    import asyncio
    import threading

    import draft_service.step_batcher as sb
    from draft_service.step_batcher import DraftStepBatcher
    from specdec.rpc.serving import EngineWorker

    clock = [0.0]  # the steps' own clock: each step takes `step_s` of it
    monkeypatch.setattr(sb.time, "perf_counter", lambda: clock[0])

    async def run():
        ticks = [0]

        async def ticker():  # other work on the loop: counts loop iterations
            while True:
                ticks[0] += 1
                await asyncio.sleep(0)

        background = asyncio.ensure_future(ticker())
        worker = EngineWorker("eng", inline_max_s=0.05)
        drafter = _CountingDrafter(ticks)
        step_s = [0.02]
        drafter.on_step = lambda: clock.__setitem__(0, clock[0] + step_s[0])
        batcher = DraftStepBatcher(worker, drafter)
        loop_thread = threading.current_thread().name
        try:
            first = await batcher.start_and_collect(lambda: drafter.propose(3), "s")
            assert [d.index for d, _ in first] == [0, 1, 2]
            assert {t for t, _, _ in drafter.steps} == {"eng_0"}, "unknown step cost: one engine-thread job"
            # 20 ms steps in a 50 ms budget: two a job (a third would end at 60 ms), the loop between jobs.
            drafter.steps.clear()
            second = await batcher.start_and_collect(lambda: drafter.propose(4), "s")
            assert [d.index for d, _ in second] == [0, 1, 2, 3]
            assert [t for t, _, _ in drafter.steps] == [loop_thread] * 4
            seen = [tick for _, _, tick in drafter.steps]
            assert seen[0] == seen[1] < seen[2] == seen[3], seen
            # A first step that appends many tokens (a catch-up after plain rounds) is no
            # short step: it ran on the loop and held every other call for all of it.
            drafter.steps.clear()
            caught_up = await batcher.start_and_collect(lambda: drafter.propose(2), "s", appended=500)
            assert [d.index for d, _ in caught_up] == [0, 1]
            assert {t for t, _, _ in drafter.steps} == {"eng_0"}
            # 30 ms steps: one a job, but a stream's last step is never left to a job of its own.
            step_s[0] = 0.03
            drafter.steps.clear()
            third = await batcher.start_and_collect(lambda: drafter.propose(3), "s")
            assert [d.index for d, _ in third] == [0, 1, 2]
            seen = [tick for t, _, tick in drafter.steps if t == loop_thread]
            assert len(seen) == 3 and seen[0] < seen[1] == seen[2], seen
            # Another stream arrives during the first step: the rest share passes with it.
            drafter.steps.clear()
            other = drafter.propose(4, "t")
            joined: list = []

            async def consume():
                joined.extend([item async for item in batcher.stream(other)])

            arrivals: list = []

            def step():
                clock[0] += step_s[0]
                if not arrivals:
                    arrivals.append(asyncio.ensure_future(consume()))

            drafter.on_step = step
            fourth = await batcher.start_and_collect(lambda: drafter.propose(4), "s")
            await arrivals[0]
            assert [d.index for d, _ in fourth] == [0, 1, 2, 3] and len(joined) == 4
            assert max(n for _, n, _ in drafter.steps) == 2, "the two streams never shared a pass"
        finally:
            background.cancel()
            worker.shutdown()

    asyncio.run(run())


def test_a_new_propose_stops_a_running_multi_step_job_so_it_waits_at_most_a_step():
    """A stream drafting alone runs its steps back to back in one engine job.
    A Propose arriving meanwhile must not wait for all of them: its arrival
    stops that job after the current step, its own start runs next, and the
    two then share passes."""
    import asyncio
    import threading
    import time as _time

    from draft_service.step_batcher import DraftStepBatcher
    from specdec.rpc.serving import EngineWorker

    class Recording(_CountingDrafter):
        def step_many(self, streams):
            self.sids.append(tuple(sorted(st.session_id for st in streams if not st.done)))
            return super().step_many(streams)

    async def run():
        worker = EngineWorker("eng")
        drafter = Recording([0])
        drafter.sids = []
        # a's second step (on the engine thread, inside its one job of ten
        # steps) lasts until b's call has arrived: b arrives mid-job, whatever the load.
        in_second_step, b_arrived = threading.Event(), threading.Event()

        def step():
            if len(drafter.sids) == 2:
                in_second_step.set()
                assert b_arrived.wait(30), "b never arrived"

        drafter.on_step = step
        batcher = DraftStepBatcher(worker, drafter)
        try:
            a = asyncio.ensure_future(batcher.start_and_collect(lambda: drafter.propose(10, "a"), "a"))
            deadline = _time.monotonic() + 30
            while not in_second_step.is_set():
                assert _time.monotonic() < deadline, drafter.sids
                await asyncio.sleep(0.001)
            # b's call notes its arrival before its first await; this runs once it awaits (its start,
            # queued behind a's job on the engine thread), and lets a's second step end.
            asyncio.get_running_loop().call_soon(b_arrived.set)
            b = await batcher.start_and_collect(lambda: drafter.propose(4, "b"), "b")
            got_a = await a
        finally:
            b_arrived.set()
            worker.shutdown()
        return got_a, b, drafter.sids

    got_a, got_b, sids = asyncio.run(run())
    assert [d.index for d, _ in got_a] == list(range(10)) and [d.index for d, _ in got_b] == [0, 1, 2, 3]
    # b arrived during a's second step: a's job stops after it (before the
    # fix, b came after all ten of a's steps), and b's start, then the shared passes, follow.
    assert sids[:3] == [("a",), ("a",), ("a", "b")], sids
    assert sum(1 for s in sids if s == ("a", "b")) >= 1, "the two share passes"


def test_calls_arriving_together_after_a_verify_share_every_pass_after_the_first():
    """After a batched Verify its sessions' Propose calls arrive within a few
    milliseconds. Those arriving while the first call's pass runs join the
    next pass, all of them: none runs a pass of its own (before: each call
    that found no stream registered ran its own first step, 12 passes for 4
    tokens of 8 sessions on a GPU host's timing, instead of 5)."""
    import asyncio
    import threading

    from draft_service.step_batcher import DraftStepBatcher
    from specdec.rpc.serving import EngineWorker

    async def run():
        worker = EngineWorker("eng")
        drafter = _CountingDrafter([0])
        entered, release = threading.Event(), threading.Event()

        def first_step_blocks():
            entered.set()
            release.wait(10)

        drafter.on_step = first_step_blocks
        batcher = DraftStepBatcher(worker, drafter)
        try:
            batcher.note_caller("s7")  # the sessions drafted a round ago: none is alone
            calls = [asyncio.ensure_future(batcher.start_and_collect(lambda: drafter.propose(4, "s0"), "s0"))]
            while not entered.is_set():
                await asyncio.sleep(0.001)
            calls += [asyncio.ensure_future(batcher.start_and_collect(lambda i=i: drafter.propose(4, f"s{i}"), f"s{i}"))
                      for i in range(1, 8)]
            await asyncio.sleep(0.05)  # all seven arrived while the first pass runs
            drafter.on_step = None
            release.set()
            got = await asyncio.wait_for(asyncio.gather(*calls), 10)
        finally:
            release.set()
            worker.shutdown()
        return got, [n for _, n, _ in drafter.steps]

    got, rows = asyncio.run(run())
    assert all([d.index for d, _ in drafts] == [0, 1, 2, 3] for drafts in got)
    assert len(rows) == 5 and rows[1:4] == [8, 8, 8], rows  # the fifth: the seven's last token
