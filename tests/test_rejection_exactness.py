"""Statistical exactness of the rejection sampler, through the real functions.

Each trial runs the draft (`draw_draft` from a truncated q), the target
(`score_drafts`) and the orchestrator (`accept_sampled`) with seed = trial index,
and the emitted tokens are compared with the target's own distribution by a
chi-square test at p-value 1e-3. Everything is keyed by the counter-based rng, so
the tests are deterministic: a pass or fail does not change from run to run. The
negative controls show the same test catches plausible bugs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch
from scipy import stats

from specdec.sampling import (
    SamplingParams,
    SparseDist,
    Stream,
    VerifyOutcome,
    accept_sampled,
    draw_draft,
    logits_to_probs,
    sample_dense,
    score_drafts,
    truncate,
    uniform,
)

ALPHA = 1e-3
VOCAB = 8
PROMPT_LEN = 11  # absolute position of the first generated token


pytestmark = pytest.mark.usefixtures("one_thread")


def chi_square_pvalue(counts: Counter, expected: np.ndarray) -> float:
    """p-value of counts (keys index into expected, a flat distribution) under expected.

    A token of expected probability 0 must never occur at all. Cells with fewer than
    5 expected observations are merged, as the chi-square approximation needs.
    """
    n = sum(counts.values())
    observed = np.zeros(expected.size)
    for cell, count in counts.items():
        observed[cell] = count
    impossible = expected == 0
    assert observed[impossible].sum() == 0, f"emitted a token of probability 0: {counts}"
    want = expected[~impossible] * n
    got = observed[~impossible]
    small = want < 5
    if small.any():
        want = np.append(want[~small], want[small].sum())
        got = np.append(got[~small], got[small].sum())
    return stats.chisquare(got, want * got.sum() / want.sum()).pvalue


def target_p(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    return logits_to_probs(logits, params).double().numpy()


# ---------------------------------------------------------------- first token


Corrupt = Callable[[VerifyOutcome, torch.Tensor, list[int], int], VerifyOutcome]


def first_tokens(
    target_logits: torch.Tensor,
    q: SparseDist,
    params: SamplingParams,
    trials: int,
    corrupt: Corrupt | None = None,
) -> Counter:
    """First emitted token of one round with k = 1, per seed 0..trials-1.

    The first emitted token depends on the target's first row alone, so the
    target's rows do not depend on the draft here (the sequence tests below cover
    a target that does, and k = 2).
    """
    counts: Counter = Counter()
    for seed in range(trials):
        drafts = [draw_draft(q, seed, PROMPT_LEN)]
        outcome = score_drafts(target_logits, drafts, [q], params, seed, PROMPT_LEN)
        if corrupt is not None:
            outcome = corrupt(outcome, target_logits, drafts, seed)
        q_of_x = [q.prob(x) for x in drafts]
        result = accept_sampled(drafts, q_of_x, outcome, seed, PROMPT_LEN)
        counts[result.emitted_ids[0]] += 1
    return counts


GEN = torch.Generator().manual_seed(2024)
P_LOGITS = torch.randn(2, VOCAB, generator=GEN) * 1.5  # [k + 1, V]
Q_LOGITS = torch.randn(1, VOCAB, generator=GEN) * 1.5
MISSING = Q_LOGITS.clone()
MISSING[0, P_LOGITS[0].topk(3).indices] = float("-inf")  # q has no mass where p likes


@pytest.mark.parametrize(
    ("q_logits", "max_tokens", "params"),
    [
        pytest.param(Q_LOGITS, VOCAB, SamplingParams(), id="dense-q"),
        pytest.param(Q_LOGITS, 3, SamplingParams(), id="truncated-q"),
        pytest.param(MISSING, 4, SamplingParams(), id="q-misses-p-top-tokens"),
        pytest.param(P_LOGITS[:1], VOCAB, SamplingParams(), id="q-equals-p"),
        pytest.param(P_LOGITS[:1], 2, SamplingParams(), id="q-is-p-truncated"),
        pytest.param(Q_LOGITS, 5, SamplingParams(1.3, top_k=5, top_p=0.95), id="transformed"),
    ],
)
def test_first_emitted_token_is_distributed_as_p(q_logits, max_tokens, params):
    q = truncate(logits_to_probs(q_logits, params)[0], max_tokens)
    counts = first_tokens(P_LOGITS, q, params, trials=6_000)
    assert chi_square_pvalue(counts, target_p(P_LOGITS[:1], params)[0]) > ALPHA


def residual_from_p_without_the_draft(outcome, target_logits, drafts, seed):
    """A classic bug: recover from p with only x_i's mass removed, not max(0, p - q)."""
    p = logits_to_probs(target_logits, SamplingParams())  # [k + 1, V]
    recovery = []
    for i, x in enumerate(drafts):
        row = p[i].clone()
        row[x] = 0
        recovery.append(sample_dense(row, uniform(seed, PROMPT_LEN + i, Stream.RECOVERY)))
    return VerifyOutcome(target_probs=outcome.target_probs, recovery_ids=recovery,
                         bonus_id=outcome.bonus_id)


