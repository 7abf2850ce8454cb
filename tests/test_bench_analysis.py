"""specd bench's arithmetic on numbers worked out by hand."""
from __future__ import annotations

import pytest

from specdec.bench import acceptance as AC
from specdec.bench import analysis as A


def test_percentile_interpolates_like_numpy():
    assert A.percentile([1, 2, 3, 4], 50) == 2.5
    assert A.percentile([5, 1, 4, 2, 3], 95) == pytest.approx(4.8)
    assert A.percentile([7], 95) == 7
    assert A.percentile([], 50) is None
    assert A.median([3, None, 1, 2]) == 2
    with pytest.raises(ValueError):
        A.percentile([1], 101)


def test_inter_token_samples_split_chunks_evenly_and_skip_the_first():
    samples = A.inter_token_samples([(1.0, 1), (1.3, 3), (1.4, 1)])
    assert samples == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert A.inter_token_samples([(0.5, 4)]) == []
    assert A.inter_token_samples([]) == []


def test_acceptance_per_position_fixed_k():
    hist, apos = [0, 0, 0, 10], [8, 6, 4]
    assert AC.acceptance_per_position(apos, hist) == pytest.approx([0.8, 0.6, 0.4])
    assert AC.conditional_acceptance_per_position(apos, hist) == pytest.approx([0.8, 0.75, 4 / 6])


def test_acceptance_per_position_mixed_k_uses_rounds_that_drafted_there():
    # 5 rounds of k=2 and 10 of k=3; position 3 (index 2) is reached only by the k=3 rounds
    hist, apos = [2, 0, 5, 10], [12, 8, 4]
    assert AC.acceptance_per_position(apos, hist) == pytest.approx([12 / 15, 8 / 15, 0.4])
    assert AC.rounds_reaching(hist, 2) == 10
    assert AC.speculative_rounds(hist) == 15
    assert A.mean_k([1, 0, 2, 2]) == 2.5
    assert A.mean_k([4]) is None


def test_alpha_mle_one_k():
    assert AC.alpha_mle(18, 6) == 0.75
    assert AC.alpha_mle(0, 0) is None
    alpha, rejections = AC.estimate_alpha(18, [0, 0, 0, 10], [8, 6, 4])
    assert alpha == 0.75 and rejections == 6
    # k = 0 rounds (fallback, last token) are left out
    assert AC.estimate_alpha(18, [7, 0, 0, 10], [8, 6, 4]) == (0.75, 6)
    assert AC.estimate_alpha(0, [5], []) == (None, 0.0)


def test_alpha_from_moments():
    assert AC.alpha_from_moments(7.5, [0, 0, 10]) == pytest.approx(0.5)   # 10 (a + a^2) = 7.5
    assert AC.alpha_from_moments(0, [0, 3]) == 0.0
    assert AC.alpha_from_moments(6, [0, 0, 3]) == 1.0
    assert AC.alpha_from_moments(3, [4]) is None


def test_alpha_with_a_capped_round():
    # k=3 x 10 rounds plus one round capped to k=1 near max_tokens; 19 accepted.
    # The k=3 rounds had 10 - 4 = 6 rejections; the k=1 round is expected to have 1 - a_m,
    # where 10 (a + a^2 + a^3) + a = 19 gives a_m.
    alpha, rejections = AC.estimate_alpha(19, [0, 1, 0, 10], [9, 6, 4])
    a_m = AC.alpha_from_moments(19, [0, 1, 0, 10])
    assert 10 * (a_m + a_m**2 + a_m**3) + a_m == pytest.approx(19)
    assert rejections == pytest.approx(6 + 1 - a_m)
    assert alpha == pytest.approx(19 / (19 + rejections))


def test_alpha_mixed_k_without_rejections_in_the_largest_rounds_stays_below_one():
    # adaptive/goodput: the k=5 rounds were all accepted, the rejections were in smaller rounds
    alpha, rejections = AC.estimate_alpha(24, [0, 0, 2, 4, 0, 2], [8, 7, 5, 2, 2])
    assert alpha is not None and alpha < 1 and rejections > 0


