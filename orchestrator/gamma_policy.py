"""Policies choosing how many tokens the draft proposes in the next round, k
(num_draft_tokens; the words are defined in `specdec.sampling.rejection`), at
most max_draft_tokens (`specdec.limits`).

A policy is per-request state. The orchestrator asks ``next_k()`` before each round,
may propose fewer (for example near ``max_tokens``), and reports what happened with
``observe(RoundObservation)`` after the round. Policies never see tokens or
probabilities, only counts and timings, so any drafter fits behind them.

Each policy also holds the request's early stop, ``min_confidence()``: the draft
ends a round once the product of its drafts' confidences falls below it (0:
never; `draft_service/drafters.py`). ``fixed`` and ``adaptive`` keep the
request's value; ``goodput`` starts from it and then sets it from its timings
(below), and with a stop its k is only a cap.

Policies here:

- ``fixed``: always the same k.
- ``adaptive``: the acceptance heuristic of HF transformers' assisted generation
  (+2 after a fully accepted round, -1 after a rejection).

- ``goodput``: the k that maximizes expected emitted tokens per second, from
  online estimates of acceptance, draft and verify compute, and the round-trip
  time to each service (``GoodputPolicy``; its model is below).

The goodput model. With a per-draft acceptance probability a, and treating
acceptances as independent, a round with lookahead k emits

    E[tokens](a, k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)

tokens (the accepted prefix plus the recovered or bonus token; see
``expected_tokens_per_round``). Its wall-clock cost is

    cost(k) = rtt_draft + k * t_draft + rtt_target + t_verify(k) + overhead

- t_draft: the draft service's compute per drafted token (it reports each
  token's compute time on the Propose stream);
- rtt_draft: the rest of the Propose call's time, paid once per round whatever
  k is: network round trip, streaming, queueing;
- t_verify(k) = c0 + c1 * k: the target's compute for the round's Verify
  batch, a line fitted to the recent (k, compute) pairs (the forward pass is
  nearly flat in k on an accelerator and on a CPU until the batch saturates
  it; with one k seen so far the slope is taken as 0);
- rtt_target: the rest of the Verify call's time (network round trip and the
  wait for the batch to fill);
- overhead: the rest of the round's wall time, outside both calls (the
  orchestrator's own work, streaming the tokens to the client). Small next to
  a real model's forward pass, but a tiny model's round can be half overhead,
  and leaving it out makes every round look cheaper than it is, so k too small.

Each round the policy picks the k in [k_min, k_max] that maximizes
E[tokens](a, k) / cost(k). The per-round costs (the two RTTs and c0) are what
the network changes: a larger fixed cost per round is amortized over more
tokens, so the best k grows with the RTT; a larger t_draft or a lower a pulls
it down. Estimates are per request: a is the ratio of decayed counts of
accepted drafts to accepted drafts plus rejections (the maximum-likelihood
estimate under independence), with a prior of 0.7 worth two trials; timings
are exponentially weighted (weight 0.4 for the newest round), so a jump in the
RTT moves the choice within two or three rounds. Cold start: before the first
round has been observed the policy proposes its starting k.

With an early stop (a request's draft_min_confidence > 0) the stop decides
each round's length and k is the cap, k_max; the policy sets the stop's
threshold instead. After j drafts whose confidences multiply to B (the
draft's estimate that all j will be accepted), one more draft costs t_draft
plus the verify line's slope c1, and is accepted with probability about
B * a, which saves the 1/R seconds a token takes at the request's measured
rate R (emitted tokens over round time). So drafting on pays while
B > (t_draft + c1) * R / a: that is the threshold, kept in [0.05, 0.95].
Drafting cheaper, or a lower rate (a slower network), lowers it, and rounds
draft longer. On the CPU pair it comes to about 0.5-0.6, near the best fixed
threshold measured there (docs/benchmarks.md).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol

from specdec.limits import DEFAULT_MAX_DRAFT_TOKENS, check_min_confidence, check_num_draft_tokens

POLICIES = ("fixed", "adaptive", "goodput")


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
    draft_compute_s: float = 0.0  # draft compute reported by the draft service for these k tokens
    overhead_s: float = 0.0  # the rest of the round's wall time: orchestration, streaming to the client; 0 when unknown

    def __post_init__(self) -> None:
        # Observations come from our own orchestrator: a bad one is a bug, not bad input.
        assert self.k >= 0, f"k must be >= 0, got {self.k}"
        assert 0 <= self.accepted <= self.k, f"accepted must be in [0, k={self.k}], got {self.accepted}"
        assert self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}"


def round_observation(k: int, accepted: int, draft_time_s: float, draft_compute_s: float, verify_rtt_s: float,
                      verify_compute_s: float, batch_size: int, cycle_s: float,
                      last: RoundObservation | None) -> RoundObservation:
    """What a policy learns from one round, as the loop measured it: `cycle_s`
    is the wall time since the previous round was observed (0: unknown);
    `last` the request's previous speculative round."""
    # The rest of the cycle, from what the round waited for: a pipelined
    # round's drafts cost it no wait.
    overhead_s = max(0.0, cycle_s - draft_time_s - verify_rtt_s) if cycle_s else 0.0
    if k and draft_time_s == 0 and last is not None and last.k:
        # Pipelined drafts: their cost was hidden; the policy models an
        # unpipelined round, so it learns the draft's last measured costs
        # (per token, scaled to this k), split as that round's were (a draft
        # reporting no compute, an n-gram's, is all round trip).
        draft_compute_s = last.draft_compute_s / last.k * k
        draft_time_s = last.draft_rtt_s + draft_compute_s
    return RoundObservation(
        k=k, accepted=accepted, draft_time_s=draft_time_s, verify_time_s=verify_rtt_s,
        verify_compute_s=verify_compute_s, batch_size=max(1, batch_size),
        draft_rtt_s=max(0.0, draft_time_s - draft_compute_s), target_rtt_s=max(0.0, verify_rtt_s - verify_compute_s),
        draft_compute_s=draft_compute_s,
        overhead_s=overhead_s,
    )


