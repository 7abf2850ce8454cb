"""The projected-speedup formulas of specd bench (specdec/bench/projection.py)."""
from __future__ import annotations

import pytest

from specdec.bench.projection import (RoundCosts, best_projection, check_row, expected_tokens, projected_rate,
                                      request_time,
                                      projection_table, round_cost)


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)


def test_one_gpu_cost_is_the_sequential_round():
    c = RoundCosts(k=4, t_draft=0.002, t_verify=0.010, overhead=0.001)
    assert round_cost(c, 0.8, "one-gpu") == pytest.approx(4 * 0.002 + 0.010 + 0.001)
    # at α = 0.85: E = 4.437 tokens per 19 ms against a 10 ms target step
    assert projected_rate(c, 0.85, "one-gpu") * 0.010 == pytest.approx(expected_tokens(0.85, 4) / 1.9)


def test_pipelining_saves_the_drafting_after_a_hit_only():
    c = RoundCosts(k=4, t_draft=0.002, t_verify=0.010, overhead=0.001)
    assert round_cost(c, 0.0, "two-gpus-pipelined") == pytest.approx(c.sequential())
    assert round_cost(c, 1.0, "two-gpus-pipelined") == pytest.approx(0.011)  # max(t_v + o, 5 t_d)
    slow_draft = RoundCosts(k=4, t_draft=0.004, t_verify=0.010, overhead=0.001)
    assert round_cost(slow_draft, 1.0, "two-gpus-pipelined") == pytest.approx(0.020)  # drafting ahead is the bound
    h = 0.8 ** 5
    assert round_cost(c, 0.8, "two-gpus-pipelined") == pytest.approx(h * 0.011 + (1 - h) * 0.019)
    with pytest.raises(ValueError, match="unknown layout"):
        round_cost(c, 0.8, "three-gpus")


def test_best_k_is_chosen_among_the_measured_ones():
    measured = [RoundCosts(k, 0.002, 0.010 + 0.0002 * k, 0.001) for k in (1, 2, 4, 8)]
    low = best_projection(measured, 0.3, "one-gpu", target_only_tokens_per_s=90.0)
    high = best_projection(measured, 0.95, "one-gpu", target_only_tokens_per_s=90.0)
    assert low.k < high.k
    assert high.speedup == pytest.approx(high.tokens_per_s / 90.0)
    rows = projection_table(measured, [0.7, 0.85], 90.0)
    assert [(r.alpha, r.layout) for r in rows] == [(0.7, "one-gpu"), (0.7, "two-gpus-pipelined"),
                                                   (0.85, "one-gpu"), (0.85, "two-gpus-pipelined")]
    assert all(r.speedup > 0 for r in rows)


def test_check_row_compares_projection_with_measurement():
    c = RoundCosts(k=2, t_draft=0.1, t_verify=0.25, overhead=0.02)
    row = check_row(c, measured_alpha=0.85, measured_tokens_per_s=5.0, target_only_tokens_per_s=3.8)
    assert row["measured_speedup"] == pytest.approx(5.0 / 3.8)
    assert row["projected_speedup"] == pytest.approx(expected_tokens(0.85, 2) / 0.47 / 3.8)
    assert row["error"] == pytest.approx(row["projected_speedup"] / row["measured_speedup"] - 1)


def test_a_short_request_pays_for_its_tail():
    """k = 4 at α = 1 makes 16 tokens in rounds of 5, 5, 5 and 1 (the loop
    drafts min(k, remaining − 1)): 4 rounds, the last one without drafts."""
    c = RoundCosts(k=4, t_draft=0.002, t_verify=0.010, overhead=0.001)
    assert request_time(c, 1.0, "one-gpu", 16) == pytest.approx(3 * c.sequential() + c.sequential(0))
    assert projected_rate(c, 1.0, "one-gpu", request_tokens=16) == pytest.approx(16 / (3 * 0.019 + 0.011))
    # α = 0: every round makes one token, drafting fewer as the end nears
    assert request_time(c, 0.0, "one-gpu", 3) == pytest.approx(c.sequential(2) + c.sequential(1) + c.sequential(0))
    # pipelined at α = 1: every round after the first starts from drafts made ahead
    assert request_time(c, 1.0, "two-gpus-pipelined", 16) == pytest.approx(
        c.sequential() + 2 * c.after_hit() + c.after_hit(0))


