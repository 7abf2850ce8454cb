"""The goodput policy: its cost model, its choices against the analytic optimum
in a simulated round loop, and how fast it follows a change of network latency."""
from __future__ import annotations

import random

import pytest

from orchestrator.gamma_policy import (
    AdaptivePolicy,
    FixedPolicy,
    GoodputPolicy,
    RoundObservation,
    expected_tokens_per_round,
    k_after_full_acceptance,
    make_policy,
)


class Simulated:
    """A round loop with iid acceptance a, draft compute t_draft per token, verify
    compute c0 + c1*k, and round trips rtt_draft / rtt_target per round."""

    def __init__(self, a, t_draft=0.010, c0=0.030, c1=0.0, rtt_draft=0.0, rtt_target=0.0, seed=0):
        self.a, self.t_draft, self.c0, self.c1 = a, t_draft, c0, c1
        self.rtt_draft, self.rtt_target = rtt_draft, rtt_target
        self.rng = random.Random(seed)

    def cost(self, k):
        return self.rtt_draft + k * self.t_draft + self.rtt_target + self.c0 + self.c1 * k

    def goodput(self, k):
        return expected_tokens_per_round(self.a, k) / self.cost(k)

    def best_k(self, k_max=8):
        return max(range(1, k_max + 1), key=self.goodput)

    def round(self, k) -> RoundObservation:
        accepted = 0
        while accepted < k and self.rng.random() < self.a:
            accepted += 1
        compute = k * self.t_draft
        verify = self.c0 + self.c1 * k
        return RoundObservation(k=k, accepted=accepted, draft_time_s=compute + self.rtt_draft,
                                verify_time_s=verify + self.rtt_target, verify_compute_s=verify, batch_size=1,
                                draft_rtt_s=self.rtt_draft, target_rtt_s=self.rtt_target, draft_compute_s=compute)


def run(policy, sim, rounds):
    chosen = []
    for _ in range(rounds):
        k = policy.next_k()
        chosen.append(k)
        policy.observe(sim.round(k))
    return chosen


def test_cold_start_proposes_the_starting_k_until_a_round_is_timed():
    policy = make_policy("goodput", 3, 1, 8)
    assert isinstance(policy, GoodputPolicy) and policy.name == "goodput"
    assert policy.next_k() == 3
    policy.observe(RoundObservation(k=0, accepted=0, draft_time_s=0, verify_time_s=0.1, verify_compute_s=0.1,
                                    batch_size=1, draft_rtt_s=0, target_rtt_s=0))
    assert policy.next_k() == 3, "a round without drafts teaches nothing"
    sim = Simulated(0.95, t_draft=0.002, c0=0.030)  # cheap drafts, high acceptance: the best k is not 3
    assert sim.best_k() != 3
    policy.observe(sim.round(3))
    assert policy.next_k() != 3  # now it has a model and uses it


def test_acceptance_estimate_is_the_decayed_mle_with_a_prior():
    policy = GoodputPolicy(4, 1, 8)
    assert policy.acceptance == pytest.approx(0.7)
    policy.observe(RoundObservation(4, 2, 0.04, 0.03, 0.03, 1, 0, 0, 0.04))  # 2 accepted, then a rejection
    assert policy.acceptance == pytest.approx((2 + 2 * 0.7) / (2 + 1 + 2))
    policy.observe(RoundObservation(4, 4, 0.04, 0.03, 0.03, 1, 0, 0, 0.04))  # all 4 accepted: no rejection
    accepted, rejections = 0.85 * 2 + 4, 0.85 * 1
    assert policy.acceptance == pytest.approx((accepted + 1.4) / (accepted + rejections + 2))


def test_verify_cost_is_a_line_fitted_to_the_observed_k():
    policy = GoodputPolicy(4, 1, 8)
    assert policy.verify_cost(4) == 0.0
    policy.observe(RoundObservation(2, 1, 0.02, 0.03, 0.03, 1, 0, 0, 0.02))
    assert policy.verify_cost(7) == pytest.approx(0.03), "one k seen: taken as flat"
    policy.observe(RoundObservation(6, 1, 0.06, 0.07, 0.07, 1, 0, 0, 0.06))
    assert policy.verify_cost(2) == pytest.approx(0.03)
    assert policy.verify_cost(6) == pytest.approx(0.07)
    assert policy.verify_cost(4) == pytest.approx(0.05)
    assert policy.t_draft == pytest.approx(0.01)
    assert policy.rtt_draft == pytest.approx(0.0) and policy.rtt_target == pytest.approx(0.0)


