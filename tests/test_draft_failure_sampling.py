"""A seeded sampled request keeps its distribution through a draft failure.

The draft fails mid-request (every session's second Propose answers
UNAVAILABLE, as a dead draft does), so each request runs one speculative
round and then target-only rounds. The completions must still be
distributed exactly as the target's own sampling: chi-square against the
exact three-token distribution of a tiny target. Whether the *tokens* stay
those of the same seed without a failure is measured, not asserted, by
benchmarks/draft_failure_tokens.py (docs/reliability.md).
"""
from __future__ import annotations

import collections

import pytest
import torch

from draft_service.drafters import ModelDrafter
from specdec.errors import Unavailable
from specdec.sampling.params import SamplingParams
from specdec.sampling.transform import logits_to_probs
from tests.conftest import tiny_engine
from tests.harness import complete_seeds, running_system
from tests.test_orchestrator import EOS, PROMPT, VOCAB, assert_matches, stats_model

SAMPLES = 1200
TOKENS = 3


def exact_distribution(model, params: SamplingParams, n: int) -> dict[tuple, float]:
    """P(completion) of a max_tokens=n request; a completion ends early at EOS
    (which is not emitted)."""
    dist: dict[tuple, float] = {}

    def walk(prefix: tuple, prob: float) -> None:
        if len(prefix) == n:
            dist[prefix] = prob
            return
        with torch.inference_mode():
            p = logits_to_probs(model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1:], params)[0]
        dist[prefix] = dist.get(prefix, 0.0) + prob * float(p[EOS])
        for token in range(VOCAB):
            if token != EOS and p[token] > 0:
                walk(prefix + (token,), prob * float(p[token]))

    walk((), 1.0)
    return {k: v for k, v in dist.items() if v > 0}


@pytest.fixture
def draft_fails_after_one_round(monkeypatch):
    """Every draft session's second Propose fails with UNAVAILABLE."""
    calls: collections.Counter = collections.Counter()
    real = ModelDrafter.propose

    def propose(self, session_id, *args, **kwargs):
        calls[session_id] += 1
        if calls[session_id] >= 2:
            raise Unavailable("injected draft failure")
        return real(self, session_id, *args, **kwargs)

    monkeypatch.setattr(ModelDrafter, "propose", propose)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k", [(0.7, 4)])
def test_sampled_distribution_is_kept_through_a_draft_failure(draft_fails_after_one_round, temperature, top_k):
    target = stats_model(0, vocab_size=VOCAB, init_range=0.2)
    draft = stats_model(7, vocab_size=VOCAB, init_range=0.2)
    exact = exact_distribution(target, SamplingParams(temperature, top_k, 1.0), TOKENS)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-4)
    counts: collections.Counter = collections.Counter()
    failed_over = 0
    # draft_retry_s: the draft stays "down" for the rest of each short request.
    with running_system(tiny_engine(model=target), tiny_engine(model=draft), draft_retry_s=60.0) as s:
        results = complete_seeds(s, PROMPT, range(SAMPLES), max_tokens=TOKENS, temperature=temperature,
                                 top_k=top_k, num_draft_tokens=1)
    for r in results:
        counts[tuple(r.token_ids)] += 1
        failed_over += r.stats.fallback_rounds > 0
        assert r.stats.proposed_tokens <= 1, "the draft proposed after its failure"
    # Most requests need a round after the first, and it ran without the draft.
    assert failed_over > SAMPLES // 3, failed_over
    assert_matches(counts, exact, SAMPLES)