@pytest.mark.parametrize("layout", ["one-gpu", "two-gpus-pipelined"])
@pytest.mark.parametrize("alpha", [0.3, 0.8, 0.95])
def test_long_requests_approach_the_steady_state(alpha, layout):
    c = RoundCosts(k=4, t_draft=0.002, t_verify=0.010, overhead=0.001)
    steady = projected_rate(c, alpha, layout)
    assert projected_rate(c, alpha, layout, request_tokens=4000) == pytest.approx(steady, rel=2e-3)
    # a short request makes fewer tokens per round; at low α the drafts its
    # tail skips were mostly wasted anyway, so it can come out ahead
    assert (projected_rate(c, alpha, layout, request_tokens=16) < steady) == (alpha > 0.5)


def test_request_time_matches_a_simulation_of_the_loop():
    """Monte Carlo of the loop's rule (k' = min(k, remaining − 1), a round makes
    accepted + 1 tokens) against the dynamic programme."""
    import random

    c = RoundCosts(k=3, t_draft=0.002, t_verify=0.010, overhead=0.001)
    rng = random.Random(7)
    alpha, n, total = 0.7, 11, 0.0
    trials = 20000
    for _ in range(trials):
        left = n
        while left:
            k = min(c.k, left - 1)
            accepted = 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            total += c.sequential(k)
            left -= accepted + 1
    assert request_time(c, alpha, "one-gpu", n) == pytest.approx(total / trials, rel=0.01)


def test_a_propose_calls_own_cost_is_paid_once_a_round_that_drafts():
    split = RoundCosts(k=4, t_draft=0.0012, t_verify=0.005, overhead=0.0004, t_draft_call=0.0006)
    assert split.sequential() == pytest.approx(0.0006 + 4 * 0.0012 + 0.005 + 0.0004)
    assert split.sequential(0) == pytest.approx(0.0054)  # a round that drafts nothing makes no call
    assert split.after_hit() == pytest.approx(max(0.0054, 0.0006 + 5 * 0.0012))
    # The same Propose time charged per drafted token instead: the same round when all k are drafted ...
    smeared = RoundCosts(k=4, t_draft=0.0012 + 0.0006 / 4, t_verify=0.005, overhead=0.0004)
    assert smeared.sequential() == pytest.approx(split.sequential())
    # ... but a round of one draft would be charged one call, not a quarter of one.
    assert split.sequential(1) - smeared.sequential(1) == pytest.approx(0.0006 * 3 / 4)
    # At α = 0 each round makes one token and drafts min(k, remaining − 1): every round but the last calls.
    assert request_time(split, 0.0, "one-gpu", 10) == pytest.approx(
        6 * split.sequential() + sum(split.sequential(k) for k in (3, 2, 1, 0)))


def test_a_past_runs_projection_is_made_again_with_the_split_propose_cost(tmp_path, capsys):
    """python -m specdec.bench.projection_report RUNS.jsonl: a run recorded before the
    Propose cost was split gets the split from its pooled counters."""
    import json

    from specdec.bench.projection_report import main

    pooled = {"rounds": 11, "proposed_tokens": 10, "k_histogram": [1, 10], "draft_time_s": 0.020,
              "draft_compute_time_s": 0.012}
    run = {"policy": "fixed", "pipeline": False, "concurrency": 1, "network": "direct", "temperature": 0.0,
           "k": 4, "draft_vocab": None, "requests": 1, "completion_tokens": 11, "mean_k": 1.0,
           "tokens_per_s": 140.0, "target_only_tokens_per_s": 180.0, "pooled_stats": pooled,
           "bound": {"t_draft_s": 0.002, "t_verify_s": 0.005, "overhead_s": 0.0004, "alpha_hat": 0.0}}
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps(run) + "\n")
    assert main([str(path), "--assume-acceptance", "0.8"]) == 0
    out = capsys.readouterr().out
    assert "| 4 | 1.20 | 0.80 | 5.00 | 0.40 |" in out  # draft ms/token, call ms, verify, overhead
    assert "| 4 | 1.00 | 0.00 |" in out  # the check shows the rounds drafted one, not four
    path.write_text("")
    assert main([str(path)]) == 1
