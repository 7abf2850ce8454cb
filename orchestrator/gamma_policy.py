"""γ policies: how many tokens the draft proposes in the next round (the lookahead k).

A policy is per-request state. The orchestrator asks ``next_k()`` before each round,
may propose fewer (for example near ``max_tokens``), and reports what happened with
``observe(RoundObservation)`` after the round. Policies never see tokens or
probabilities, only counts and timings, so any drafter fits behind them.

Policies here:

- ``fixed``: always the same k.
- ``adaptive``: the acceptance heuristic of HF transformers' assisted generation
  (+2 after a fully accepted round, -1 after a rejection).

Design note: the network-aware goodput policy (a later issue, not implemented here).
With a per-token acceptance estimate a (``AdaptivePolicy.acceptance`` keeps one),
and treating acceptances as independent, a round with lookahead k emits

    E[tokens](a, k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)

tokens (the accepted prefix plus the recovered or bonus token; see
``expected_tokens_per_round``). Its wall-clock cost is

    cost(k) = k * t_draft + t_verify(k, batch) + rtt_draft + rtt_target

where t_draft is the draft time per token, t_verify(k, batch) the verify time
measured for this k and batch size (the target's forward is nearly flat in k on an
accelerator until the batch saturates it), and the two round-trip times are paid
once per round whatever k is. The goodput policy picks the k in [k_min, k_max] that
maximizes E[tokens](a, k) / cost(k). Network latency is what makes it differ from a
single-machine policy: a large fixed per-round cost (the RTTs) pushes the best k up,
because each round must amortize it over more tokens. ``RoundObservation`` already
carries every quantity the cost model needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

POLICIES = ("fixed", "adaptive")
K_LIMIT = 32  # hard upper bound on k for every policy: one verify scores k + 1 positions


@dataclass(frozen=True)
class RoundObservation:
    """What one speculative round of one request cost and yielded."""

    k: int  # drafts proposed this round (0 when the round decoded plainly)
    accepted: int  # how many of the k drafts the target accepted, 0..k
    draft_time_s: float  # total draft time this round (all k proposals), as the orchestrator saw it
    verify_time_s: float  # verify time measured by the orchestrator, network and batching wait included
    verify_compute_s: float  # verify time reported by the target service (its forward pass only)
    batch_size: int  # sessions in the Verify batch this round rode in (1 when alone)
    draft_rtt_s: float  # round-trip network time estimate to the draft service; 0 when unknown
    target_rtt_s: float  # round-trip network time estimate to the target service; 0 when unknown

    def __post_init__(self) -> None:
        # Observations come from our own orchestrator: a bad one is a bug, not bad input.
        assert self.k >= 0, f"k must be >= 0, got {self.k}"
        assert 0 <= self.accepted <= self.k, f"accepted must be in [0, k={self.k}], got {self.accepted}"
        assert self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}"


class GammaPolicy(Protocol):
    """Chooses k for the next round of one request; one instance per request."""

    name: str

    def next_k(self) -> int:
        """The lookahead k for the next round, in [k_min, k_max]."""
        ...

    def observe(self, obs: RoundObservation) -> None:
        """Learn from the round just finished."""
        ...


class FixedPolicy:
    """Always proposes k drafts."""

    name = "fixed"

    def __init__(self, k: int):
        self._k = k

    def next_k(self) -> int:
        return self._k

    def observe(self, obs: RoundObservation) -> None:
        pass


class AdaptivePolicy:
    """Acceptance-adaptive k, the heuristic of HF transformers' assisted generation.

    After a round whose k > 0 drafts were all accepted, k += 2; after a round with a
    rejection, k -= 1; always within [k_min, k_max]. Rounds with k == 0 teach nothing
    and change nothing.

    Limitations: it is a heuristic, not an optimum. It ignores every timing (draft
    cost, verify cost, network round trips) and reacts to the last round only, so
    it oscillates around the point where rejections start. ``acceptance`` (an EWMA
    of the per-round acceptance rate) is kept for metrics and for the goodput policy
    described in the module docstring; this policy does not use it.
    """

    name = "adaptive"
    ALPHA = 0.3  # EWMA weight of the newest round
    INITIAL_ACCEPTANCE = 0.7  # prior before any round is observed

    def __init__(self, k: int, k_min: int, k_max: int):
        assert k_min <= k <= k_max, (k_min, k, k_max)
        self._k = k
        self._k_min = k_min
        self._k_max = k_max
        self._acceptance = self.INITIAL_ACCEPTANCE

    @property
    def acceptance(self) -> float:
        """Smoothed per-draft acceptance rate: EWMA over rounds of accepted / k."""
        return self._acceptance

    def next_k(self) -> int:
        return self._k

    def observe(self, obs: RoundObservation) -> None:
        if obs.k == 0:
            return
        self._acceptance += self.ALPHA * (obs.accepted / obs.k - self._acceptance)
        # Judged on what was actually proposed: the orchestrator may have capped k.
        if obs.accepted == obs.k:
            self._k = min(self._k + 2, self._k_max)
        else:
            self._k = max(self._k - 1, self._k_min)


def make_policy(name: str, k: int, k_min: int, k_max: int) -> GammaPolicy:
    """A fresh policy for one request. Raises ValueError for an unknown name or
    bounds outside 1 <= k_min <= k <= k_max <= 32."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose fixed or adaptive")
    _validate_bounds(k, k_min, k_max)
    if name == "fixed":
        return FixedPolicy(k)
    return AdaptivePolicy(k, k_min, k_max)


def _validate_bounds(k: int, k_min: int, k_max: int) -> None:
    for label, value in (("k", k), ("k_min", k_min), ("k_max", k_max)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{label} must be an integer, got {value!r}")
    if k_min < 1:
        raise ValueError(f"k_min must be >= 1, got {k_min}")
    if k_max > K_LIMIT:
        raise ValueError(f"k_max must be <= {K_LIMIT}, got {k_max}")
    if k_min > k_max:
        raise ValueError(f"k_min ({k_min}) must be <= k_max ({k_max})")
    if not k_min <= k <= k_max:
        raise ValueError(f"k must be in [k_min, k_max] = [{k_min}, {k_max}], got {k}")


def expected_tokens_per_round(a: float, k: int) -> float:
    """Expected tokens one round emits with lookahead k and per-draft acceptance a.

    (1 - a^(k+1)) / (1 - a), which is k + 1 at a == 1. Computed as the sum
    1 + a + ... + a^k, which is exact at a == 1 and avoids the cancellation of the
    closed form near it. Example: a = 0.5, k = 2 gives 1 + 0.5 + 0.25 = 1.75.
    """
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {a}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return sum(a**i for i in range(k + 1))
