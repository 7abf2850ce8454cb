"""Randomized end-to-end checks of the speculative loop's edge cases: many
prompts, max_tokens (1, 2, up to the context limit exactly), k, policies,
pipelining on and off. Greedy output must equal target-only decoding, the
request must end as target-only would (length or EOS), and the statistics
must add up. Services in-process on port 0, tiny models with a small vocabulary
(EOS comes often) and a small context."""
from __future__ import annotations

import concurrent.futures
import copy
import random

import pytest

from specdec.v1 import orchestrator_pb2 as pb
from tests.conftest import tiny_engine, tiny_model
from tests.harness import running_system
from tests.test_orchestrator import greedy_reference, perturbed

EOS = 2
CONTEXT = 40


def small_model(seed: int = 0):
    return tiny_model(seed=seed, vocab_size=16, init_range=0.3)


@pytest.fixture(scope="module")
def system():
    target = small_model()
    draft = perturbed(target, 0.1, seed=1)
    with running_system(tiny_engine(model=target, max_context=CONTEXT), tiny_engine(model=draft, max_context=CONTEXT),
                        pipeline=True, pipeline_always=True) as s:
        s.target_model = target
        yield s


def expected(ref: list[int]) -> tuple[list[int], int]:
    """Target-only greedy output and finish reason for a reference of max_tokens tokens."""
    if EOS in ref:
        return ref[:ref.index(EOS)], pb.FINISH_REASON_EOS
    return ref, pb.FINISH_REASON_LENGTH


def check_stats(st, tokens: list[int], finish) -> None:
    assert st.completion_tokens == len(tokens)
    hist = list(st.k.histogram)
    assert sum(hist) == st.rounds
    assert sum(k * n for k, n in enumerate(hist)) == st.proposed_tokens
    per_pos = list(st.accepted_per_position)
    assert sum(per_pos) == st.accepted_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos
    assert st.accepted_tokens <= st.proposed_tokens
    assert sum(st.acceptance_histogram) == st.rounds - (hist[0] if hist else 0)
    assert sum(j * n for j, n in enumerate(st.acceptance_histogram)) == st.accepted_tokens
    assert st.pipelined_rounds <= st.rounds and st.fallback_rounds + st.plain_rounds <= st.rounds
    # Each round emits its accepted drafts and one token from the target; the
    # last round's are cut at the EOS, which is not emitted.
    if finish == pb.FINISH_REASON_LENGTH:
        assert st.completion_tokens == st.accepted_tokens + st.rounds
    else:
        assert st.completion_tokens + 1 <= st.accepted_tokens + st.rounds
        # Accepted drafts are emitted tokens (or the EOS itself): nothing after the EOS counts.
        assert st.accepted_tokens <= st.completion_tokens + 1


def cases(seed: int, n: int):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        plen = rng.randint(1, 10)
        prompt = [rng.randint(3, 15) for _ in range(plen)]
        choice = rng.random()
        if choice < 0.2:
            max_tokens = 1
        elif choice < 0.35:
            max_tokens = 2
        elif choice < 0.55:
            max_tokens = CONTEXT - plen  # exactly at the context limit
        else:
            max_tokens = rng.randint(3, CONTEXT - plen)
        out.append(dict(prompt=prompt, max_tokens=max_tokens, k=rng.randint(1, 8),
                        policy=rng.choice(["fixed", "adaptive", "goodput"]), pipeline=rng.random() < 0.6))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_random_cases_match_target_only_and_stats_add_up(system, seed):
    todo = cases(seed, 30)
    results = run_cases(system, todo)
    for c, r in zip(todo, results):
        ref = greedy_reference(system.target_model, c["prompt"], c["max_tokens"])
        tokens, finish = expected(ref)
        assert list(r.token_ids) == tokens, c
        assert r.stats.finish_reason == finish, c
        check_stats(r.stats, tokens, finish)


@pytest.fixture(scope="module")
def exact_system():
    """A draft equal to the target: every draft is accepted, an EOS drafted
    mid-round included, and every round after the first can be pipelined."""
    target = small_model()
    draft = copy.deepcopy(target)
    with running_system(tiny_engine(model=target, max_context=CONTEXT), tiny_engine(model=draft, max_context=CONTEXT),
                        pipeline=True, pipeline_always=True) as s:
        s.target_model = target
        yield s


def run_cases(system, todo):
    def run(c):
        client = system.client.__class__(f"127.0.0.1:{system.orchestrator.port}")
        try:
            return client.complete(c["prompt"], max_tokens=c["max_tokens"], temperature=0, policy=c["policy"],
                                   num_draft_tokens=c["k"], pipeline=c["pipeline"])
        finally:
            client.close()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(run, todo))


def test_drafts_accepted_after_an_accepted_eos_are_not_counted(exact_system):
    """An EOS drafted mid-round and accepted ends the request: the drafts the
    target accepted after it are not output, and not counted as accepted
    (completion 0 with 2 accepted drafts, before the fix)."""
    todo = cases(0, 30)
    results = run_cases(exact_system, todo)
    eos_mid_round = 0
    for c, r in zip(todo, results):
        ref = greedy_reference(exact_system.target_model, c["prompt"], c["max_tokens"])
        tokens, finish = expected(ref)
        assert list(r.token_ids) == tokens, c
        assert r.stats.finish_reason == finish, c
        check_stats(r.stats, tokens, finish)
        assert r.stats.rejected_rounds == 0, c  # a draft equal to the target: nothing is rejected
        eos_mid_round += finish == pb.FINISH_REASON_EOS and r.stats.accepted_tokens == len(tokens) + 1
    assert eos_mid_round > 0, "no request ended at an accepted EOS draft"
