"""The benchmark's arithmetic: percentiles, the analytic speedup bound and
the pooling of the orchestrator's per-request counters. Per-position
acceptance and the per-draft acceptance estimate α̂ live in acceptance.py.

Pure functions over numbers and plain dicts (no torch, no grpc), so every
figure `specd bench` reports can be checked by hand.

The bound follows Leviathan et al. (2023): with a per-draft acceptance
probability α, treated as independent across positions, a round with
lookahead k emits E = (1 − α^(k+1)) / (1 − α) tokens on average (the accepted
drafts plus the target's recovery or bonus token), and costs
k·t_draft + t_verify + overhead, so the expected rate is E / cost.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

from orchestrator.gamma_policy import expected_tokens_per_round
from specdec.bench.acceptance import alpha_mle, estimate_alpha, speculative_rounds

# ----------------------------------------------------------------- statistics


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between the
    closest ranks (numpy's default); None for no values.

    Example: percentile([1, 2, 3, 4], 50) == 2.5.
    """
    data = sorted(float(v) for v in values)
    if not data:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    pos = (len(data) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None if there are none."""
    return percentile([v for v in values if v is not None], 50.0)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def inter_token_samples(arrivals: Sequence[tuple[float, int]]) -> list[float]:
    """Per-token latency samples from client-side chunk arrivals.

    `arrivals` is [(seconds since the request started, tokens in the chunk)],
    in arrival order. A chunk of n tokens arriving dt after the previous chunk
    gives n samples of dt / n. The first chunk's tokens are the time to first
    token, not per-token latency, so they give no samples.

    Example: [(1.0, 1), (1.3, 3), (1.4, 1)] gives [0.1, 0.1, 0.1, 0.1].
    """
    samples: list[float] = []
    for (t_prev, _), (t, n) in zip(arrivals, arrivals[1:]):
        if n > 0:
            samples.extend([(t - t_prev) / n] * n)
    return samples


# -------------------------------------------------------------------- bound


def expected_tokens(alpha: float, k: float) -> float:
    """E[tokens per round] = (1 − α^(k+1)) / (1 − α) = 1 + α + … + α^k.

    Integer k uses the orchestrator's own `expected_tokens_per_round`; a
    mean k (adaptive, goodput) uses the closed form at real k (k + 1 at α = 1).

    Example: α = 0.5, k = 2: 1.75.
    """
    if float(k).is_integer():
        return expected_tokens_per_round(alpha, int(k))
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {alpha}")
    if alpha == 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1.0)) / (1.0 - alpha)


def analytic_bound(*, alpha: float | None, k: float, t_draft_s: float | None, t_verify_s: float | None,
                   overhead_s: float = 0.0, baseline_tokens_per_s: float | None = None) -> dict:
    """The expected rate of speculative decoding from measured costs.

    cost per round = k · t_draft + t_verify + overhead (seconds); expected
    tokens/s = E(α, k) / cost; expected speedup = that / the baseline's
    measured tokens/s. Missing inputs give None figures.

    Example: α = 0.8, k = 4 (E = 3.3616), t_draft = 0.1, t_verify = 0.25,
    overhead 0: cost 0.65 s, 5.17 tokens/s; vs a 4 tokens/s baseline 1.29x.
    """
    out = {"alpha": alpha, "k": k, "expected_tokens_per_round": None, "cost_per_round_s": None,
           "expected_tokens_per_s": None, "expected_speedup": None}
    if alpha is None or t_draft_s is None or t_verify_s is None:
        return out
    e = expected_tokens(alpha, k)
    cost = k * t_draft_s + t_verify_s + max(0.0, overhead_s)
    out["expected_tokens_per_round"] = e
    out["cost_per_round_s"] = cost
    if cost > 0:
        out["expected_tokens_per_s"] = e / cost
        out["expected_speedup"] = ratio(e / cost, baseline_tokens_per_s)
    return out


def efficiency(measured_speedup: float | None, expected_speedup: float | None) -> float | None:
    """System efficiency: measured speedup ÷ expected speedup (1.0: the system
    delivers what its measured acceptance and costs predict)."""
    return ratio(measured_speedup, expected_speedup)


# ---------------------------------------------------------- pooled counters

SUMMED_STATS = ("completion_tokens", "prompt_tokens", "rounds", "proposed_tokens", "accepted_tokens",
                "fallback_rounds", "draft_time_s", "verify_time_s", "target_compute_time_s",
                "draft_compute_time_s", "wire_bytes", "round_trips", "pipelined_rounds", "duration_s",
                "prefill_time_s", "plain_rounds")


def _add_lists(total: list[int], more: Sequence[int]) -> None:
    if len(total) < len(more):
        total.extend([0] * (len(more) - len(total)))
    for i, v in enumerate(more):
        total[i] += v


def pool_stats(stats: Iterable[dict]) -> dict:
    """Sum the orchestrator's per-request statistics (dicts with the
    GenerateStats field names; `k` as {"histogram": [...], ...})."""
    pooled: dict = {name: 0 for name in SUMMED_STATS}
    pooled["k_histogram"] = []
    pooled["accepted_per_position"] = []
    pooled["requests"] = 0
    # rejected_rounds is exact when every request reports it (None otherwise:
    # records from before the orchestrator counted it).
    pooled["rejected_rounds"] = 0
    for s in stats:
        pooled["requests"] += 1
        if pooled["rejected_rounds"] is not None:
            pooled["rejected_rounds"] = (None if s.get("rejected_rounds") is None
                                         else pooled["rejected_rounds"] + s["rejected_rounds"])
        for name in SUMMED_STATS:
            pooled[name] += s.get(name) or 0
        _add_lists(pooled["k_histogram"], (s.get("k") or {}).get("histogram") or [])
        _add_lists(pooled["accepted_per_position"], s.get("accepted_per_position") or [])
    return pooled


def mean_k(k_histogram: Sequence[int]) -> float | None:
    """Mean k over the rounds that drafted (k ≥ 1)."""
    rounds = speculative_rounds(k_histogram)
    if not rounds:
        return None
    return sum(j * n for j, n in enumerate(k_histogram) if j >= 1) / rounds


def time_split(pooled: dict) -> dict:
    """Where the orchestrator's time went, summed over requests.

    draft = the draft service's own forward time (draft_compute_time_s; when
    the orchestrator does not report it, the propose time it measured,
    draft_time_s, network included, and draft_compute_reported is False);
    target = the target service's verify compute (target_compute_time_s);
    prefill = the session opens the request waited for (prefill_time_s: both
    services' prefills, run at once, and any re-open): model time, reported
    on its own (0 in records from before the orchestrator counted it, which
    then sit in other);
    other = network + orchestration = duration − draft − target − prefill:
    gRPC and serialization, the verify batcher's window, session closes,
    acceptance, and any added network delay. Shares are of the summed
    duration. With pipelined drafting the draft computes while the target
    verifies: draft and target then overlap, their shares can add up to more
    than the request's time, and other is the system's own time less that
    overlap, negative when the overlap is the larger. It is reported as it
    is (it was floored at 0, which showed a pipelined run's overlap as an
    "other" of 0%); overlap_s says how far the three model terms exceed the
    request's time (0 when they do not).

    At concurrency > 1 a batched Verify (or draft step) reports the whole
    pass's compute to each request it carried: each request did wait that
    long, so the shares of request time hold, but the seconds summed over
    requests are request time, not the services' busy time (a pass shared
    by 8 requests counts 8 times).
    """
    duration = pooled.get("duration_s") or 0.0
    reported = (pooled.get("draft_compute_time_s") or 0.0) > 0 or not pooled.get("proposed_tokens")
    draft = (pooled.get("draft_compute_time_s") or 0.0) if reported else (pooled.get("draft_time_s") or 0.0)
    target = pooled.get("target_compute_time_s") or 0.0
    prefill = pooled.get("prefill_time_s") or 0.0
    other = duration - draft - target - prefill
    return {
        "draft_s": draft, "target_s": target, "prefill_s": prefill, "other_s": other, "duration_s": duration,
        "overlap_s": max(0.0, -other),
        "draft_share": ratio(draft, duration), "target_share": ratio(target, duration),
        "prefill_share": ratio(prefill, duration), "other_share": ratio(other, duration),
        "draft_compute_reported": reported,
        "draft_rpc_s": pooled.get("draft_time_s") or 0.0, "verify_rpc_s": pooled.get("verify_time_s") or 0.0,
    }


# A fixed-k run whose rounds drafted fewer than this share of k on average (besides the few
# short rounds at a request's end) stopped early: its bound uses the mean k.
EARLY_STOPS = 0.9


def draft_cost_split(pooled: dict, t_draft: float) -> dict:
    """A Propose's cost as a part per call and a part per drafted token, for
    the projections (projection.py): per token, the draft's compute per
    drafted token (what the draft service reports); per call, the rest of the
    Propose RPC (wire, the service's loop) over the calls made. Without the
    compute reported: all of it per token, as t_draft.

    The split matters when rounds draft fewer tokens than k (a draft unsure of
    its tokens ends the round early; a random draft after one token): then
    t_draft, the RPC time per drafted token, charges each further token a
    whole call. Compute per token still includes the call's first step (the
    appended tokens): a sweep over k separates that."""
    compute = pooled.get("draft_compute_time_s")
    calls = speculative_rounds(pooled["k_histogram"]) or pooled["rounds"]
    if not compute or not pooled["proposed_tokens"] or not calls:
        return {"t_draft_token_s": t_draft, "t_draft_call_s": 0.0}
    return {"t_draft_token_s": compute / pooled["proposed_tokens"],
            "t_draft_call_s": max(0.0, pooled["draft_time_s"] - compute) / calls}


def bound_for_run(pooled: dict, *, nominal_k: int | None, measured_tokens_per_s: float | None,
                  baseline_tokens_per_s: float | None, baseline_compute_tokens_per_s: float | None) -> dict:
    """The analytic bound of one run from its pooled counters.

    α̂ from estimate_alpha; k = the configured k for a fixed policy, else
    (and for a fixed run whose rounds drafted under EARLY_STOPS · k on
    average: the draft's min confidence ended them) the mean k of the rounds
    that drafted (k_is_mean True). Measured costs, as the
    orchestrator timed them: t_draft = draft_time_s / proposed tokens (the
    propose RPC per drafted token, network included), t_verify =
    verify_time_s / rounds, overhead = (duration − draft_time − verify_time)
    / rounds (orchestration outside the two RPCs; floored at 0). Expected
    speedup is against the measured target-only (service) tokens/s; efficiency
    = measured speedup / expected speedup.

    The ideal bound uses compute only: t_draft = draft_compute_time_s per
    drafted token, t_verify = target_compute_time_s per round, no overhead,
    against target-only's compute-only rate (its tokens / its
    target_compute_time_s). None when the draft compute is not reported.
    """
    if pooled.get("rejected_rounds") is not None:
        # The orchestrator counted the rounds that ended in a rejection: exact.
        rejections = float(pooled["rejected_rounds"])
        alpha = alpha_mle(pooled["accepted_tokens"], rejections)
    else:
        alpha, rejections = estimate_alpha(pooled["accepted_tokens"], pooled["k_histogram"],
                                           pooled["accepted_per_position"])
    drafted = mean_k(pooled["k_histogram"])
    # The bound drafts k a round. A fixed-k run whose rounds mostly stopped early (the draft's
    # min confidence) is described by the drafts it made, as an adaptive run is.
    k_is_mean = nominal_k is None or (drafted is not None and drafted < EARLY_STOPS * nominal_k)
    k = drafted if k_is_mean else nominal_k
    rounds = pooled["rounds"]
    proposed = pooled["proposed_tokens"]
    out = {"alpha_hat": alpha, "rejected_rounds": rejections, "k": k, "k_is_mean": k_is_mean}
    if k is None or not rounds or not proposed:
        out.update(analytic_bound(alpha=None, k=0, t_draft_s=None, t_verify_s=None))
        out.pop("alpha", None)
        out["k"] = k
        out.update({"t_draft_s": None, "t_verify_s": None, "overhead_s": None, "efficiency": None,
                    "round_overhead_s": None, "prefill_per_request_s": None,
                    "t_draft_token_s": None, "t_draft_call_s": None,
                    "measured_speedup": ratio(measured_tokens_per_s, baseline_tokens_per_s),
                    "ideal": {"expected_tokens_per_s": None, "expected_speedup": None}})
        return out
    t_draft = pooled["draft_time_s"] / proposed
    t_verify = pooled["verify_time_s"] / rounds
    overhead = max(0.0, pooled["duration_s"] - pooled["draft_time_s"] - pooled["verify_time_s"]) / rounds
    out.update(draft_cost_split(pooled, t_draft))
    out.update(analytic_bound(alpha=alpha, k=k, t_draft_s=t_draft, t_verify_s=t_verify, overhead_s=overhead,
                              baseline_tokens_per_s=baseline_tokens_per_s))
    out.pop("alpha", None)  # alpha_hat already says it
    measured_speedup = ratio(measured_tokens_per_s, baseline_tokens_per_s)
    # The projection's terms: a round's own overhead, and the session opens
    # (model time) paid once per request, not spread over its rounds.
    prefill = pooled.get("prefill_time_s") or 0.0
    round_overhead = max(0.0, pooled["duration_s"] - prefill - pooled["draft_time_s"] - pooled["verify_time_s"]) / rounds
    out.update({"t_draft_s": t_draft, "t_verify_s": t_verify, "overhead_s": overhead,
                "round_overhead_s": round_overhead, "prefill_per_request_s": prefill / max(1, pooled["requests"]),
                "measured_speedup": measured_speedup,
                "efficiency": efficiency(measured_speedup, out["expected_speedup"])})
    ideal = {"expected_tokens_per_s": None, "expected_speedup": None}
    if pooled.get("draft_compute_time_s"):
        ib = analytic_bound(alpha=alpha, k=k, t_draft_s=pooled["draft_compute_time_s"] / proposed,
                            t_verify_s=pooled["target_compute_time_s"] / rounds, overhead_s=0.0,
                            baseline_tokens_per_s=baseline_compute_tokens_per_s)
        ideal = {"expected_tokens_per_s": ib["expected_tokens_per_s"], "expected_speedup": ib["expected_speedup"]}
    out["ideal"] = ideal
    return out