def test_negative_control_a_wrong_residual_is_caught():
    q = truncate(logits_to_probs(Q_LOGITS, SamplingParams())[0], 3)
    counts = first_tokens(P_LOGITS, q, SamplingParams(), 3_000, residual_from_p_without_the_draft)
    assert chi_square_pvalue(counts, target_p(P_LOGITS[:1], SamplingParams())[0]) < ALPHA


# ---------------------------------------------------------------- two-token sequences

SEQ_VOCAB = 5


def markov_table(seed: int, scale: float) -> torch.Tensor:
    """Logits [V + 1, V]: row V is the first token's, row a the next token's after a."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SEQ_VOCAB + 1, SEQ_VOCAB, generator=gen) * scale


P_TABLE = markov_table(7, 1.2)  # the target: p(. | last token)
Q_TABLE = markov_table(8, 1.0)  # the draft: a different model
Q_ROWS = [truncate(row, 3) for row in logits_to_probs(Q_TABLE, SamplingParams())]
START = SEQ_VOCAB  # table row used before any token was generated


def first_two_tokens(seed: int, k: int, bonus_row_bug: bool = False) -> tuple[int, int]:
    """A miniature orchestrator: rounds of k drafts until two tokens are emitted."""
    emitted: list[int] = []
    while len(emitted) < 2:
        position = PROMPT_LEN + len(emitted)
        last = emitted[-1] if emitted else START
        drafts, qs = [], []
        for i in range(k):
            q = Q_ROWS[drafts[-1] if drafts else last]
            drafts.append(draw_draft(q, seed, position + i))
            qs.append(q)
        rows = [last, *drafts]  # row i predicts the token after rows[i]
        if bonus_row_bug:
            rows[k] = rows[k - 1]  # off by one: the bonus drawn from p_k, not p_{k+1}
        logits = P_TABLE[rows]  # [k + 1, V]
        outcome = score_drafts(logits, drafts, qs, SamplingParams(), seed, position)
        q_of_x = [q.prob(x) for q, x in zip(qs, drafts)]
        emitted += accept_sampled(drafts, q_of_x, outcome, seed, position).emitted_ids
    return emitted[0], emitted[1]


def two_token_expectation() -> np.ndarray:
    p = target_p(P_TABLE, SamplingParams())  # [V + 1, V]
    return (p[START][:, None] * p[:SEQ_VOCAB]).reshape(-1)  # p(a) * p(b | a), flat


def two_token_counts(trials: int, k: int, bonus_row_bug: bool = False) -> Counter:
    counts: Counter = Counter()
    for seed in range(trials):
        a, b = first_two_tokens(seed, k, bonus_row_bug)
        counts[a * SEQ_VOCAB + b] += 1
    return counts


@pytest.mark.parametrize(("k", "trials"), [(1, 4_000), (2, 6_000)])
def test_two_token_sequences_are_distributed_as_the_target(k, trials):
    counts = two_token_counts(trials, k)
    assert chi_square_pvalue(counts, two_token_expectation()) > ALPHA


def test_negative_control_a_bonus_from_the_wrong_row_is_caught():
    counts = two_token_counts(2_000, 1, bonus_row_bug=True)
    assert chi_square_pvalue(counts, two_token_expectation()) < ALPHA


# ---------------------------------------------------------------- determinism


def test_a_seeded_round_is_deterministic():
    runs = [[first_two_tokens(seed, 3) for seed in range(40)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 5  # and the seed matters
    q = truncate(logits_to_probs(Q_LOGITS, SamplingParams())[0], 4)
    outcomes = [score_drafts(P_LOGITS, [1], [q], SamplingParams(), 99, 5) for _ in range(2)]
    assert outcomes[0] == outcomes[1]
