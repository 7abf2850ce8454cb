"""Pipelined drafting: the draft proposes round r+1 while the target verifies
round r. Exactness with it on (greedy identity, sampled distribution), tokens
identical to the unpipelined loop for a seed, the speculative work it drops, the
stream guard on the draft service, and cleanup. Services in-process on port 0."""
from __future__ import annotations

import concurrent.futures
import copy

import pytest
import torch

from draft_service.drafters import ModelDrafter
from draft_service.ngram_drafter import NgramDrafter
from orchestrator.gamma_policy import AdaptivePolicy, FixedPolicy, RoundObservation, acceptance_estimate
from orchestrator.pipelining import AheadDecision, draft_ahead_length
from specdec.errors import Aborted
from specdec.rpc.model_service import SessionMeta
from specdec.sampling.params import SamplingParams
from specdec.sampling.transform import logits_to_probs
from tests.conftest import tiny_engine, tiny_model
from tests.harness import complete_seeds, running_system
from tests.test_orchestrator import (
    EOS,
    GREEDY_PROMPTS,
    PROMPT,
    VOCAB,
    assert_cancel_and_deadline_free_the_sessions,
    assert_matches,
    generate_stopping_the_draft,
    greedy_reference,
    perturbed,
    same_as_reference,
    stats_model,
    without_eos,
)


@pytest.fixture(scope="module")
def system():
    target = tiny_model(seed=0, init_range=0.3)
    draft = perturbed(target, 0.05, seed=1)
    with running_system(tiny_engine(model=target), tiny_engine(model=draft), pipeline=True, pipeline_always=True) as s:
        s.target_model = target
        yield s


def client_of(s):
    return s.client.__class__(f"127.0.0.1:{s.orchestrator.port}")


def test_greedy_output_is_identical_to_target_only_with_pipelining_under_concurrency(system):
    n = 24
    refs = [greedy_reference(system.target_model, p, n) for p in GREEDY_PROMPTS]

    def run(i):
        policy = ("fixed", "adaptive", "goodput")[i % 3]
        return client_of(system).complete(GREEDY_PROMPTS[i], max_tokens=n, temperature=0, policy=policy,
                                          num_draft_tokens=1 + i % 6)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(len(GREEDY_PROMPTS))))
    for i, (result, ref) in enumerate(zip(results, refs)):
        assert same_as_reference(list(result.token_ids), ref), f"prompt {i}"
    assert sum(r.stats.pipelined_rounds for r in results) > 0, "no round used pipelined drafts"
    assert all(r.stats.pipelined_rounds < r.stats.rounds for r in results)


def test_pipelining_is_the_servers_default_and_a_request_can_turn_it_off(system):
    pipelined = 0
    for prompt in GREEDY_PROMPTS[:6]:
        on = system.client.complete(prompt, max_tokens=24, temperature=0, num_draft_tokens=2)
        off = system.client.complete(prompt, max_tokens=24, temperature=0, num_draft_tokens=2, pipeline=False)
        assert on.token_ids == off.token_ids
        assert off.stats.pipelined_rounds == 0
        pipelined += on.stats.pipelined_rounds
    assert pipelined > 0


def test_a_draft_equal_to_the_target_makes_every_later_round_pipelined_and_saves_round_trips():
    target = tiny_model(seed=0, init_range=0.3)
    with running_system(tiny_engine(model=target), tiny_engine(model=copy.deepcopy(target)), pipeline_always=True) as s:
        ref = greedy_reference(target, GREEDY_PROMPTS[6], 30)
        stats = {}
        for pipeline in (False, True):
            r = s.client.complete(GREEDY_PROMPTS[6], max_tokens=30, temperature=0, num_draft_tokens=4,
                                  pipeline=pipeline)
            assert same_as_reference(list(r.token_ids), ref)
            stats[pipeline] = r.stats
    on, off = stats[True], stats[False]
    assert on.accepted_tokens == on.proposed_tokens, "a draft with the target's weights is always accepted"
    assert on.pipelined_rounds == on.rounds - 1 or on.completion_tokens < 30
    assert on.rounds == off.rounds
    # Without pipelining: 2 opens + a Propose and a Verify per round + 2 closes.
    # With it, the Propose of a pipelined round is the speculative one sent
    # during the round before: the same count, but none is waited for.
    assert off.round_trips == 4 + 2 * off.rounds
    assert on.round_trips == off.round_trips
    assert on.draft_compute_time_s > 0 and off.draft_compute_time_s > 0


