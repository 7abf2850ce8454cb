"""Policies choosing k: fixed, acceptance-adaptive, the factory's bounds, and E[tokens per round]."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.gamma_policy import (
    POLICIES,
    AdaptivePolicy,
    FixedPolicy,
    GammaPolicy,
    RoundObservation,
    expected_tokens_per_round,
    make_policy,
)
from specdec.errors import InvalidArgument
from specdec.limits import DEFAULT_MAX_DRAFT_TOKENS


def round_obs(k: int, accepted: int) -> RoundObservation:
    return RoundObservation(k=k, accepted=accepted, draft_time_s=0.01 * k, verify_time_s=0.02,
                            verify_compute_s=0.015, batch_size=1, draft_rtt_s=0.0, target_rtt_s=0.0)


def test_fixed_policy_never_changes_k():
    policy = make_policy("fixed", k=4, k_min=1, k_max=8)
    assert isinstance(policy, FixedPolicy) and policy.name == "fixed"
    for accepted in (4, 0, 2, 4):
        policy.observe(round_obs(4, accepted))
        assert policy.next_k() == 4


def test_adaptive_raises_k_by_two_after_full_acceptance_up_to_k_max():
    policy = make_policy("adaptive", k=3, k_min=1, k_max=8)
    assert isinstance(policy, AdaptivePolicy) and policy.name == "adaptive"
    seen = []
    for _ in range(4):
        k = policy.next_k()
        policy.observe(round_obs(k, accepted=k))
        seen.append(policy.next_k())
    assert seen == [5, 7, 8, 8]


def test_adaptive_lowers_k_by_one_after_a_rejection_down_to_k_min():
    policy = make_policy("adaptive", k=4, k_min=2, k_max=8)
    seen = []
    for _ in range(4):
        policy.observe(round_obs(policy.next_k(), accepted=1))
        seen.append(policy.next_k())
    assert seen == [3, 2, 2, 2]


def test_adaptive_judges_the_k_actually_proposed():
    # The orchestrator capped k to 2 (near max_tokens); both accepted counts as full.
    policy = make_policy("adaptive", k=5, k_min=1, k_max=8)
    policy.observe(round_obs(2, accepted=2))
    assert policy.next_k() == 7


def test_adaptive_ignores_rounds_without_drafts():
    policy = make_policy("adaptive", k=5, k_min=1, k_max=8)
    policy.observe(round_obs(0, accepted=0))
    assert policy.next_k() == 5
    assert policy.acceptance == pytest.approx(0.7)


def test_adaptive_acceptance_is_an_ewma_of_the_round_rate():
    policy = AdaptivePolicy(k=4, k_min=1, k_max=8)
    assert policy.acceptance == pytest.approx(0.7)
    policy.observe(round_obs(4, accepted=4))  # rate 1.0
    assert policy.acceptance == pytest.approx(0.7 + 0.3 * (1.0 - 0.7))
    previous = policy.acceptance
    policy.observe(round_obs(policy.next_k(), accepted=0))  # rate 0.0
    assert policy.acceptance == pytest.approx(0.7 * previous)


def test_policies_satisfy_the_protocol_and_hold_per_request_state():
    first: GammaPolicy = make_policy("adaptive", 4, 1, 8)
    second: GammaPolicy = make_policy("adaptive", 4, 1, 8)
    first.observe(round_obs(4, accepted=4))
    assert (first.next_k(), second.next_k()) == (6, 4)
    assert set(POLICIES) == {"fixed", "adaptive", "goodput"}


def test_unknown_policy_name_is_rejected():
    with pytest.raises(ValueError, match="unknown policy .bogus.; choose one of fixed, adaptive, goodput"):
        make_policy("bogus", 4, 1, 8)


@pytest.mark.parametrize("k, k_min, k_max, message", [
    (4, 0, 8, r"num_draft_tokens must be in \[1, 8\], got 0"),
    (4, 1, 9, r"num_draft_tokens must be in \[1, 8\], got 9"),
    (9, 1, 8, r"num_draft_tokens must be in \[1, 8\], got 9"),
    (4, 6, 5, r"min_draft_tokens \(6\) must be <= max_draft_tokens \(5\)"),
    (1, 2, 8, r"num_draft_tokens must be in \[min_draft_tokens, max_draft_tokens\] = \[2, 8\], got 1"),
    (2.5, 1, 8, "num_draft_tokens must be an integer"),
])
@pytest.mark.parametrize("name", POLICIES)
def test_bounds_are_validated(name, k, k_min, k_max, message):
    with pytest.raises(ValueError, match=message):
        make_policy(name, k, k_min, k_max)


def test_bounds_at_the_limits_are_accepted():
    assert make_policy("fixed", DEFAULT_MAX_DRAFT_TOKENS, 1, DEFAULT_MAX_DRAFT_TOKENS).next_k() == 8
    assert make_policy("adaptive", 1, 1, 1).next_k() == 1


def test_the_limit_is_the_one_max_draft_tokens():
    assert make_policy("fixed", 12, 1, 12, limit=12).next_k() == 12
    with pytest.raises(InvalidArgument, match=r"num_draft_tokens must be in \[1, 3\], got 4"):
        make_policy("adaptive", 4, 1, 8, limit=3)


def test_observation_with_more_accepted_than_proposed_is_a_bug():
    with pytest.raises(AssertionError):
        round_obs(2, accepted=3)


@pytest.mark.parametrize("a, k, expected", [
    (0.0, 5, 1.0),  # nothing accepted: only the recovered token
    (1.0, 0, 1.0),
    (1.0, 4, 5.0),  # everything accepted: k drafts + the bonus token
    (0.5, 2, 1.75),
    (0.8, 3, 1 + 0.8 + 0.64 + 0.512),
])
def test_expected_tokens_per_round_known_values(a, k, expected):
    assert expected_tokens_per_round(a, k) == pytest.approx(expected)


@given(st.floats(0.0, 0.999), st.integers(0, 32))
@settings(deadline=None)  # a loaded CI VM can stall any one example past Hypothesis' 200 ms
def test_expected_tokens_per_round_matches_the_closed_form(a, k):
    closed_form = (1 - a ** (k + 1)) / (1 - a)
    assert math.isclose(expected_tokens_per_round(a, k), closed_form, rel_tol=1e-9)


@given(st.floats(0.0, 1.0), st.integers(0, 31))
@settings(deadline=None)
def test_expected_tokens_per_round_grows_with_k_and_is_bounded(a, k):
    assert expected_tokens_per_round(a, k) <= expected_tokens_per_round(a, k + 1) <= k + 2


def test_expected_tokens_per_round_near_one_is_continuous():
    assert expected_tokens_per_round(1 - 1e-12, 8) == pytest.approx(9.0, rel=1e-9)


@pytest.mark.parametrize("a, k", [(-0.1, 3), (1.1, 3), (0.5, -1)])
def test_expected_tokens_per_round_rejects_bad_arguments(a, k):
    with pytest.raises(ValueError):
        expected_tokens_per_round(a, k)