def test_expected_tokens_integer_and_mean_k():
    assert A.expected_tokens(0.5, 2) == 1.75
    assert A.expected_tokens(0.5, 2.0) == 1.75
    assert A.expected_tokens(1.0, 2.5) == 3.5
    assert A.expected_tokens(0.5, 1.5) == pytest.approx((1 - 0.5 ** 2.5) / 0.5)
    assert A.expected_tokens(0.8, 4) == pytest.approx(3.3616)


def test_analytic_bound_and_efficiency():
    b = A.analytic_bound(alpha=0.8, k=4, t_draft_s=0.1, t_verify_s=0.25, overhead_s=0.0, baseline_tokens_per_s=4.0)
    assert b["expected_tokens_per_round"] == pytest.approx(3.3616)
    assert b["cost_per_round_s"] == pytest.approx(0.65)
    assert b["expected_tokens_per_s"] == pytest.approx(3.3616 / 0.65)
    assert b["expected_speedup"] == pytest.approx(3.3616 / 0.65 / 4.0)
    assert A.analytic_bound(alpha=None, k=4, t_draft_s=0.1, t_verify_s=0.2)["expected_speedup"] is None
    assert A.efficiency(1.2, 1.5) == pytest.approx(0.8)
    assert A.efficiency(None, 1.5) is None and A.efficiency(1.0, 0) is None


def _stats(**over):
    s = dict(completion_tokens=40, prompt_tokens=20, rounds=10, proposed_tokens=30, accepted_tokens=18,
             k={"histogram": [0, 0, 0, 10]}, accepted_per_position=[8, 6, 4], fallback_rounds=0,
             draft_time_s=3.0, verify_time_s=2.0, target_compute_time_s=1.5, draft_compute_time_s=2.4,
             wire_bytes=4000, round_trips=21, pipelined_rounds=0, duration_s=5.5)
    s.update(over)
    return s


def test_pool_stats_sums_counters_and_lists():
    pooled = A.pool_stats([_stats(), _stats(k={"histogram": [1, 0, 0, 10, 2]}, accepted_per_position=[1, 1, 1, 1])])
    assert pooled["requests"] == 2
    assert pooled["completion_tokens"] == 80 and pooled["wire_bytes"] == 8000
    assert pooled["k_histogram"] == [1, 0, 0, 20, 2]
    assert pooled["accepted_per_position"] == [9, 7, 5, 1]


def test_bound_for_run_on_known_numbers():
    pooled = A.pool_stats([_stats(), _stats()])
    b = A.bound_for_run(pooled, nominal_k=3, measured_tokens_per_s=4.0, baseline_tokens_per_s=2.0,
                        baseline_compute_tokens_per_s=3.0)
    assert b["alpha_hat"] == 0.75 and b["k"] == 3 and not b["k_is_mean"]
    assert b["t_draft_s"] == pytest.approx(0.1)      # 6 s / 60 drafted tokens
    assert b["t_verify_s"] == pytest.approx(0.2)     # 4 s / 20 rounds
    assert b["overhead_s"] == pytest.approx(0.05)    # (11 - 6 - 4) s / 20 rounds
    e = 1 + 0.75 + 0.75 ** 2 + 0.75 ** 3
    assert b["expected_tokens_per_round"] == pytest.approx(e)
    assert b["expected_tokens_per_s"] == pytest.approx(e / 0.55)
    assert b["expected_speedup"] == pytest.approx(e / 0.55 / 2.0)
    assert b["measured_speedup"] == pytest.approx(2.0)
    assert b["efficiency"] == pytest.approx(2.0 / (e / 0.55 / 2.0))
    # ideal: 4.8 s / 60 drafted = 0.08, 3 s / 20 rounds = 0.15, vs 3 tokens/s compute-only
    assert b["ideal"]["expected_speedup"] == pytest.approx(e / (3 * 0.08 + 0.15) / 3.0)


