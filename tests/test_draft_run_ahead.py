"""A Propose's draft steps run ahead (ModelDrafter.chain_steps): each step is
fed the step before's picks on the device and queued before the host reads
them. These tests force it on the CPU (`run_ahead="on"`; auto is on for a GPU
only) and check that it drafts exactly what stepping one at a time drafts:
the same tokens, proposal distributions q, confidences and context lengths,
round after round (so the sessions' caches stay right), across batches of
streams with different k, sampling settings and min_confidence stops, and
through the services, where greedy output equals target-only and a seeded
sampled request gives the same tokens with and without it."""
from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch

from draft_service.drafters import DraftToken, ModelDrafter
from specdec.engine.engine import ExtendItem
from specdec.errors import NotFound
from specdec.rpc.model_service import SessionMeta
from specdec.sampling.params import SamplingParams
from tests.conftest import tiny_engine, tiny_model
from tests.harness import DEADLINE_S, running_system
from tests.test_orchestrator import GREEDY_PROMPTS, greedy_reference, perturbed, same_as_reference

PROMPTS = [[5 + (7 * i + j) % 90 for j in range(3 + 2 * i)] for i in range(5)]
METAS = [
    SessionMeta(params=SamplingParams(0.0, 0, 1.0), seed=1),
    SessionMeta(params=SamplingParams(0.9, 0, 1.0), seed=7),
    SessionMeta(params=SamplingParams(0.7, 20, 1.0), seed=11),
    SessionMeta(params=SamplingParams(1.1, 0, 0.8), seed=5),
    SessionMeta(params=SamplingParams(0.0, 0, 1.0), seed=3),
]


def pair_of_drafters(**kwargs):
    """Two drafters over engines of the same weights: one steps one at a
    time, one runs ahead."""
    def engine():
        return tiny_engine(model=tiny_model(seed=2, init_range=0.3), **kwargs)

    return ModelDrafter(engine(), run_ahead="off"), ModelDrafter(engine(), run_ahead="on")


def summary(token):
    q = None if token.q is None else (token.q.token_ids.tolist(), token.q.probs.tolist())
    return token.index, token.token_id, q, token.confidence, token.length


def one_by_one(drafter, streams):
    got = [[] for _ in streams]
    while not all(s.done for s in streams):
        for i, result in enumerate(drafter.step_many(streams)):
            if result is not None:
                got[i].append(summary(result))
    return got


def chained(drafter, streams, more=lambda: True):
    got, jobs = [[] for _ in streams], 0
    while not all(s.done for s in streams):
        jobs += 1
        for results, seconds in drafter.chain_steps(streams, more):
            assert seconds >= 0
            for i, result in enumerate(results):
                assert not isinstance(result, Exception), result
                if result is not None:
                    got[i].append(summary(result))
    return got, jobs


def rounds(drafter, ks, min_confidence, run, together=True):
    """Three rounds of Proposes on five sessions (`together`: stepped as one
    batch; else one at a time); between rounds each session keeps part of
    its drafts and appends a token, as after a verify."""
    sids = [drafter.open(p, m, 64)[0] for p, m in zip(PROMPTS, METAS)]
    out = []
    for r in range(3):
        streams = []
        for j, sid in enumerate(sids):
            session = drafter.engine.session(sid)
            keep = None if r == 0 else session.length - (j + r) % 3
            streams.append(drafter.propose(sid, keep, [] if r == 0 else [40 + j], ks[(j + r) % len(ks)],
                                           min_confidence=min_confidence))
        out.append(run(drafter, streams) if together else [run(drafter, [st])[0] for st in streams])
    return out


@pytest.mark.parametrize("ks,min_confidence,together", [((4,), 0.0, True), ((1, 3, 5, 2), 0.0, True),
                                                        ((6, 4), 0.05, False)])
def test_chained_steps_draft_what_steps_one_at_a_time_draft(ks, min_confidence, together):
    stepwise, ahead = pair_of_drafters()
    expected = rounds(stepwise, ks, min_confidence, one_by_one, together)
    got = rounds(ahead, ks, min_confidence, lambda d, s: chained(d, s)[0], together)
    assert got == expected
    if min_confidence:
        lengths = [len(tokens) for one_round in expected for tokens in one_round]
        assert min(lengths) < min(ks), "no stream stopped early: the min_confidence case is not exercised"