class GammaPolicy(Protocol):
    """Chooses k for the next round of one request; one instance per request."""

    name: str

    def next_k(self) -> int:
        """The lookahead k for the next round, in [k_min, k_max]."""
        ...

    def observe(self, obs: RoundObservation) -> None:
        """Learn from the round just finished."""
        ...

    def min_confidence(self) -> float:
        """The next round's early stop: the draft ends the round once the
        product of its drafts' confidences is below this (0: never)."""
        ...


class FixedPolicy:
    """Always proposes k drafts."""

    name = "fixed"

    def __init__(self, k: int, min_confidence: float = 0.0):
        self._k = k
        self._min_confidence = min_confidence

    def next_k(self) -> int:
        return self._k

    def observe(self, obs: RoundObservation) -> None:
        pass

    def min_confidence(self) -> float:
        return self._min_confidence


class AdaptivePolicy:
    """Acceptance-adaptive k, the heuristic of HF transformers' assisted generation.

    After a round whose k > 0 drafts were all accepted, k += 2; after a round with a
    rejection, k -= 1; always within [k_min, k_max]. Rounds with k == 0 teach nothing
    and change nothing.

    Limitations: it is a heuristic, not an optimum. It ignores every timing (draft
    cost, verify cost, network round trips) and reacts to the last round only, so
    it oscillates around the point where rejections start. ``acceptance`` (an EWMA
    of the per-round acceptance rate) is kept for metrics; this policy does not
    use it.
    """

    name = "adaptive"
    ALPHA = 0.3  # EWMA weight of the newest round
    INITIAL_ACCEPTANCE = 0.7  # prior before any round is observed

    def __init__(self, k: int, k_min: int, k_max: int, min_confidence: float = 0.0):
        assert k_min <= k <= k_max, (k_min, k, k_max)
        self._k = k
        self._k_min = k_min
        self._k_max = k_max
        self._min_confidence = min_confidence
        self._acceptance = self.INITIAL_ACCEPTANCE

    def min_confidence(self) -> float:
        return self._min_confidence

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