def test_drafting_ahead_is_skipped_when_a_call_costs_more_than_it_can_save():
    target = tiny_model(seed=0, init_range=0.3)
    with running_system(tiny_engine(model=target), tiny_engine(model=copy.deepcopy(target)), pipeline=True,
                        pipeline_call_cost_ms=1000) as s:
        r = s.client.complete(GREEDY_PROMPTS[6], max_tokens=30, temperature=0, num_draft_tokens=4)
    assert same_as_reference(list(r.token_ids), greedy_reference(target, GREEDY_PROMPTS[6], 30))
    # Only the first round drafts ahead (nothing is measured yet); after it,
    # a saving of milliseconds never beats a call priced at a second.
    assert r.stats.pipelined_rounds <= 1
    assert r.stats.round_trips <= 4 + 2 * r.stats.rounds + 1


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_seeded_sampled_tokens_equal_the_unpipelined_loop(system, policy):
    """With the same k per round, pipelining does not change a sampled token:
    round r is decided as without it, and the drafts it made ahead are the ones
    the draft would have made (keyed by seed and position) from the same context."""
    differing, pipelined = 0, 0
    for seed in range(24):
        kwargs = dict(max_tokens=20, temperature=0.8, seed=seed, policy=policy, num_draft_tokens=2)
        on = system.client.complete(GREEDY_PROMPTS[seed % 24], pipeline=True, **kwargs)
        off = system.client.complete(GREEDY_PROMPTS[seed % 24], pipeline=False, **kwargs)
        differing += on.token_ids != off.token_ids
        pipelined += on.stats.pipelined_rounds
    assert differing == 0
    assert pipelined > 0


# ------------------------------------------------------------------ sampled

def exact_distribution(model, params: SamplingParams, n: int) -> dict[tuple, float]:
    """P(completion) of a max_tokens=n request from PROMPT (a completion ends at EOS)."""
    dist: dict[tuple, float] = {}

    def walk(prefix: tuple, prob: float):
        if len(prefix) == n:
            dist[prefix] = dist.get(prefix, 0.0) + prob
            return
        p = logits_to_probs(model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1:], params)[0]
        dist[prefix] = dist.get(prefix, 0.0) + prob * float(p[EOS])
        for t in range(VOCAB):
            if t != EOS and p[t] > 0:
                walk(prefix + (t,), prob * float(p[t]))

    with torch.inference_mode():
        walk((), 1.0)
    return dist


def project(dist: dict[tuple, float | int], positions: slice) -> dict[tuple, float | int]:
    out: dict[tuple, float | int] = {}
    for outcome, p in dist.items():
        key = (len(outcome),) + outcome[positions]
        out[key] = out.get(key, 0) + p
    return out


N_TOKENS = 4
SAMPLES = 1200


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["perfect", "poor"])
def test_sampled_output_is_distributed_as_the_target_with_pipelining(kind):
    if kind == "perfect":
        target = draft = stats_model(0, vocab_size=VOCAB, init_range=0.2)
    else:  # two layers: with this pair some rounds' guesses come true, so drafts made ahead get used
        target, draft = (tiny_model(seed=seed, vocab_size=VOCAB, init_range=0.2) for seed in (0, 7))
    params = SamplingParams(1.0 if kind == "perfect" else 0.7, 0, 1.0)
    exact = exact_distribution(target, params, N_TOKENS)
    counts: dict[tuple, int] = {}
    pipelined = 0
    with running_system(tiny_engine(model=target), tiny_engine(model=draft), pipeline=True, pipeline_always=True) as s:
        results = complete_seeds(s, PROMPT, range(SAMPLES), max_tokens=N_TOKENS, temperature=params.temperature,
                                 num_draft_tokens=1)
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
        pipelined += r.stats.pipelined_rounds
    assert pipelined > 0, "pipelined drafts were never used"
    # Each slice of the sequence has few enough outcomes for a chi-square test;
    # the later tokens are the ones pipelined rounds produce.
    for positions in (slice(0, 2), slice(1, 3), slice(2, 4)):
        assert_matches(project(counts, positions), project(exact, positions), SAMPLES)