def test_the_propose_cost_splits_into_a_part_per_call_and_a_part_per_drafted_token():
    # Rounds that drafted all k = 3: the split adds up to the RPC time per round, as t_draft did.
    pooled = A.pool_stats([_stats(), _stats()])
    b = A.bound_for_run(pooled, nominal_k=3, measured_tokens_per_s=4.0, baseline_tokens_per_s=2.0,
                        baseline_compute_tokens_per_s=3.0)
    assert b["t_draft_token_s"] == pytest.approx(0.08)   # 4.8 s compute / 60 drafted
    assert b["t_draft_call_s"] == pytest.approx(0.06)    # (6 − 4.8) s / 20 calls
    assert b["t_draft_call_s"] + 3 * b["t_draft_token_s"] == pytest.approx(3 * b["t_draft_s"])
    # Rounds that stopped after one draft (k = 4 configured; one round of k = 0 makes no call):
    # per drafted token the RPC time is a whole call, the compute is not.
    early = A.pool_stats([_stats(rounds=11, proposed_tokens=10, k={"histogram": [1, 10]}, accepted_per_position=[0],
                                 accepted_tokens=0, draft_time_s=0.020, draft_compute_time_s=0.012)])
    split = A.draft_cost_split(early, early["draft_time_s"] / early["proposed_tokens"])
    assert split["t_draft_token_s"] == pytest.approx(0.0012) and split["t_draft_call_s"] == pytest.approx(0.0008)
    # Without the draft's compute reported: all of it per token, as before.
    assert A.draft_cost_split(dict(early, draft_compute_time_s=0.0), 0.002) == {"t_draft_token_s": 0.002,
                                                                                "t_draft_call_s": 0.0}


def test_a_fixed_run_whose_rounds_stopped_early_is_bounded_at_the_drafts_it_made():
    """A random draft on a GPU: every round of a fixed k = 4 stopped after one draft (min
    confidence), so the bound at k = 4 would charge four drafts a round that no round made."""
    early = A.pool_stats([_stats(rounds=11, proposed_tokens=10, k={"histogram": [1, 10]}, accepted_per_position=[0],
                                 accepted_tokens=0, draft_time_s=0.020, draft_compute_time_s=0.012,
                                 verify_time_s=0.055, duration_s=0.080)])
    b = A.bound_for_run(early, nominal_k=4, measured_tokens_per_s=137.5, baseline_tokens_per_s=180.0,
                        baseline_compute_tokens_per_s=200.0)
    assert b["k"] == 1.0 and b["k_is_mean"]
    assert b["cost_per_round_s"] == pytest.approx(0.002 + 0.005 + (0.080 - 0.020 - 0.055) / 11)
    # Rounds that drafted k but for a request's short last rounds keep the configured k.
    full = A.pool_stats([_stats(k={"histogram": [1, 0, 1, 0, 20]})])
    assert A.bound_for_run(full, nominal_k=4, measured_tokens_per_s=4.0, baseline_tokens_per_s=2.0,
                           baseline_compute_tokens_per_s=3.0)["k"] == 4


def test_bound_for_run_adaptive_uses_mean_k():
    pooled = A.pool_stats([_stats(k={"histogram": [0, 0, 5, 5]}, accepted_per_position=[8, 5, 2],
                                  proposed_tokens=25, accepted_tokens=15)])
    b = A.bound_for_run(pooled, nominal_k=None, measured_tokens_per_s=1.0, baseline_tokens_per_s=1.0,
                        baseline_compute_tokens_per_s=None)
    assert b["k_is_mean"] and b["k"] == 2.5
    assert b["expected_tokens_per_round"] == pytest.approx(A.expected_tokens(b["alpha_hat"], 2.5))
    assert b["ideal"]["expected_speedup"] is None  # no compute-only baseline