@pytest.mark.parametrize("a", [0.3, 0.6, 0.8, 0.9])
@pytest.mark.parametrize("rtt_ms", [0, 2, 10, 50])
def test_steady_state_goodput_is_near_the_best_fixed_k(a, rtt_ms):
    sim = Simulated(a, rtt_draft=rtt_ms / 1000, rtt_target=rtt_ms / 1000, c1=0.002, seed=int(a * 100) + rtt_ms)
    chosen = run(GoodputPolicy(4, 1, 8), sim, 200)[20:]
    best = sim.goodput(sim.best_k())
    achieved = sum(sim.goodput(k) for k in chosen) / len(chosen)
    assert achieved >= 0.95 * best, (sim.best_k(), chosen[-20:])


def test_a_longer_round_trip_pushes_k_up_and_poor_acceptance_pulls_it_down():
    near = run(GoodputPolicy(4, 1, 8), Simulated(0.7, seed=1), 60)[-20:]
    far = run(GoodputPolicy(4, 1, 8), Simulated(0.7, rtt_draft=0.05, rtt_target=0.05, seed=1), 60)[-20:]
    poor = run(GoodputPolicy(4, 1, 8), Simulated(0.15, seed=1), 60)[-20:]
    assert sum(far) / 20 > sum(near) / 20
    assert max(poor) <= 2


def settled_k(a, t_draft, rtt_draft, rtt_target, c0=0.010, c1=0.001, k_max=12, rounds=80, seed=1):
    """The k GoodputPolicy(4, 1, k_max) settles on over `rounds` timed rounds.
    Each round's acceptance run comes from the same seeded draws whatever k
    is (accepted = min(run, k)), so two loops whose policies choose the same
    k's see the very same rounds."""
    rng = random.Random(seed)
    policy = GoodputPolicy(4, 1, k_max)
    for _ in range(rounds):
        k = policy.next_k()
        run_length = 0
        while run_length < k_max and rng.random() < a:
            run_length += 1
        compute, verify = k * t_draft, c0 + c1 * k
        policy.observe(RoundObservation(k=k, accepted=min(run_length, k), draft_time_s=compute + rtt_draft,
                                        verify_time_s=verify + rtt_target, verify_compute_s=verify, batch_size=1,
                                        draft_rtt_s=rtt_draft, target_rtt_s=rtt_target, draft_compute_s=compute))
    return policy.next_k()


def test_a_dear_round_trip_to_either_service_pushes_k_up_alike_and_dear_draft_compute_pulls_it_down():
    """cost(k) = rtt_draft + k * t_draft + rtt_target + t_verify(k) + overhead:
    each service's round trip is paid once a round whatever k is, so a dear
    one is amortized over more tokens and the best k grows, by as much for
    the draft's round trip as for the target's (the same sum, the same
    model); while draft time paid per drafted token (its compute) is paid k
    times and pulls k down. The draft's wall time must be split as reported:
    its round trip is not compute."""
    a, t_draft, near, far = 0.85, 0.004, 0.010, 0.060

    def goodput(k, rtt_draft, rtt_target, per_token=t_draft):  # the true one, of the loop settled_k runs
        return expected_tokens_per_round(a, k) / (rtt_draft + rtt_target + 0.010 + k * (per_token + 0.001))

    def best(*args, **kwargs):
        return max(range(1, 13), key=lambda k: goodput(k, *args, **kwargs))

    assert best(far, near) == best(near, far) > best(near, near) > best(near, near, per_token=0.020)
    base = settled_k(a, t_draft, near, near, seed=1)
    draft_far = settled_k(a, t_draft, far, near, seed=1)
    target_far = settled_k(a, t_draft, near, far, seed=1)
    dear_compute = settled_k(a, 0.020, near, near, seed=1)
    assert draft_far > base, "a dear draft round trip is a per-round cost: k must grow"
    assert target_far > base, "a dear target round trip is a per-round cost: k must grow"
    assert draft_far == target_far, "the model charges either round trip the same"
    assert dear_compute < base, "dear draft compute is paid per drafted token: k must shrink"
    for k, costs in ((base, (near, near)), (draft_far, (far, near)), (target_far, (near, far))):
        assert goodput(k, *costs) >= 0.95 * goodput(best(*costs), *costs), (k, best(*costs), costs)
    assert goodput(dear_compute, near, near, 0.020) >= 0.95 * goodput(best(near, near, 0.020), near, near, 0.020)