# ------------------------------------------------------------ stream guard

def test_a_newer_call_on_a_draft_session_stops_an_abandoned_propose_stream():
    engine = tiny_engine(seed=3)
    drafter = ModelDrafter(engine, max_draft_tokens=8)
    meta = SessionMeta(params=SamplingParams(0.0, 0, 1.0), seed=1)
    sid, length, _ = drafter.open([5, 6, 7, 8], meta, 32)
    old = drafter.propose(sid, None, [], 6)
    first = next(old)
    assert first.length == length + 1
    new = drafter.propose(sid, length, [9], 2)  # cuts the old stream's token, appends 9
    assert list(old) == [], "the abandoned stream took another step"
    drafts = list(new)
    assert [d.length for d in drafts] == [length + 2, length + 3]
    assert engine.session(sid).tokens == [5, 6, 7, 8, 9] + [d.token_id for d in drafts]

    again = drafter.propose(sid, None, [], 3)
    next(again)
    drafter.rollback(sid, length)
    assert list(again) == [] and engine.session(sid).length == length
    assert drafter.close(sid)


@pytest.mark.parametrize("kind", ["model", "ngram"])
def test_a_propose_numbered_below_one_already_started_is_refused_and_touches_nothing(kind):
    """A call the client abandoned may START after its next call (it went on a
    gRPC stream, the next one on the lane): numbered, it is refused, and the
    newer call's stream and context are as if it never came."""
    if kind == "model":
        drafter = ModelDrafter(tiny_engine(seed=3), max_draft_tokens=8)
        session = lambda sid: drafter.engine.session(sid).tokens  # noqa: E731
    else:
        drafter = NgramDrafter(16, max_draft_tokens=8)
        session = lambda sid: drafter._sessions.get(sid).tokens  # noqa: E731
    meta = SessionMeta(params=SamplingParams(0.0, 0, 1.0), seed=1)
    sid, length, _ = drafter.open([5, 6, 7, 8, 5, 6, 7], meta, 32)
    new = drafter.propose(sid, length, [8], 3, call_number=2)
    first = next(new)
    with pytest.raises(Aborted, match="call 1 .* after call 2"):
        drafter.propose(sid, length, [], 4, call_number=1)
    rest = list(new)
    assert [d.index for d in [first] + rest] == list(range(new.k))
    assert session(sid) == [5, 6, 7, 8, 5, 6, 7, 8] + [d.token_id for d in [first] + rest]
    # The next numbered call, and an unnumbered one, still take the session over.
    assert len(list(drafter.propose(sid, length + 1, [], 2, call_number=3))) <= 2
    assert len(list(drafter.propose(sid, length + 1, [], 1))) <= 1
    with pytest.raises(Aborted):
        drafter.propose(sid, length + 1, [], 1, call_number=2)
    assert drafter.close(sid)