def test_time_split_definitions():
    ts = A.time_split(A.pool_stats([_stats(), _stats()]))
    assert ts["draft_s"] == pytest.approx(4.8) and ts["target_s"] == pytest.approx(3.0)
    assert ts["other_s"] == pytest.approx(11 - 4.8 - 3.0)
    assert ts["draft_share"] + ts["target_share"] + ts["other_share"] == pytest.approx(1.0)
    assert ts["prefill_s"] == 0.0  # records from before prefill was reported
    # the session opens are model time, reported on their own, not in other
    with_prefill = A.time_split(A.pool_stats([_stats(prefill_time_s=0.5), _stats(prefill_time_s=0.25)]))
    assert with_prefill["prefill_s"] == pytest.approx(0.75)
    assert with_prefill["other_s"] == pytest.approx(11 - 4.8 - 3.0 - 0.75)
    assert (with_prefill["draft_share"] + with_prefill["target_share"] + with_prefill["prefill_share"]
            + with_prefill["other_share"]) == pytest.approx(1.0)
    assert ts["draft_compute_reported"]
    # an orchestrator that does not report the draft's compute: the propose RPC time stands in
    old = A.time_split(A.pool_stats([_stats(draft_compute_time_s=0.0)]))
    assert not old["draft_compute_reported"] and old["draft_s"] == 3.0
    # target-only: nothing drafted, nothing missing
    assert A.time_split(A.pool_stats([_stats(proposed_tokens=0, draft_time_s=0, draft_compute_time_s=0)]))[
        "draft_compute_reported"]


def test_the_bound_uses_the_orchestrators_exact_rejection_count_when_reported():
    from specdec.bench.analysis import bound_for_run, pool_stats

    stats = [dict(completion_tokens=40, rounds=10, proposed_tokens=40, accepted_tokens=30, rejected_rounds=6,
                  duration_s=4.0, draft_time_s=1.0, verify_time_s=2.0, target_compute_time_s=1.8,
                  draft_compute_time_s=0.9, k={"histogram": [0, 0, 0, 0, 10]},
                  accepted_per_position=[9, 8, 7, 6])]
    pooled = pool_stats(stats)
    assert pooled["rejected_rounds"] == 6
    bound = bound_for_run(pooled, nominal_k=4, measured_tokens_per_s=10.0, baseline_tokens_per_s=5.0,
                          baseline_compute_tokens_per_s=6.0)
    assert bound["alpha_hat"] == pytest.approx(30 / 36)
    del stats[0]["rejected_rounds"]  # an older record: estimated from the counters instead
    assert pool_stats(stats)["rejected_rounds"] is None


def test_the_projection_pays_a_requests_session_opens_once_not_per_round():
    """The bound's overhead is whatever a round's wall time leaves, and that
    held the prefill; projected at another acceptance, a prefill spread over
    the measured rounds moved with their number. The projection's terms now
    keep it apart: a round's own overhead, and the prefill once per request."""
    from specdec.bench.projection import RoundCosts, request_time
    from specdec.bench.projection_report import round_costs

    pooled = A.pool_stats([_stats(prefill_time_s=1.0), _stats(prefill_time_s=1.0)])
    b = A.bound_for_run(pooled, nominal_k=3, measured_tokens_per_s=4.0, baseline_tokens_per_s=2.0,
                        baseline_compute_tokens_per_s=3.0)
    assert b["overhead_s"] == pytest.approx(0.05)          # (11 - 6 - 4) s / 20 rounds, as before
    assert b["round_overhead_s"] == pytest.approx(0.0)     # (11 - 2 - 6 - 4) s, floored at 0
    assert b["prefill_per_request_s"] == pytest.approx(1.0)
    costs = round_costs({"k": 3, "bound": {**b, "t_draft_token_s": 0.1, "t_draft_call_s": 0.0}})
    assert costs.prefill == pytest.approx(1.0) and costs.overhead == pytest.approx(0.0)
    without = RoundCosts(3, 0.1, 0.2, 0.0)
    for alpha in (0.3, 0.95):  # the same 1 s at any acceptance: paid once
        assert request_time(costs, alpha, "one-gpu", 40) - request_time(without, alpha, "one-gpu", 40) == \
            pytest.approx(1.0)