def test_every_k_it_chooses_is_within_its_bounds_over_a_long_varied_run():
    """k stays in [k_min, k_max] whatever the estimates say: regimes whose
    unconstrained best is far above k_max (cheap drafts always accepted
    behind a far network) and far below k_min (every draft rejected, dear
    drafts), changing every few rounds, under several bounds; also the k
    pipelined drafting asks for (the what-if of a full acceptance), and with
    an early stop, where k is the cap: k_max."""
    rng = random.Random(11)
    for k_min, k_max in ((1, 8), (2, 5), (3, 3), (1, 1), (4, 12), (1, 16)):
        policy = make_policy("goodput", rng.randint(k_min, k_max), k_min, k_max, limit=16)
        stopped = make_policy("goodput", k_min, k_min, k_max, limit=16, min_confidence=0.4)
        sim, seen = Simulated(0.7), []
        for r in range(600):
            if r % 12 == 0:  # a new regime: the estimates are pulled far either way
                sim = Simulated(rng.choice([0.0, 0.05, 0.3, 0.7, 0.9, 0.99, 1.0]),
                                t_draft=rng.choice([1e-5, 0.001, 0.01, 0.2]), c0=rng.choice([0.001, 0.03, 0.3]),
                                c1=rng.choice([0.0, 0.002, 0.05]), rtt_draft=rng.choice([0.0, 0.002, 0.3]),
                                rtt_target=rng.choice([0.0, 0.002, 0.3]), seed=r)
            overhead = rng.choice([0.0, 0.0, 0.01, 0.5])
            for p in (policy, stopped):
                k = p.next_k()
                assert k_min <= k <= k_max, (k_min, k, k_max, r, p.min_confidence())
                obs = RoundObservation(**{**sim.round(k).__dict__, "overhead_s": overhead})
                full = RoundObservation(**{**obs.__dict__, "accepted": k})
                assert k_min <= k_after_full_acceptance(p, full) <= k_max
                p.observe(obs)
            seen.append(policy.next_k())
            assert stopped.next_k() == k_max
        if k_min < k_max:  # the regimes did pull the choice to both ends
            assert min(seen) == k_min and max(seen) == k_max, (k_min, k_max, sorted(set(seen)))


def test_it_follows_a_jump_in_the_round_trip_time_within_a_few_rounds():
    sim = Simulated(0.75, t_draft=0.004, c0=0.010, seed=3)
    policy = GoodputPolicy(4, 1, 8)
    before = run(policy, sim, 40)[-10:]
    sim.rtt_draft = sim.rtt_target = 0.100  # the network gets slow mid-stream
    after = run(policy, sim, 4)
    target = sim.best_k()
    assert target > max(before)
    assert after[-1] > max(before)
    assert sim.goodput(after[-1]) >= 0.9 * sim.goodput(target), (before, after, target)


def test_what_if_a_full_acceptance_leaves_the_policy_alone():
    obs = RoundObservation(4, 4, 0.04, 0.03, 0.03, 1, 0, 0, 0.04)
    adaptive = AdaptivePolicy(4, 1, 8)
    assert k_after_full_acceptance(adaptive, obs) == 6
    assert adaptive.next_k() == 4
    assert k_after_full_acceptance(FixedPolicy(3), obs) == 3
    goodput = GoodputPolicy(4, 1, 8)
    k_after_full_acceptance(goodput, obs)
    assert goodput.next_k() == 4 and goodput.t_draft is None


def test_a_per_round_overhead_outside_the_calls_pushes_k_up():
    """Orchestration and streaming cost the same per round whatever k is: a
    policy that ignores them thinks rounds are cheap and picks k too small."""
    sim = Simulated(0.75, t_draft=0.001, c0=0.003, seed=5)
    overhead = 0.008

    def with_overhead(obs):
        return RoundObservation(**{**obs.__dict__, "overhead_s": overhead})

    policy = GoodputPolicy(4, 1, 8)
    for _ in range(60):
        policy.observe(with_overhead(sim.round(policy.next_k())))
    blind = run(GoodputPolicy(4, 1, 8), sim, 60)[-1]
    true_best = max(range(1, 9), key=lambda k: expected_tokens_per_round(0.75, k) / (sim.cost(k) + overhead))
    assert policy.overhead == pytest.approx(overhead)
    assert policy.next_k() >= blind
    assert abs(policy.next_k() - true_best) <= 1


# ------------------------------------------------------------ the early stop