def test_seeded_tokens_do_not_change_when_abandoned_speculative_proposes_reach_the_draft_late():
    """The speculative Propose goes on a gRPC stream, the round's ProposeAll on
    the lane: with the gRPC path 15 ms slower, a speculative call dropped after
    a partial acceptance reaches the draft after the next round's call. It is
    refused there (its call number is older), so the next rounds draft from
    the right context and each seed's tokens are the unpipelined loop's."""
    target = tiny_model(seed=0, init_range=0.3)
    draft = perturbed(target, 0.05, seed=1)
    with running_system(tiny_engine(model=target), tiny_engine(model=draft), pipeline=True, pipeline_always=True,
                        draft_grpc_delay_ms=15) as s:
        for seed in range(8):
            kwargs = dict(max_tokens=16, temperature=0.8, seed=seed, num_draft_tokens=2)
            on = s.client.complete(GREEDY_PROMPTS[seed], pipeline=True, **kwargs)
            off = s.client.complete(GREEDY_PROMPTS[seed], pipeline=False, **kwargs)
            assert on.token_ids == off.token_ids, f"seed {seed}"
            # Each round drafted ahead (pipeline_always); most guesses were dropped.
            assert on.stats.round_trips > off.stats.round_trips
            assert on.stats.fallback_rounds == 0, "a round lost its draft"


def test_cancelling_a_pipelined_request_frees_both_sessions():
    target_engine = tiny_engine(model=without_eos(tiny_model(seed=0)))
    draft_engine = tiny_engine(model=without_eos(tiny_model(seed=0)))  # always accepted: always drafting ahead
    with running_system(target_engine, draft_engine, pipeline=True, pipeline_always=True) as s:
        assert_cancel_and_deadline_free_the_sessions(s, target_engine, draft_engine, chunks_first=3)


# ------------------------------------------------------- the ahead decision

# The request's last speculative round: k = 4, a 100 ms draft round trip, 10 ms per drafted token.
LAST = RoundObservation(k=4, accepted=4, draft_time_s=0.04 + 0.1, verify_time_s=0.15, verify_compute_s=0.05,
                        batch_size=1, draft_rtt_s=0.1, target_rtt_s=0.1, draft_compute_s=0.04)
A = acceptance_estimate(90, 10)  # a = 0.9: a hit every 1.7 rounds at k = 4


def test_the_ahead_decision_weighs_the_saved_round_trip_against_a_measured_slowdown():
    decision = AheadDecision(call_cost_s=0.002)
    assert decision.worth_drafting_ahead(4, 4, A, last=None), "the first round drafts ahead, to measure it"
    assert not decision.worth_drafting_ahead(4, 4, A, LAST), "the second round measures the target without overlap"
    decision.observe_verify(overlapped=False, compute_s=0.050)
    decision.observe_verify(overlapped=True, compute_s=0.052)
    assert decision.worth_drafting_ahead(4, 4, A, LAST), "a 100 ms draft round trip saved more than half the time"
    decision.observe_verify(overlapped=True, compute_s=0.400)  # drafting ahead now slows verification a lot
    decisions = [decision.worth_drafting_ahead(4, 4, A, LAST) for _ in range(20)]
    assert decisions.count(True) == 2, "only the exploring decisions draft ahead"


def test_the_ahead_decision_counts_the_wait_for_drafts_against_the_saving():
    decision = AheadDecision(call_cost_s=0.002)
    decision.observe_verify(overlapped=False, compute_s=0.050)
    decision.observe_verify(overlapped=True, compute_s=0.050)
    assert decision.worth_drafting_ahead(4, 4, A, LAST)
    decision.observe_wait(0.2)  # the drafts made ahead arrived later than a fresh Propose would
    assert not decision.worth_drafting_ahead(4, 4, A, LAST)
    assert AheadDecision(call_cost_s=10.0, always=True).worth_drafting_ahead(4, 4, A, LAST)


def test_drafting_ahead_asks_what_the_policy_would_choose_after_a_full_acceptance_within_the_caps():
    assert draft_ahead_length(FixedPolicy(4), 4, tokens_left=100, context_left=100, max_draft_tokens=8) == 4
    assert draft_ahead_length(AdaptivePolicy(4, 1, 8), 4, 100, 100, 8) == 6, "adaptive: +2 after a full acceptance"
    assert draft_ahead_length(AdaptivePolicy(4, 1, 8), 4, 100, 100, max_draft_tokens=6) == 5, "the guess is drafted too"
    assert draft_ahead_length(FixedPolicy(4), 4, tokens_left=3, context_left=100, max_draft_tokens=8) == 2
    assert draft_ahead_length(FixedPolicy(4), 4, tokens_left=100, context_left=1, max_draft_tokens=8) == 1
    policy = AdaptivePolicy(4, 1, 8)
    draft_ahead_length(policy, 4, 100, 100, 8)
    assert policy.next_k() == 4, "the policy itself is left unchanged"