def test_a_batch_whose_streams_stop_early_drafts_the_same_tokens_within_rounding():
    """When a stream of a batch stops on min_confidence, the step queued
    ahead still had it in its batch, where stepping one at a time would not:
    the other streams' values may then differ in their last bits (a batch's
    size is not bit-neutral for the kernels), and nothing more."""
    stepwise, ahead = pair_of_drafters()
    expected = rounds(stepwise, (6, 4), 0.05, one_by_one)
    got = rounds(ahead, (6, 4), 0.05, lambda d, s: chained(d, s)[0])
    lengths = [len(tokens) for one_round in expected for tokens in one_round]
    assert min(lengths) < 4 and max(lengths) > min(lengths), "no stream stopped early beside one that went on"
    for one_got, one_expected in zip(got, expected):
        for g_stream, e_stream in zip(one_got, one_expected):
            assert [t[:2] + t[4:] for t in g_stream] == [t[:2] + t[4:] for t in e_stream], "tokens or lengths differ"
            for g, e in zip(g_stream, e_stream):
                assert g[3] == pytest.approx(e[3], rel=1e-4)
                if e[2] is not None:
                    assert g[2][0] == e[2][0] and g[2][1] == pytest.approx(e[2][1], rel=1e-4, abs=1e-7)


def test_chained_steps_through_padded_fixed_shape_steps():
    """The static steps (CUDA graphs on a GPU; run eagerly here) take the fed
    tokens as a device tensor into their padded input buffer."""
    stepwise, ahead = pair_of_drafters()
    for drafter in (stepwise, ahead):
        drafter.engine.use_static_steps(8)
    assert rounds(ahead, (3, 5), 0.0, lambda d, s: chained(d, s)[0]) == rounds(stepwise, (3, 5), 0.0, one_by_one)


def test_one_job_runs_all_steps_while_no_stream_arrives_and_one_step_without_more():
    stepwise, ahead = pair_of_drafters()
    sid = ahead.open(PROMPTS[1], METAS[1], 16)[0]
    stream = ahead.propose(sid, None, [], 5)
    assert len(ahead.chain_steps([stream], None)) == 1, "more=None: one step, as step_many"
    steps = ahead.chain_steps([stream], lambda: True)
    assert len(steps) == 4 and stream.done
    # An arrival (more() false) ends the job early, unless one step is left.
    stream = ahead.propose(sid, None, [], 5)
    assert len(ahead.chain_steps([stream], lambda: False)) == 1
    stream = ahead.propose(sid, None, [], 2)
    assert len(ahead.chain_steps([stream], lambda: False)) == 2


def test_a_stream_whose_session_is_gone_gets_its_error_and_the_others_run_ahead():
    stepwise, ahead = pair_of_drafters()
    results = []
    for drafter in (stepwise, ahead):
        sids = [drafter.open(p, m, 32)[0] for p, m in zip(PROMPTS[:3], METAS[:3])]
        streams = [drafter.propose(sid, None, [], 4) for sid in sids]
        drafter.engine.close(sids[1])  # behind the drafter's back: the batch fails, retried stream by stream
        first = drafter.chain_steps(streams, lambda: True) if drafter is ahead else [(drafter.step_many(streams), 0)]
        assert isinstance(first[0][0][1], NotFound)
        # As the draft service does: the failed stream leaves, the others go on.
        others = [streams[0], streams[2]]
        rest = chained(drafter, others)[0] if drafter is ahead else one_by_one(drafter, others)
        made = [[summary(r) for r in res if isinstance(r, DraftToken)] for res, _ in first]
        results.append((made, rest))
    assert results[0][0] == results[1][0][:1] and results[0][1] == results[1][1]