def test_with_an_early_stop_goodput_caps_k_and_sets_the_threshold_from_its_timings():
    """k is the cap (k_max) and the threshold is where one more draft stops
    paying: (t_draft + verify slope) * rate / acceptance."""
    policy = make_policy("goodput", 3, 1, 8, min_confidence=0.5)
    assert policy.next_k() == 8 and policy.min_confidence() == 0.5  # the request's value until a round is timed
    # A round of 4 drafts, 3 accepted, 40 ms of draft compute, 200 ms of verify, 60 ms of the rest.
    obs = RoundObservation(k=4, accepted=3, draft_time_s=0.040, verify_time_s=0.200, verify_compute_s=0.200,
                           batch_size=1, draft_rtt_s=0.0, target_rtt_s=0.0, draft_compute_s=0.040, overhead_s=0.060)
    policy.observe(obs)
    rate = 4 / 0.300  # tokens a round over its seconds
    assert policy.verify_slope() == 0.0  # one k seen: a flat line
    assert policy.min_confidence() == pytest.approx(0.010 * rate / policy.acceptance)
    assert policy.next_k() == 8, "with a stop the cap stays at k_max"
    for _ in range(20):  # the same rounds: the estimates settle, the choice holds
        policy.observe(obs)
    assert policy.next_k() == 8 and policy.min_confidence() == pytest.approx(0.010 * rate / policy.acceptance)


def test_the_threshold_falls_when_drafting_is_cheaper_or_rounds_slower_and_stays_in_range():
    def threshold(t_draft, rest, accepted=3):
        policy = GoodputPolicy(3, 1, 8, min_confidence=0.5)
        for _ in range(10):
            policy.observe(RoundObservation(k=4, accepted=accepted, draft_time_s=4 * t_draft, verify_time_s=0.2,
                                            verify_compute_s=0.2, batch_size=1, draft_rtt_s=0, target_rtt_s=0,
                                            draft_compute_s=4 * t_draft, overhead_s=rest))
        return policy.min_confidence()

    base = threshold(0.010, 0.060)
    assert threshold(0.005, 0.060) < base, "a cheaper draft step: draft on with less certainty"
    assert threshold(0.010, 0.300) < base, "a slower round (a far network): each token is worth more"
    assert threshold(0.200, 0.0) == GoodputPolicy.STOP_RANGE[1]  # a dear draft: stop at almost any doubt
    assert threshold(1e-6, 5.0, accepted=0) == GoodputPolicy.STOP_RANGE[0]


def test_fixed_and_adaptive_keep_the_requests_stop_and_no_stop_is_the_default():
    assert make_policy("fixed", 4, 1, 8, min_confidence=0.3).min_confidence() == 0.3
    adaptive = make_policy("adaptive", 4, 1, 8, min_confidence=0.3)
    adaptive.observe(Simulated(0.8).round(4))
    assert adaptive.min_confidence() == 0.3
    goodput = make_policy("goodput", 3, 1, 8)
    run(goodput, Simulated(0.8), 10)
    assert goodput.min_confidence() == 0.0
    for bad in (-0.1, 1.1, float("nan")):
        with pytest.raises(ValueError, match="draft_min_confidence"):
            make_policy("fixed", 4, 1, 8, min_confidence=bad)


def test_a_pipelined_round_learns_the_overhead_it_waited_for_and_the_drafts_cost_as_measured():
    """A round whose drafts were made during the last verify waited for no
    draft: its overhead is its cycle less the verify alone (it was near 0,
    the modelled draft time taken off a cycle that never held it, and k came
    out too small); its modelled draft cost splits as the last round's did
    (a draft that reports no compute, an n-gram's, is all round trip: it was
    counted twice)."""
    from orchestrator.gamma_policy import round_observation

    measured = round_observation(4, 4, draft_time_s=0.024, draft_compute_s=0.020, verify_rtt_s=0.030,
                                 verify_compute_s=0.028, batch_size=1, cycle_s=0.064, last=None)
    assert measured.overhead_s == pytest.approx(0.010)
    pipelined = round_observation(4, 4, draft_time_s=0.0, draft_compute_s=0.0, verify_rtt_s=0.030,
                                  verify_compute_s=0.028, batch_size=1, cycle_s=0.040, last=measured)
    assert pipelined.overhead_s == pytest.approx(0.010)  # 0.040 - 0.030, not 0.040 - 0.030 - 0.024 floored at 0
    assert (pipelined.draft_time_s, pipelined.draft_compute_s) == pytest.approx((0.024, 0.020))

    ngram = round_observation(4, 4, draft_time_s=0.001, draft_compute_s=0.0, verify_rtt_s=0.030,
                              verify_compute_s=0.028, batch_size=1, cycle_s=0.035, last=None)
    ahead = round_observation(4, 4, draft_time_s=0.0, draft_compute_s=0.0, verify_rtt_s=0.030,
                              verify_compute_s=0.028, batch_size=1, cycle_s=0.034, last=ngram)
    assert (ahead.draft_time_s, ahead.draft_compute_s, ahead.draft_rtt_s) == pytest.approx((0.001, 0.0, 0.001))