def test_a_draft_that_stops_while_drafting_ahead_falls_back_exactly():
    from tests.test_orchestrator import _port
    from tests.harness import running_draft

    target = tiny_model(seed=0, init_range=0.3)
    # A copy (an engine fuses its model in place): always accepted, so every round drafts ahead.
    draft_engine = tiny_engine(model=copy.deepcopy(target))
    ref = greedy_reference(target, GREEDY_PROMPTS[2], 40)
    with running_system(tiny_engine(model=target), draft_engine, pipeline=True, pipeline_always=True,
                        draft_retry_s=0.05) as s:
        tokens, stats = generate_stopping_the_draft(s, GREEDY_PROMPTS[2], 40)
        assert tokens == ref[: len(tokens)] and len(tokens) == 40
        assert stats.fallback_rounds > 0
        with running_draft(draft_engine, server_cfg=_port(s.draft.port)):
            again = s.client.complete(GREEDY_PROMPTS[2], max_tokens=20, temperature=0, num_draft_tokens=2)
        assert again.token_ids == ref[:20]


def test_a_request_cancelled_while_it_waits_for_the_drafts_made_ahead_cancels_their_propose():
    """`Pipeline.settle` waits for the speculative Propose's first token; a
    request cancelled there takes that Propose with it (asyncio.wait does not
    cancel what it waits on), instead of leaving it running unowned."""
    import asyncio

    from orchestrator.pipelining import Pipeline

    class SlowDraft:
        def __init__(self):
            self.running = 0
            self.cancelled = 0

        async def propose(self, session_id, keep, append, k, timeout, first=None, **kwargs):
            self.running += 1
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            finally:
                self.running -= 1

    async def main():
        draft = SlowDraft()
        pipeline = Pipeline(draft)
        pipeline.start("s", 10, 3, 30.0)
        settling = asyncio.ensure_future(pipeline.settle(2, 2, 42, frozenset()))
        await asyncio.sleep(0.05)
        settling.cancel()
        with pytest.raises(asyncio.CancelledError):
            await settling
        await asyncio.sleep(0.05)
        assert draft.running == 0 and draft.cancelled == 1  # before asyncio.run would cancel what is left

    asyncio.run(asyncio.wait_for(main(), 30))


def test_seeded_tokens_with_an_early_stop_do_not_depend_on_drafting_ahead():
    """With draft_min_confidence above 0 (the server's default is 0.5), the
    speculative Propose counted its guess at the bonus token in the early
    stop's product and drafted fewer tokens than the Propose the loop would
    send after the round: a pipelined round's k differed, so a seeded
    request's tokens depended on whether the (timing-driven) pipelining ran."""
    target = tiny_model(seed=0, init_range=0.3)
    with running_system(tiny_engine(model=target), tiny_engine(model=copy.deepcopy(target)),
                        pipeline_always=True) as s:
        pipelined, differ = 0, []
        for seed in range(12):
            settings = dict(max_tokens=24, temperature=0.9, seed=seed, policy="fixed", num_draft_tokens=4,
                            draft_min_confidence=0.3)
            on = s.client.complete(GREEDY_PROMPTS[seed % len(GREEDY_PROMPTS)], pipeline=True, **settings)
            off = s.client.complete(GREEDY_PROMPTS[seed % len(GREEDY_PROMPTS)], pipeline=False, **settings)
            pipelined += on.stats.pipelined_rounds
            if on.token_ids != off.token_ids:
                differ.append(seed)
        assert pipelined > 0
        assert differ == []