class GoodputPolicy:
    """Picks the k that maximizes expected tokens per second (the model is in the
    module docstring). Per request; all estimates start from priors."""

    name = "goodput"
    PRIOR_ACCEPTANCE = 0.7
    PRIOR_TRIALS = 2.0  # the prior's weight, in draft trials
    COUNT_DECAY = 0.85  # per round, for the acceptance counts
    ALPHA = 0.4  # EWMA weight of the newest round, for timings
    FIT_DECAY = 0.8  # per observation, for the t_verify(k) line
    STOP_RANGE = (0.05, 0.95)  # the early stop's threshold is kept within

    def __init__(self, k: int, k_min: int, k_max: int, min_confidence: float = 0.0):
        assert k_min <= k <= k_max, (k_min, k, k_max)
        self._k = k_max if min_confidence > 0 else k  # with a stop, k is the cap
        self._k_min = k_min
        self._k_max = k_max
        self._stop = min_confidence  # the request's value until timings set it; 0: no stop
        self._round_tokens: float | None = None  # EWMA of tokens a round emits
        self._round_s: float | None = None  # EWMA of a round's wall time
        self._accepted = 0.0  # decayed count of accepted drafts
        self._rejections = 0.0  # decayed count of rounds that ended in a rejection
        self.t_draft: float | None = None  # seconds per drafted token
        self.rtt_draft: float | None = None
        self.rtt_target: float | None = None
        self.overhead: float | None = None
        self._fit = [0.0] * 5  # decayed sums: w, w*k, w*k^2, w*y, w*k*y (y = verify compute)

    @property
    def acceptance(self) -> float:
        """Per-draft acceptance probability estimate."""
        return acceptance_estimate(self._accepted, self._rejections, self.PRIOR_ACCEPTANCE, self.PRIOR_TRIALS)

    def verify_cost(self, k: int) -> float:
        """Fitted target compute for a round with lookahead k, seconds."""
        w, wk, wkk, wy, wky = self._fit
        if w == 0:
            return 0.0
        det = w * wkk - wk * wk
        slope = max(0.0, (w * wky - wk * wy) / det) if det > 1e-9 * max(1.0, w * wkk) else 0.0
        intercept = (wy - slope * wk) / w
        return max(0.0, intercept + slope * k)

    def round_cost(self, k: int) -> float:
        """Modelled wall-clock seconds of a round with lookahead k."""
        return ((self.rtt_draft or 0.0) + k * (self.t_draft or 0.0) + (self.rtt_target or 0.0)
                + self.verify_cost(k) + (self.overhead or 0.0))

    def goodput(self, k: int) -> float:
        """Modelled tokens per second with lookahead k (inf before any timing)."""
        cost = self.round_cost(k)
        tokens = expected_tokens_per_round(self.acceptance, k)
        return tokens / cost if cost > 0 else float("inf")

    def next_k(self) -> int:
        return self._k

    def min_confidence(self) -> float:
        return self._stop

    def verify_slope(self) -> float:
        """The fitted line's seconds per drafted token (0 until two k's are seen)."""
        return max(0.0, self.verify_cost(1) - self.verify_cost(0)) if self._fit[0] else 0.0

    def stop_threshold(self) -> float | None:
        """Where one more draft stops paying (module docstring); None before a timed round."""
        if self.t_draft is None or not self._round_s or not self._round_tokens:
            return None
        rate = self._round_tokens / self._round_s
        low, high = self.STOP_RANGE
        return min(high, max(low, (self.t_draft + self.verify_slope()) * rate / self.acceptance))

    def observe(self, obs: RoundObservation) -> None:
        if obs.k == 0:
            return
        self._accepted = self.COUNT_DECAY * self._accepted + obs.accepted
        self._rejections = self.COUNT_DECAY * self._rejections + (obs.accepted < obs.k)
        if obs.verify_time_s > 0:  # a round with timings (not a what-if)
            draft_compute = obs.draft_compute_s if obs.draft_compute_s > 0 else obs.draft_time_s
            self.t_draft = ewma(self.t_draft, draft_compute / obs.k, self.ALPHA)
            self.rtt_draft = ewma(self.rtt_draft, max(0.0, obs.draft_time_s - draft_compute), self.ALPHA)
            self.rtt_target = ewma(self.rtt_target, max(0.0, obs.verify_time_s - obs.verify_compute_s), self.ALPHA)
            self.overhead = ewma(self.overhead, obs.overhead_s, self.ALPHA)
            y = obs.verify_compute_s
            decayed = [self.FIT_DECAY * v for v in self._fit]
            self._fit = [a + b for a, b in zip(decayed, (1.0, obs.k, obs.k * obs.k, y, obs.k * y))]
            self._round_tokens = ewma(self._round_tokens, obs.accepted + 1.0, self.ALPHA)
            self._round_s = ewma(self._round_s, obs.draft_time_s + obs.verify_time_s + obs.overhead_s, self.ALPHA)
        if self._stop > 0:  # the stop sets each round's length: k stays the cap
            self._stop = self.stop_threshold() or self._stop
            return
        if self.t_draft is None or self.round_cost(self._k_max) <= 0:
            return  # cold (no round timed yet), or nothing costs anything: keep k
        best = max(range(self._k_min, self._k_max + 1), key=lambda k: (self.goodput(k), -k))
        self._k = best


