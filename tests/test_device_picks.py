"""Sampling done where the logits are, one transfer per step.

The draft's batched picks (specdec/sampling/draft_picks.py): every row's pick
equals the one-row path (`truncate` + `draw_draft`, or the argmax), a row
picks the same whatever it is batched with, and a row without mass fails
alone. The target's batched scoring (`scoring.score_many`): each job's
outcome equals its own `score_drafts`, in any batch."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec.sampling import q_wire
from specdec.sampling.draft_picks import DraftRow, NoMass, pick_drafts
from specdec.sampling.params import SamplingParams
from specdec.sampling.scoring import NoTargetMass, ScoreJob, draw_draft, score_drafts, score_many
from specdec.sampling.sparse import truncate
from specdec.sampling.transform import argmax_tokens, logits_to_probs

VOCAB = 300
PARAMS = [SamplingParams(0.0, 0, 1.0), SamplingParams(0.7, 0, 1.0), SamplingParams(1.0, 5, 1.0),
          SamplingParams(0.9, 0, 0.8), SamplingParams(1e-4, 0, 1.0), SamplingParams(1.3, 40, 0.95)]


def logits_rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, VOCAB, generator=g) * 3
    rows[:, 17] = rows[:, 18] = rows.max() + 1  # a tie at the top: the lower id wins
    rows[:, 200:] = float("-inf")  # masked (padded) ids are never picked
    return rows


def one_row_path(row: torch.Tensor, r: DraftRow, max_q: int):
    if r.params.greedy:
        return int(argmax_tokens(row[None])[0]), None
    q = truncate(logits_to_probs(row[None], r.params)[0], max_q)
    return draw_draft(q, r.seed, r.position), q


@pytest.mark.parametrize("max_q", [1, 8, 32, 500])
def test_every_row_picks_what_the_one_row_path_picks(max_q):
    logits = logits_rows(2 * len(PARAMS), seed=max_q)
    rows = [DraftRow(PARAMS[i % len(PARAMS)], seed=1000 + i, position=10 + 3 * i) for i in range(logits.shape[0])]
    picks = pick_drafts(logits, rows, max_q)
    for row, r, pick in zip(logits, rows, picks):
        token, q = one_row_path(row, r, max_q)
        assert pick.token_id == token
        if q is None:
            assert pick.q is None
        else:
            assert torch.equal(pick.q.token_ids, q.token_ids) and torch.equal(pick.q.probs, q.probs)
            assert token in pick.q.token_ids.tolist() and token < 200
            # packed for the wire as it was made: the bytes the tensors pack to, read back as the entries
            assert pick.q.packed == q_wire.pack(q) and q.packed is None
            ids, probs = q_wire.unpack(pick.q.packed)
            assert ids.tolist() == q.token_ids.tolist() and probs.tolist() == q.probs.tolist()
            # other entries made from it are packed afresh, never with its bytes
            assert dataclasses.replace(pick.q, probs=pick.q.probs * 0.5).packed is None


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_a_step_of_one_sampling_picks_what_the_one_row_path_picks(params):
    """A step whose rows share their sampling takes its tokens as they come
    out of the group (no scatter into batch-wide tensors): the same picks."""
    logits = logits_rows(7, seed=11)
    rows = [DraftRow(params, seed=300 + i, position=20 + i) for i in range(7)]
    for row, r, pick in zip(logits, rows, pick_drafts(logits, rows, 16)):
        token, q = one_row_path(row, r, 16)
        assert pick.token_id == token and (pick.q is None) == (q is None)
        if q is not None:
            assert torch.equal(pick.q.token_ids, q.token_ids) and torch.equal(pick.q.probs, q.probs)
            assert pick.confidence == q.probs[q.token_ids.tolist().index(token)].item()


def test_a_step_of_one_sampling_costs_the_same_operations_for_1_or_8_rows():
    """On a GPU each operation is a launch: the draft's picks of a step take
    as many for 8 rows as for 1 (9 greedy, 42 at T = 0.7; the count at Qwen's
    vocabulary is `python -m specdec.bench.kernel_count`'s second table)."""
    from specdec.bench.kernel_count import count_picks

    for temperature, top_k, top_p in ((0.0, 0, 1.0), (0.7, 0, 1.0), (0.9, 40, 0.95)):
        counts = [count_picks(temperature, top_k, top_p, batch, vocab=VOCAB) for batch in (1, 8)]
        assert counts[0] == counts[1], (temperature, counts)
    assert count_picks(0.7, 0, 1.0, 8, mixed=True, vocab=VOCAB) > count_picks(0.7, 0, 1.0, 8, vocab=VOCAB)


def test_a_row_picks_the_same_alone_and_in_any_batch():
    logits = logits_rows(12, seed=3)
    rows = [DraftRow(PARAMS[i % len(PARAMS)], seed=7, position=50 + i) for i in range(12)]
    together = pick_drafts(logits, rows, 16)
    order = [5, 0, 11, 3]
    subset = pick_drafts(logits[order], [rows[i] for i in order], 16)
    for i, pick in zip(order, subset):
        alone = pick_drafts(logits[i: i + 1], [rows[i]], 16)[0]
        for other in (together[i], pick):
            assert other.token_id == alone.token_id
            assert (other.q is None) == (alone.q is None)
            if other.q is not None:
                assert torch.equal(other.q.probs, alone.q.probs) and torch.equal(other.q.token_ids, alone.q.token_ids)


def test_sampled_picks_follow_q():
    """Many seeds on one row: the picks' frequencies match the q sent with them."""
    row = logits_rows(1, seed=9)
    rows = [DraftRow(SamplingParams(1.0, 4, 1.0), seed=s, position=5) for s in range(4000)]
    picks = pick_drafts(row.expand(len(rows), -1), rows, 4)
    q = picks[0].q
    assert all(torch.equal(p.q.probs, q.probs) for p in picks)
    counts = {t: 0 for t in q.token_ids.tolist()}
    for p in picks:
        counts[p.token_id] += 1
    for t, prob in zip(q.token_ids.tolist(), q.probs.tolist()):
        assert abs(counts[t] / len(picks) - prob) < 4 * (prob * (1 - prob) / len(picks)) ** 0.5 + 1e-3


def test_a_row_without_mass_fails_alone():
    logits = logits_rows(3, seed=5)
    logits[1] = float("nan")
    rows = [DraftRow(SamplingParams(0.8, 0, 1.0), seed=1, position=4 + i) for i in range(3)]
    picks = pick_drafts(logits, rows, 8)
    assert isinstance(picks[1], NoMass) and "no finite mass" in str(picks[1])
    assert [p.token_id for p in (picks[0], picks[2])] == [one_row_path(logits[i], rows[i], 8)[0] for i in (0, 2)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_step_syncs_once_and_picks_what_the_cpu_picks():
    logits = logits_rows(8, seed=11)
    rows = [DraftRow(PARAMS[i % len(PARAMS)], seed=3, position=20 + i) for i in range(8)]
    on_gpu = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning) as caught:
            picks = pick_drafts(on_gpu, rows, 32)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    cpu = pick_drafts(logits, rows, 32)
    assert [p.token_id for p in picks] == [p.token_id for p in cpu]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_verify_batch_syncs_once():
    jobs = [ScoreJob(j.target_logits.cuda(), *[getattr(j, f) for f in
            ("draft_ids", "draft_q", "params", "seed", "first_position")]) for j in score_jobs(seed=8)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning) as caught:
            outcomes = score_many(jobs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1
    assert [o.bonus_id for o in outcomes] == [o.bonus_id for o in score_many(score_jobs(seed=8))]


def score_jobs(seed: int) -> list[ScoreJob]:
    jobs = []
    for j, (params, k) in enumerate([(PARAMS[0], 3), (PARAMS[1], 4), (PARAMS[3], 0), (PARAMS[0], 0),
                                     (PARAMS[5], 2), (PARAMS[1], 1)]):
        logits = logits_rows(k + 1, seed=seed + j)
        rows = [DraftRow(params, seed=j, position=30 + i) for i in range(k)]
        picks = pick_drafts(logits_rows(max(k, 1), seed=seed + 100 + j)[:k], rows, 8) if k else []
        jobs.append(ScoreJob(logits, [p.token_id for p in picks], [] if params.greedy else [p.q for p in picks],
                             params, seed=j, first_position=30))
    return jobs


def test_a_verify_batch_scores_each_session_as_alone():
    jobs = score_jobs(seed=21)
    together = score_many(jobs)
    for job, outcome in zip(jobs, together):
        assert outcome == score_drafts(job.target_logits, job.draft_ids, job.draft_q, job.params, job.seed,
                                       job.first_position)
    assert score_many(jobs[3:] + jobs[:3]) == together[3:] + together[:3]
    assert score_many([]) == []


def test_a_target_row_without_mass_fails_its_job_alone():
    jobs = score_jobs(seed=4)
    broken = ScoreJob(torch.full_like(jobs[1].target_logits, float("nan")), *[getattr(jobs[1], f) for f in
                      ("draft_ids", "draft_q", "params", "seed", "first_position")])
    out = score_many([jobs[0], broken, jobs[4]])
    assert isinstance(out[1], NoTargetMass)
    assert out[0] == score_many([jobs[0]])[0] and out[2] == score_many([jobs[4]])[0]
    with pytest.raises(NoTargetMass):
        score_drafts(broken.target_logits, broken.draft_ids, broken.draft_q, broken.params, broken.seed,
                     broken.first_position)


def test_a_verify_batch_scores_the_same_in_runs_of_any_size(monkeypatch):
    """On a CPU a sampled group is scored in runs bounded by CPU_GROUP_ELEMENTS
    (scoring._chunks): one job per run, a few, or all give the same outcomes."""
    from specdec.sampling import scoring
    jobs = score_jobs(seed=33) + score_jobs(seed=34)
    together = score_many(jobs)
    for limit in (1, 3 * VOCAB, 9 * VOCAB):
        monkeypatch.setattr(scoring, "CPU_GROUP_ELEMENTS", limit)
        assert score_many(jobs) == together


def test_sessions_lying_back_to_back_in_one_tensor_are_scored_from_it_without_a_copy():
    """The engine's batched forward returns each session's logits as a view of
    one tensor (torch.split): a group of such sessions reads them in place,
    and scores as sessions in tensors of their own do."""
    from specdec.sampling import scoring
    jobs = [j for j in score_jobs(seed=40) if not j.params.greedy and j.params == PARAMS[1]]
    base = torch.cat([j.target_logits for j in jobs])
    views = [ScoreJob(rows, *[getattr(j, f) for f in ("draft_ids", "draft_q", "params", "seed", "first_position")])
             for j, rows in zip(jobs, torch.split(base, [j.target_logits.shape[0] for j in jobs]))]
    assert len(views) == 2
    assert scoring._rows(views).data_ptr() == base.data_ptr()
    assert scoring._rows(jobs).data_ptr() != base.data_ptr()  # apart: a copy
    assert score_many(views) == score_many(jobs)


def sampled_sessions(n: int, k: int = 4) -> list[ScoreJob]:
    params = PARAMS[1]
    jobs = []
    for j in range(n):
        rows = [DraftRow(params, seed=j, position=30 + i) for i in range(k)]
        picks = pick_drafts(logits_rows(k, seed=200 + j), rows, 8)
        jobs.append(ScoreJob(logits_rows(k + 1, seed=300 + j), [p.token_id for p in picks], [p.q for p in picks],
                             params, seed=j, first_position=30))
    return jobs


def tensor_operations(fn) -> int:
    """The operations `fn` launches, counted as `specd`'s kernel count counts them."""
    import collections

    from specdec.bench.kernel_count import launch_counter
    counts: collections.Counter = collections.Counter()
    with launch_counter(counts):
        fn()
    return sum(counts.values())


def test_a_sampled_verify_batch_costs_the_same_operations_for_2_or_8_sessions():
    """Each tensor operation is a kernel launch on a GPU: scoring a Verify of
    sessions sharing their sampling parameters takes as many for 8 sessions as
    for 2 (it took ~85 per session, which doubled a sampled 8-session Verify's
    cost on an H100 host)."""
    two, eight = sampled_sessions(2), sampled_sessions(8)
    assert all(len(q) == 8 for job in eight for q in job.draft_q)  # one length: densify groups by length
    score_many(two)  # warm
    assert tensor_operations(lambda: score_many(eight)) == tensor_operations(lambda: score_many(two))


def test_rows_of_another_width_are_never_read_as_the_first_ones_width():
    from specdec.sampling import scoring
    big = torch.randn(4, 10)
    jobs = [ScoreJob(rows, [0], [], PARAMS[0], 0, 5) for rows in (big[0:2], big[2:4, :6])]
    with pytest.raises(RuntimeError):  # torch.cat refuses the widths; before: one [4, 10] view
        scoring._rows(jobs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_replayed_pick_graph_gives_the_eager_picks_bit_for_bit():
    """PickGraphs (specdec/sampling/pick_graphs.py) against `one_group` run
    eagerly on the same logits and uniforms: Qwen's vocabulary, bf16 and fp32
    logits, 1-8 rows, greedy and sampled (top-k, top-p); each replay on new
    logits, and what an earlier replay returned is not overwritten by a later one."""
    from specdec.sampling.draft_picks import DevicePicks, one_group
    from specdec.sampling.pick_graphs import PickGraphs

    graphs = PickGraphs(torch.device("cuda"))
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 3, 8):
            for params in (None, SamplingParams(0.7, 0, 1.0), SamplingParams(1.0, 50, 1.0), SamplingParams(0.8, 0, 0.9)):
                kept_back = []
                for rep in range(3):
                    logits = (torch.randn(rows, 151936, generator=g) * 4).to("cuda", dtype)
                    us = [float(u) for u in torch.rand(rows, generator=g, dtype=torch.float64)]
                    want = one_group(logits, params, 32, None if params is None else
                                     torch.tensor(us, dtype=torch.float64, device="cuda"))
                    got = graphs.run(logits, params, 32, None if params is None else us)
                    assert got is not None, (dtype, rows, params)
                    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] == want[2]
                    kept_back.append((got, want))
                for got, want in kept_back:  # the clones out of the graph stay as they were
                    assert torch.equal(got[1], want[1])
                members = [(list(range(rows)), got[2])] if params is not None else []
                a = DevicePicks(got[0], got[1], rows, members).read()
                b = DevicePicks(want[0], want[1], rows, members).read()
                assert [(p.token_id, p.confidence) for p in a] == [(p.token_id, p.confidence) for p in b]
                assert all(p.q is None if params is None else torch.equal(p.q.probs, r.q.probs) for p, r in zip(a, b))
    assert graphs.captures == 2 * 3 * 4 and graphs.replays == 2 * 3 * 4 * 3
    # A step of several samplings: a replay for each group, on its rows gathered.
    from specdec.sampling.draft_picks import pick_on_device

    rows = [DraftRow(PARAMS[i % 4], seed=i, position=70 + i) for i in range(9)]
    logits = (torch.randn(9, 151936, generator=g) * 4).to("cuda", torch.bfloat16)
    eager = pick_on_device(logits, rows, 32).read()
    replayed = pick_on_device(logits, rows, 32, graphs).read()
    assert [(p.token_id, p.confidence) for p in replayed] == [(p.token_id, p.confidence) for p in eager]
    assert all((p.q is None) == (r.q is None) and (p.q is None or torch.equal(p.q.probs, r.q.probs) and
               torch.equal(p.q.token_ids, r.q.token_ids)) for p, r in zip(replayed, eager))


def test_each_sampling_of_a_step_is_offered_to_the_pick_graphs_with_its_rows_uniforms():
    """The wiring of pick_graphs.py, on the CPU: each group of a step's rows
    that sample alike (the whole step, usually) asks `graphs.run` with its
    rows' logits and uniforms and uses what it returns; None (no graph for
    that shape) runs the same operations eagerly. The picks are the same
    every way, for a step of one sampling and for one of three."""
    from specdec.sampling.draft_picks import one_group, pick_on_device
    from specdec.sampling.rng import Stream, uniform

    class Graphs:
        def __init__(self, replays: bool):
            self.replays, self.asked = replays, []

        def run(self, logits, params, max_q_tokens, us):
            self.asked.append((logits.shape[0], params, us))
            if not self.replays:
                return None
            return one_group(logits, params, max_q_tokens, None if us is None else torch.tensor(us, dtype=torch.float64))

    def picked(picks):
        return [(p.token_id, p.confidence, None if p.q is None else (p.q.token_ids.tolist(), p.q.probs.tolist()))
                for p in picks.read()]

    def asks(rows):
        groups = {}
        for r in rows:
            groups.setdefault(None if r.params.greedy else r.params, []).append(r)
        return [(len(members), params, None if params is None else
                 [uniform(r.seed, r.position, Stream.DRAFT) for r in members]) for params, members in groups.items()]

    steps = [[DraftRow(params, seed=s, position=40 + s) for s in range(4)] for params in (PARAMS[0], PARAMS[1], PARAMS[5])]
    steps.append([DraftRow(PARAMS[i % 3], seed=i, position=9 + i) for i in range(7)])  # three samplings, interleaved
    for n, rows in enumerate(steps):
        logits = logits_rows(len(rows), seed=31 + n)
        expected = picked(pick_on_device(logits, rows, 16))
        for replays in (True, False):
            graphs = Graphs(replays)
            assert picked(pick_on_device(logits, rows, 16, graphs)) == expected, (n, replays)
            assert graphs.asked == asks(rows)
