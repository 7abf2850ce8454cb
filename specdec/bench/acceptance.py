"""Acceptance estimation from the orchestrator's counters: per-position
acceptance (cumulative and conditional) and the per-draft acceptance
probability α̂ (MLE, and the moment estimate used for mixed-k runs).

Split out of analysis.py, which keeps the statistics, the analytic bound and
the pooling of counters and imports what it needs from here. Pure functions
over numbers (no torch, no grpc), like the rest of the benchmark arithmetic.
"""
from __future__ import annotations

from typing import Sequence

# ------------------------------------------------------- acceptance by position


def speculative_rounds(k_histogram: Sequence[int]) -> int:
    """Rounds that drafted at least one token (histogram[k] = rounds with k drafts)."""
    return sum(k_histogram[1:])


def rounds_reaching(k_histogram: Sequence[int], position: int) -> int:
    """Rounds whose draft reached `position` (0-based): rounds with k > position."""
    return sum(k_histogram[position + 1:])


def acceptance_per_position(accepted_per_position: Sequence[int], k_histogram: Sequence[int]) -> list[float | None]:
    """accepted_per_position[i] / rounds that drafted a token at position i.

    accepted_per_position[i] counts rounds whose first i + 1 drafts were all
    accepted, so this is P(the first i + 1 drafts are accepted | k > i), the
    cumulative acceptance (≈ α^(i+1) for independent acceptances). For a
    fixed k the denominator is every round of that k.

    Example: k = 3 in 10 rounds, accepted_per_position [8, 6, 4] gives [0.8, 0.6, 0.4].
    """
    out: list[float | None] = []
    for i in range(max(len(k_histogram) - 1, len(accepted_per_position))):
        reached = rounds_reaching(k_histogram, i)
        accepted = accepted_per_position[i] if i < len(accepted_per_position) else 0
        out.append(accepted / reached if reached else None)
    return out


def conditional_acceptance_per_position(accepted_per_position: Sequence[int],
                                        k_histogram: Sequence[int]) -> list[float | None]:
    """P(draft i accepted | drafts 0..i−1 accepted): accepted_per_position[i]
    over the rounds that got that far (for i = 0: rounds with k ≥ 1).

    Exact for a fixed k; with mixed k a round that stopped at i because its k
    was i counts as having got that far (slightly low for such positions).

    Example: k = 3 in 10 rounds, [8, 6, 4] gives [0.8, 0.75, 0.667].
    """
    out: list[float | None] = []
    for i in range(max(len(k_histogram) - 1, len(accepted_per_position))):
        before = rounds_reaching(k_histogram, 0) if i == 0 else (
            accepted_per_position[i - 1] if i - 1 < len(accepted_per_position) else 0)
        accepted = accepted_per_position[i] if i < len(accepted_per_position) else 0
        out.append(accepted / before if before else None)
    return out


# ----------------------------------------------------------------- α estimate


def alpha_mle(accepted: int, rejections: float) -> float | None:
    """The maximum-likelihood per-draft acceptance probability for independent
    acceptances: every drafted token that was evaluated is a Bernoulli trial,
    successes = accepted drafts, failures = rounds that ended in a rejection
    (a round has at most one). None when nothing was evaluated.

    Example: 18 accepted, 6 rejections: 18 / 24 = 0.75.
    """
    trials = accepted + rejections
    return accepted / trials if trials > 0 else None


def alpha_from_moments(accepted: int, k_histogram: Sequence[int]) -> float | None:
    """The α at which the expected accepted drafts of the observed rounds,
    Σ_j rounds(k=j) · (α + α² + … + α^j), equal the accepted drafts counted
    (unique: the sum increases with α). None when nothing was drafted.

    Example: 10 rounds of k=2 with 7.5 drafts accepted: 10 (α + α²) = 7.5, α = 0.5.
    """
    hist = list(k_histogram)
    proposed = sum(j * n for j, n in enumerate(hist))
    if proposed == 0:
        return None
    if accepted >= proposed:
        return 1.0
    if accepted <= 0:
        return 0.0

    def expected(a: float) -> float:
        return sum(n * sum(a**i for i in range(1, j + 1)) for j, n in enumerate(hist) if j >= 1)

    low, high = 0.0, 1.0
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if expected(mid) < accepted else (low, mid)
    return (low + high) / 2


def estimate_alpha(accepted: int, k_histogram: Sequence[int],
                   accepted_per_position: Sequence[int]) -> tuple[float | None, float]:
    """(α̂, rounds with a rejection) from a request's (or run's) counters, for
    records without the orchestrator's own rejected_rounds count.

    α̂ = accepted / (accepted + rounds that ended in a rejection), the MLE
    for independent acceptances. Rounds with k = 0 (fallback, or the last
    token before max_tokens) drafted nothing and are left out. Among the
    rounds with the largest k seen, k_max, the fully accepted ones are known
    exactly, accepted_per_position[k_max − 1] (no smaller round reaches that
    position), so their rejections are rounds(k_max) −
    accepted_per_position[k_max − 1]: with one k (a fixed policy, no capped
    round) this is the whole answer. The counters do not say which of the
    smaller rounds (for a fixed k: the few capped near max_tokens; for
    adaptive and goodput: most of them) were fully accepted, so those count
    their expected rejections, rounds(k=j) · (1 − α_m^j), with α_m from
    `alpha_from_moments` (which uses only the accepted count and the k
    histogram).

    Example: k = 3 in 10 rounds, accepted_per_position [8, 6, 4]: 18 accepted,
    10 − 4 = 6 rejections, α̂ = 0.75.
    """
    hist = list(k_histogram)
    ks = [j for j in range(1, len(hist)) if hist[j] > 0]
    if not ks:
        return None, 0.0
    k_max = ks[-1]
    full = accepted_per_position[k_max - 1] if k_max - 1 < len(accepted_per_position) else 0
    rejections = float(hist[k_max] - full)
    smaller = [(j, hist[j]) for j in ks[:-1]]
    if smaller:
        alpha_m = alpha_from_moments(accepted, hist)
        rejections += sum(n * (1.0 - alpha_m**j) for j, n in smaller)
    return alpha_mle(accepted, rejections), rejections