def ewma(old: float | None, new: float, weight: float) -> float:
    """Exponentially weighted mean; the first value starts it."""
    return new if old is None else old + weight * (new - old)


def acceptance_estimate(accepted: float, rejections: float, prior: float = 0.7, prior_trials: float = 2.0) -> float:
    """Per-draft acceptance probability: accepted / (accepted + rounds that ended
    in a rejection), the maximum-likelihood estimate under independence, with a
    prior worth `prior_trials` trials. Example: 6 accepted, 2 rejections, the
    default prior: (6 + 1.4) / (8 + 2) = 0.74."""
    return (accepted + prior * prior_trials) / (accepted + rejections + prior_trials)


def make_policy(name: str, k: int, k_min: int, k_max: int, limit: int = DEFAULT_MAX_DRAFT_TOKENS,
                min_confidence: float = 0.0) -> GammaPolicy:
    """A fresh policy for one request: k is the fixed or starting
    num_draft_tokens, [k_min, k_max] the bounds of an adaptive one,
    min_confidence the early stop (goodput's first round's; 0: none). Raises
    ValueError (InvalidArgument) for an unknown name, bounds outside
    1 <= k_min <= k <= k_max <= limit (max_draft_tokens) or a stop outside [0, 1]."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    _validate_bounds(k, k_min, k_max, limit)
    check_min_confidence(min_confidence, "draft_min_confidence")
    if name == "fixed":
        return FixedPolicy(k, min_confidence)
    if name == "goodput":
        return GoodputPolicy(k, k_min, k_max, min_confidence)
    return AdaptivePolicy(k, k_min, k_max, min_confidence)


def k_after_full_acceptance(policy: GammaPolicy, obs: RoundObservation) -> int:
    """The k `policy` would choose next if the round `obs` describes (its k
    drafts all accepted) happened; the policy itself is left unchanged.
    Pipelined drafting uses it to know how far to draft ahead."""
    what_if = copy.deepcopy(policy)
    what_if.observe(obs)
    return what_if.next_k()


def _validate_bounds(k: int, k_min: int, k_max: int, limit: int) -> None:
    # Named as the request names them (SpeculationOptions).
    bounds = (("num_draft_tokens", k), ("min_draft_tokens", k_min), ("max_draft_tokens", k_max))
    for label, value in bounds:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{label} must be an integer, got {value!r}")
    for _, value in bounds:
        check_num_draft_tokens(value, limit)
    if k_min > k_max:
        raise ValueError(f"min_draft_tokens ({k_min}) must be <= max_draft_tokens ({k_max})")
    if not k_min <= k <= k_max:
        raise ValueError(f"num_draft_tokens must be in [min_draft_tokens, max_draft_tokens] = [{k_min}, {k_max}], "
                         f"got {k}")


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