def test_feed_writes_what_an_extend_writes_and_gives_its_logits():
    a, b = (tiny_engine(model=tiny_model(seed=4, init_range=0.3)) for _ in range(2))
    sa, sb = a.open_session(PROMPTS[2]), b.open_session(PROMPTS[2])
    for engine, session in ((a, sa), (b, sb)):
        engine.extend([ExtendItem(session.id, None, (), 1)])
    token = 17
    a.append_tokens(sa.id, [token])
    by_extend = a.extend([ExtendItem(sa.id, None, (), 1)])[0]
    by_feed = b.feed([sb.id], torch.tensor([token]))
    assert torch.equal(by_extend, by_feed)
    b.append_tokens(sb.id, [token], computed=1)
    assert (sb.length, sb.cached) == (sa.length, sa.cached) == (len(PROMPTS[2]) + 1,) * 2
    nxt = [ExtendItem(s.id, None, [23, 24], 2) for s in (sa, sb)]
    assert torch.equal(a.extend(nxt[:1])[0], b.extend(nxt[1:])[0]), "the fed token's keys/values differ"


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(seed=0, init_range=0.3)
    return target, perturbed(target, 0.05, seed=1)


def test_through_the_services_greedy_output_equals_target_only_and_sampled_tokens_do_not_change(pair):
    target, draft = pair
    n = 20
    prompts = GREEDY_PROMPTS[:6]
    outputs = {}
    for run_ahead in ("on", "off"):
        with running_system(tiny_engine(model=target), tiny_engine(model=draft), draft_run_ahead=run_ahead) as s:
            def run(i, s=s):
                client = s.client.__class__(f"127.0.0.1:{s.orchestrator.port}")
                try:
                    greedy = client.complete(prompts[i], max_tokens=n, temperature=0, policy="fixed",
                                             num_draft_tokens=2 + i % 4)
                    sampled = client.complete(prompts[i], max_tokens=n, temperature=0.8, seed=100 + i,
                                              policy="fixed", num_draft_tokens=2 + i % 4)
                finally:
                    client.close()
                return greedy.token_ids, sampled.token_ids

            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                outputs[run_ahead] = list(pool.map(run, range(len(prompts))))
            fed = s.draft.servicer.backend.steps_fed
            assert (fed > 0) if run_ahead == "on" else (fed == 0), fed
    for i, (greedy, _) in enumerate(outputs["on"]):
        ref = greedy_reference(target, prompts[i], n)
        assert same_as_reference(greedy, ref), f"prompt {i}"
    assert [s for _, s in outputs["on"]] == [s for _, s in outputs["off"]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_with_cuda_graphs_run_ahead_drafts_what_steps_one_at_a_time_draft():
    """On the GPU (auto turns it on there), through captured steps, fp32:
    the same drafts, q and lengths, round after round."""
    from tests.test_gpu_engine import cuda_engine

    stepwise = ModelDrafter(cuda_engine("float32", graphs=True, arch="llama", seed=2), run_ahead="off")
    ahead = ModelDrafter(cuda_engine("float32", graphs=True, arch="llama", seed=2))
    assert ahead.run_ahead and ahead.engine.steps.captured
    for ks, together in (((4,), True), ((1, 3, 5, 2), True), ((6, 4), False)):
        expected = rounds(stepwise, ks, 0.0, one_by_one, together)
        assert rounds(ahead, ks, 0.0, lambda d, s: chained(d, s)[0], together) == expected, ks
    assert ahead.steps_fed > 0


def test_a_job_ends_when_a_stream_has_its_tokens():
    """A stream that has its tokens is not kept waiting for the longest
    stream of its pass: stepping one at a time, the job ends with the step
    that gave its last token (it ran one more pass, which gave it nothing);
    run ahead, after the step already queued behind that one."""
    from draft_service.step_batcher import _timed_steps

    stepwise, ahead = pair_of_drafters()
    jobs = []
    for drafter, job in ((stepwise, lambda st: _timed_steps(stepwise.step_many, st, lambda: True)),
                         (ahead, lambda st: ahead.chain_steps(st, lambda: True))):
        sids = [drafter.open(p, m, 32)[0] for p, m in zip(PROMPTS[:2], METAS[:2])]
        steps = job([drafter.propose(sids[0], None, [], 2), drafter.propose(sids[1], None, [], 7)])
        jobs.append([[None if r is None else summary(r) for r in results] for results, _ in steps])
    assert len(jobs[0]) == 2 and len(jobs[1]) == 3 and jobs[1][:2] == jobs[0]


def test_a_steps_time_includes_its_forward_pass(monkeypatch):
    _, ahead = pair_of_drafters()
    extend = ahead.engine.extend

    def slow_extend(items):
        time.sleep(0.05)
        return extend(items)

    monkeypatch.setattr(ahead.engine, "extend", slow_extend)
    sid = ahead.open(PROMPTS[0], METAS[0], 16)[0]
    steps = ahead.chain_steps([ahead.propose(sid, None, [], 3)], lambda: True)
    assert len(steps) == 3 and steps[0][1] >= 0.05


def test_picks_that_cannot_be_read_together_are_picked_row_by_row(monkeypatch):
    from specdec.sampling import draft_picks

    stepwise, ahead = pair_of_drafters()
    expected = rounds(stepwise, (3, 4), 0.0, one_by_one)

    read = draft_picks.DevicePicks.read

    def broken(self):  # a fault in reading a batch's picks; one row alone reads fine
        if self.batch > 1:
            raise RuntimeError("a fault reading a step's picks")
        return read(self)

    monkeypatch.setattr(draft_picks.DevicePicks, "read", broken)
    assert rounds(ahead, (3, 4), 0.0, lambda d, s: chained(d, s)[0]) == expected


def test_the_draft_service_runs_a_lone_streams_steps_ahead_on_its_event_loop():
    """Through the step batcher: the first Propose (its cost unknown) runs
    as an engine-thread job, the next ones right on the event loop, both run
    ahead, with the drafts of stepping one at a time."""
    import asyncio
    import threading

    from draft_service.step_batcher import DraftStepBatcher
    from specdec.rpc.serving import EngineWorker

    stepwise, ahead = pair_of_drafters()
    sid_s = stepwise.open(PROMPTS[3], METAS[3], 32)[0]
    expected = [one_by_one(stepwise, [stepwise.propose(sid_s, len(PROMPTS[3]), [], k)])[0] for k in (4, 4, 3)]
    sid = ahead.open(PROMPTS[3], METAS[3], 32)[0]
    threads = []
    feed = ahead.engine.feed
    ahead.engine.feed = lambda *a: threads.append(threading.current_thread().name) or feed(*a)

    async def run():
        worker = EngineWorker("eng", inline_max_s=1.0)
        batcher = DraftStepBatcher(worker, ahead)
        try:
            got = []
            for k in (4, 4, 3):
                made = await batcher.start_and_collect(lambda k=k: ahead.propose(sid, len(PROMPTS[3]), [], k), sid)
                got.append([summary(token) for token, _ in made])
            return got, threading.current_thread().name
        finally:
            worker.shutdown()

    got, loop_thread = asyncio.run(run())
    assert got == expected
    assert threads[:3] == ["eng_0"] * 3 and threads[3:] == [loop_thread] * 5


def test_streamed_proposes_run_ahead_get_each_token_and_the_drafts_of_stepping_one_at_a_time():
    """Streamed Proposes (pipelined drafting's) through the step batcher:
    several steps per job, each step's tokens handed on as the job reads it;
    a consumer that goes away after its first token stops the job within a
    step or two instead of all of its k."""
    import asyncio

    from draft_service.step_batcher import DraftStepBatcher
    from specdec.rpc.serving import EngineWorker

    stepwise, ahead = pair_of_drafters()
    expected = one_by_one(stepwise, [stepwise.propose(stepwise.open(PROMPTS[j], METAS[j], 32)[0], None, [], 5)
                                     for j in (1, 2)])  # both in one batch, as the batcher steps them
    sids = [ahead.open(PROMPTS[j], METAS[j], 32)[0] for j in (1, 2)]
    dropped_sid = ahead.open(PROMPTS[3], METAS[3], 64)[0]

    async def run():
        worker = EngineWorker("eng")
        batcher = DraftStepBatcher(worker, ahead)
        try:
            async def consume(stream):
                return [summary(token) async for token, _ in batcher.stream(stream)]

            streams = [ahead.propose(sid, None, [], 5) for sid in sids]
            got = await asyncio.gather(*(consume(st) for st in streams))
            fed = ahead.steps_fed
            dropped = ahead.propose(dropped_sid, None, [], 8)
            # The engine thread waits after each of the dropped stream's steps until its
            # consumer has gone, so how far the job got does not depend on how soon the
            # loop ran on a loaded machine (CI once saw 6 steps when it did).
            consumer_gone = threading.Event()
            chain_steps = ahead.chain_steps

            def gated_chain_steps(streams, more=None, on_step=None):
                def step_then_wait(results, seconds):
                    on_step(results, seconds)
                    if dropped in streams:
                        consumer_gone.wait(DEADLINE_S)
                return chain_steps(streams, more, step_then_wait)

            ahead.chain_steps = gated_chain_steps
            tokens = batcher.stream(dropped)
            await tokens.__anext__()
            await tokens.aclose()  # a wrong guess: the rest is not wanted (pipelining cancels its call)
            consumer_gone.set()
            await asyncio.sleep(0.2)
            return got, fed, dropped.produced
        finally:
            worker.shutdown()

    got, fed, produced = asyncio.run(run())
    assert got == expected and fed > 0
    assert produced <= 4, f"the job stepped a dropped stream {produced} times"


def test_pipelined_drafting_with_the_steps_run_ahead_keeps_greedy_output_and_seeded_tokens(pair):
    target, draft = pair
    n, prompts = 20, GREEDY_PROMPTS[:4]
    outputs, fed = {}, {}
    for run_ahead in ("on", "off"):
        with running_system(tiny_engine(model=target), tiny_engine(model=draft), draft_run_ahead=run_ahead,
                            pipeline=True, pipeline_always=True) as s:
            results = []
            for i, prompt in enumerate(prompts):
                greedy = s.client.complete(prompt, max_tokens=n, temperature=0, policy="fixed", num_draft_tokens=3)
                sampled = s.client.complete(prompt, max_tokens=n, temperature=0.8, seed=200 + i, policy="fixed",
                                            num_draft_tokens=3)
                results.append((greedy.token_ids, sampled.token_ids, greedy.stats.pipelined_rounds))
            outputs[run_ahead] = results
            fed[run_ahead] = s.draft.servicer.backend.steps_fed
    for i, (greedy, _, _) in enumerate(outputs["on"]):
        assert same_as_reference(greedy, greedy_reference(target, prompts[i], n)), f"prompt {i}"
    assert [r[1] for r in outputs["on"]] == [r[1] for r in outputs["off"]]
    assert sum(r[2] for r in outputs["on"]) > 0, "no round used drafts made ahead"
    assert fed["on"] > 0 and fed["off"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_picks_replayed_as_cuda_graphs_draft_what_eager_picks_draft(monkeypatch):
    """specdec/sampling/pick_graphs.py: each group of a step's rows that
    sample alike picks by a graph replay; the drafts, q's and confidences
    are those of a drafter made with its picks eager, bit for bit (fp32 and
    bf16, run ahead and one at a time, steps of one sampling and of several).
    SPECD_PICK_GRAPHS=off turns the graphs off."""
    from tests.test_gpu_engine import cuda_engine

    monkeypatch.setenv("SPECD_PICK_GRAPHS", "off")
    assert ModelDrafter(cuda_engine("float32", graphs=True, arch="llama", seed=2)).pick_graphs is None
    monkeypatch.setenv("SPECD_PICK_GRAPHS", "on")
    for dtype in ("float32", "bfloat16"):
        eager = ModelDrafter(cuda_engine(dtype, graphs=True, arch="llama", seed=2), pick_graphs=False)
        graphed = ModelDrafter(cuda_engine(dtype, graphs=True, arch="llama", seed=2))
        for ks in ((4,), (6, 4), (1, 3, 5, 2)):
            for run in (one_by_one, lambda d, s: chained(d, s)[0]):
                # one stream a call (each step one sampling, one replay), and the five
                # streams together (four samplings a step, a replay for each)
                for together in (False, True):
                    assert rounds(graphed, ks, 0.0, run, together) == rounds(eager, ks, 0.0, run, together)
        assert graphed.pick_graphs.replays > 0 and graphed.pick_graphs.captures >= 4, dtype
        assert eager.pick_graphs is None  # every pick of the reference ran eagerly
