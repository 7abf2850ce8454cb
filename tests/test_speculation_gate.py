"""The speculation gate on its own, against a simulated replica: requests in
lock-step waves, each wave costing what its mode costs. The gate must find the
faster mode, keep re-measuring the other, skip rounds from before a switch,
and stand aside below its threshold."""
from __future__ import annotations

import pytest

from orchestrator.speculation_gate import BucketRates, GateSettings, SpeculationGate, bucket


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(gate: SpeculationGate, clock: Clock, active: int, waves: int, cost: dict, tokens: dict,
             exempt: int = 0) -> list[bool]:
    """`waves` waves of `active` requests (the last `exempt` of them never
    follow the gate); a wave in mode m takes cost[m] seconds and each request
    emits tokens[m]. Returns the mode of each wave (that of its first request)."""
    modes = []
    for _ in range(waves):
        asked = [gate.speculate(active) if i < active - exempt else None for i in range(active)]
        gated = [m for m in asked if m is not None]
        wave_mode = gated[0] if gated else True
        modes.append(wave_mode)
        clock.now += cost[wave_mode]
        for mode in asked:
            gate.record(active, mode, tokens[True if mode is None else mode])
    return modes


def make(**kwargs) -> tuple[SpeculationGate, Clock]:
    clock = Clock()
    settings = GateSettings(**{"min_epoch_s": 0.0, "probe_cost": 0.1, **kwargs})
    return SpeculationGate(settings, clock), clock


def test_buckets_are_powers_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]


def test_plain_decoding_wins_when_it_is_faster_and_speculation_is_still_re_measured():
    gate, clock = make()
    # Speculation: 2.5 tokens per request per wave of 1.0 s; plain: 1 token per 0.25 s (4 / s).
    modes = simulate(gate, clock, active=8, waves=200, cost={True: 1.0, False: 0.25}, tokens={True: 2.5, False: 1})
    assert modes[0] is True, "speculation is the starting mode"
    late = modes[100:]
    assert late.count(False) > 0.75 * len(late), "plain decoding should lead"
    assert late.count(True) > 0, "speculation must be re-measured now and then"
    rates = gate.buckets[8].rate
    assert rates[False] == pytest.approx(8 * 4.0, rel=1e-3) and rates[True] == pytest.approx(8 * 2.5, rel=1e-3)


def test_speculation_keeps_the_lead_when_it_is_faster():
    gate, clock = make()
    cost = {True: 0.5, False: 0.25}
    modes = simulate(gate, clock, active=4, waves=200, cost=cost, tokens={True: 3.0, False: 1})
    late = modes[100:]
    assert sum(cost[m] for m in late if m) > 0.75 * sum(cost[m] for m in late), "speculation should lead"
    assert late.count(False) > 0, "plain decoding must be re-measured now and then"


def test_re_measuring_a_slow_mode_costs_a_bounded_share_of_the_throughput():
    gate, clock = make(probe_cost=0.1)
    # Speculation's waves are 16x longer than plain decoding's, and far slower per token
    # (8 * 3 tokens / 4 s = 6 tok/s against 32): each probe of it is long and costly.
    cost, tokens = {True: 4.0, False: 0.25}, {True: 3.0, False: 1}
    modes = simulate(gate, clock, active=8, waves=6000, cost=cost, tokens=tokens)
    late = modes[300:]
    assert late.count(True) > 0, "speculation must still be re-measured"
    rate = sum(8 * tokens[m] for m in late) / sum(cost[m] for m in late)
    assert 0.88 * 32 < rate < 32


def test_modes_close_in_rate_are_re_measured_more_often_than_far_ones():
    close = BucketRates(rate={True: 10.0, False: 9.5}, epoch_s={True: 1.0, False: 2.0})
    far = BucketRates(rate={True: 10.0, False: 10 / 3}, epoch_s={True: 1.0, False: 2.0})
    # Probing costs epoch * (1 - slow / fast) of the fast mode's time; at most 3% of it:
    assert close.probe_after_s(0.03) == pytest.approx(2.0 * (0.05 / 0.03 - 1))
    assert far.probe_after_s(0.03) == pytest.approx(2.0 * ((2 / 3) / 0.03 - 1))
    assert close.probe_after_s(0.1) == 0.0, "within the allowed cost: re-measure at once"
    assert BucketRates(rate={True: 0.0, False: 0.0}, epoch_s={True: 1.0, False: 1.0}).probe_after_s(0.03) == 0.0


def test_a_mode_of_short_rounds_is_measured_over_a_comparable_window():
    gate, clock = make()
    # Speculation's epoch: 1 settling wave + 3 counted, 10 s each: 40 s.
    simulate(gate, clock, active=2, waves=4, cost={True: 10.0, False: 0.1}, tokens={True: 2, False: 1})
    assert gate.mode is False and gate.buckets[2].epoch_s[True] == pytest.approx(40.0)
    # Plain decoding then runs at least a quarter of that (10 s, 100 waves), not 3 waves.
    simulate(gate, clock, active=2, waves=90, cost={True: 10.0, False: 0.1}, tokens={True: 2, False: 1})
    assert gate.epochs == 1
    simulate(gate, clock, active=2, waves=20, cost={True: 10.0, False: 0.1}, tokens={True: 2, False: 1})
    assert gate.epochs >= 2 and gate.buckets[2].rate[False] == pytest.approx(20.0, rel=0.01)


def test_the_first_wave_after_a_switch_is_not_counted():
    gate, clock = make()
    simulate(gate, clock, active=2, waves=4, cost={True: 1.0, False: 1.0}, tokens={True: 2, False: 1})
    # Epoch 1 (speculation): 1 settling wave, then 3 counted; the gate switches to plain at its end.
    assert gate.mode is False and gate.epochs == 1
    # A switch-wave whose rounds would double the rate if they counted: far slower than the rest.
    simulate(gate, clock, active=2, waves=1, cost={True: 1.0, False: 100.0}, tokens={True: 2, False: 1})
    simulate(gate, clock, active=2, waves=3, cost={True: 1.0, False: 1.0}, tokens={True: 2, False: 1})
    assert gate.epochs == 2
    assert gate.buckets[2].rate == {True: pytest.approx(4.0), False: pytest.approx(2.0)}


def test_rounds_started_before_a_switch_are_not_counted_in_the_new_mode():
    gate, clock = make()
    simulate(gate, clock, active=2, waves=4, cost={True: 1.0, False: 1.0}, tokens={True: 2, False: 1})
    assert gate.mode is False
    # Rounds reported in the old mode after the switch are ignored.
    for _ in range(10):
        clock.now += 1.0
        gate.record(2, True, 1000)
    assert gate.epochs == 1 and False not in gate.buckets[2].rate


def test_a_new_concurrency_bucket_starts_from_its_own_best_mode():
    gate, clock = make()
    simulate(gate, clock, active=8, waves=60, cost={True: 1.0, False: 0.25}, tokens={True: 2.5, False: 1})
    assert gate.buckets[8].best() is False
    # Two requests: nothing known there, so speculation, with its own measurements.
    assert gate.speculate(2) is True
    simulate(gate, clock, active=2, waves=60, cost={True: 0.5, False: 0.4}, tokens={True: 2.5, False: 1})
    assert gate.buckets[2].best() is True
    # Back at 8: straight to plain decoding, its known best.
    assert gate.speculate(8) is False


def test_a_gated_round_reported_at_another_bucket_moves_the_gate_there_at_once():
    """A round reports the load at its end: when requests finished during it,
    that is another bucket than the one being measured. A round of a request
    that follows the gate moves the gate there at once: the old bucket's
    epoch is dropped unmeasured, the new bucket's best mode starts (with a
    settling wave), and the moving round counts nowhere. A round of a request
    that does not follow the gate moves nothing."""
    gate, clock = make()
    plain_wins, speculation_wins = ({True: 1.0, False: 0.25}, {True: 2.5, False: 1}), \
        ({True: 0.5, False: 0.25}, {True: 3.0, False: 1})
    simulate(gate, clock, 2, 60, *plain_wins)
    simulate(gate, clock, 8, 60, *speculation_wins)
    assert gate.buckets[2].best() is False and gate.buckets[8].best() is True
    assert gate.describe()["bucket"] == 8
    for _ in range(100):  # (until a re-measurement of plain decoding at 8 is over)
        if gate.mode:
            break
        simulate(gate, clock, 8, 1, *speculation_wins)
    # A wave of eight speculating rounds; six of the requests finish in it.
    assert [gate.speculate(8) for _ in range(8)] == [True] * 8
    clock.now += 0.5
    for _ in range(6):
        gate.record(8, True, 3)
    before = gate.describe()
    assert before["bucket"] == 8 and before["speculate"] is True
    rates = {b: dict(r.rate) for b, r in gate.buckets.items()}

    gate.record(2, None, 50)  # a request outside the gate, at two requests now
    assert gate.describe() == before

    gate.record(2, True, 3)  # one of the two left, which follow the gate
    moved = gate.describe()
    assert moved["bucket"] == 2 and moved["speculate"] is False, "bucket 2's best: plain decoding"
    assert moved["switches"] == before["switches"] + 1 and moved["epochs"] == before["epochs"]
    assert {b: dict(r.rate) for b, r in gate.buckets.items()} == rates, "the moving round counts nowhere"
    gate.record(2, True, 3)  # the other: a round from before the switch
    assert gate.describe() == moved

    # Then bucket 2's plain epoch runs, and ends there: bucket 8's was dropped unmeasured.
    modes = []
    while gate.epochs == moved["epochs"] and len(modes) < 20:
        modes += simulate(gate, clock, 2, 1, *plain_wins)
    assert gate.epochs == moved["epochs"] + 1 and modes == [False] * len(modes), modes
    assert len(modes) >= 4, "a settling wave, then 3 counted ones at least"
    assert gate.buckets[2].rate[False] != rates[2][False] and gate.buckets[2].rate[True] == rates[2][True]
    assert gate.buckets[8].rate == rates[8]


def test_below_the_threshold_and_when_off_the_gate_stands_aside():
    gate, clock = make(min_streams=3)
    simulate(gate, clock, active=2, waves=50, cost={True: 1.0, False: 0.1}, tokens={True: 1, False: 1})
    assert gate.epochs == 0 and gate.speculate(2) is True and gate.speculate(1) is True
    off, clock = make(enabled=False)
    assert simulate(off, clock, active=8, waves=50, cost={True: 1.0, False: 0.1}, tokens={True: 1, False: 1}) \
        == [True] * 50
    assert off.epochs == 0


def test_requests_outside_the_gate_count_in_every_epoch():
    gate, clock = make()
    # Two of four requests always speculate (seeded sampled ones): their tokens count in both modes' rates.
    simulate(gate, clock, active=4, waves=80, cost={True: 1.0, False: 0.5}, tokens={True: 2, False: 1}, exempt=2)
    assert set(gate.buckets[4].rate) == {True, False}
    # (Only a gated round ends an epoch, and here the others always report
    # last in a wave, so an epoch may count some of a wave's rounds late.)
    assert gate.buckets[4].rate[True] == pytest.approx(4 * 2.0, rel=0.15)
    assert gate.buckets[4].rate[False] == pytest.approx((2 * 1 + 2 * 2) / 0.5, rel=0.15)


def test_without_a_request_that_follows_the_gate_nothing_is_measured():
    gate, clock = make()
    simulate(gate, clock, active=8, waves=50, cost={True: 1.0, False: 0.5}, tokens={True: 1, False: 1}, exempt=8)
    assert gate.epochs == 0 and gate.buckets == {}


def test_an_epoch_no_gated_request_reported_on_for_long_starts_afresh():
    gate, clock = make(stale_s=5.0)
    simulate(gate, clock, active=2, waves=3, cost={True: 1.0, False: 1.0}, tokens={True: 1, False: 1})
    assert gate.epochs == 0
    # 20 s of target-only traffic only, at a rate no mode has.
    simulate(gate, clock, active=2, waves=20, cost={True: 1.0, False: 1.0}, tokens={True: 50, False: 50}, exempt=2)
    simulate(gate, clock, active=2, waves=5, cost={True: 1.0, False: 1.0}, tokens={True: 1, False: 1})
    assert gate.epochs == 1 and gate.buckets[2].rate[True] == pytest.approx(2.0)


def test_an_epoch_lasts_at_least_its_minimum_time():
    gate, clock = make(min_epoch_s=10.0)
    simulate(gate, clock, active=2, waves=9, cost={True: 1.0, False: 1.0}, tokens={True: 1, False: 1})
    assert gate.epochs == 0, "1 settling wave + 8 counted waves = 8 s < 10 s"
    simulate(gate, clock, active=2, waves=2, cost={True: 1.0, False: 1.0}, tokens={True: 1, False: 1})
    assert gate.epochs == 1


def test_plain_now_peeks_without_starting_anything():
    gate, clock = make()
    assert gate.plain_now(8) is False, "nothing known: speculate first"
    simulate(gate, clock, active=8, waves=40, cost={True: 1.0, False: 0.25}, tokens={True: 2.5, False: 1})
    state = gate.describe()
    assert gate.plain_now(8) is (not gate.mode)
    assert gate.plain_now(1) is False, "below the threshold everyone speculates"
    gate.mode = False
    assert gate.plain_now(5) is True, "bucket 8's best, from the current epoch"
    assert gate.plain_now(2) is False, "bucket 2: nothing known"
    gate.mode = state["speculate"]
    assert gate.describe() == state


# ------------------------------------------------------------ through the system

class ScriptedGate:
    """Stands in for a replica's gate: decode plainly for the first `plain`
    rounds a request asks about, then speculate."""

    def __init__(self, plain: int):
        self.plain = plain
        self.asked = 0

    def plain_now(self, active: int) -> bool:
        return self.asked < self.plain

    def speculate(self, active: int) -> bool:
        self.asked += 1
        return self.asked > self.plain

    def record(self, active: int, speculated, tokens: int) -> None:
        pass


@pytest.mark.parametrize("plain", [1000, 3])
def test_a_request_decoding_plainly_opens_its_draft_session_only_when_it_first_speculates(plain):
    from tests.conftest import tiny_engine, tiny_model
    from tests.harness import running_system
    from tests.test_orchestrator import GREEDY_PROMPTS, greedy_reference, perturbed

    target = tiny_model(seed=0, init_range=0.3)
    n = 16
    with running_system(tiny_engine(model=target), tiny_engine(model=perturbed(target, 0.15, seed=1))) as s:
        s.orchestrator.backends.targets.any().batcher.gate = ScriptedGate(plain)
        result = s.client.complete(GREEDY_PROMPTS[2], max_tokens=n, temperature=0, num_draft_tokens=2,
                                   policy="goodput")
    st = result.stats
    assert result.token_ids == greedy_reference(target, GREEDY_PROMPTS[2], n)
    assert st.fallback_rounds == 0 and st.rounds == sum(st.k.histogram)
    if plain > st.rounds:
        # The target's open and close and a Verify per round: the draft was never called.
        assert st.plain_rounds == st.rounds == n and st.round_trips == 2 + st.rounds
    else:
        # Its session opened once, at the fourth round; a Propose per round that drafted.
        assert st.plain_rounds == plain and st.rounds - st.k.histogram[0] > 0
        assert st.round_trips == 4 + st.rounds + (st.rounds - st.k.histogram[0])


def test_gated_rounds_decode_plainly_with_identical_tokens_and_seeded_requests_keep_theirs():
    """Three services in-process, a gate that re-measures the slower mode
    after every epoch of the faster, with no minimum time: greedy requests under concurrency decode some
    rounds plainly and still emit target-only's tokens; a seeded sampled
    request under fixed k never follows the gate and reproduces its tokens."""
    import concurrent.futures

    from orchestrator.client import Client
    from tests.conftest import tiny_engine, tiny_model
    from tests.harness import running_system
    from tests.test_orchestrator import GREEDY_PROMPTS, greedy_reference, perturbed, same_as_reference

    target = tiny_model(seed=0, init_range=0.3)
    n = 40
    with running_system(tiny_engine(model=target), tiny_engine(model=perturbed(target, 0.15, seed=1)),
                        gate_epoch_ms=0.0, gate_probe_cost=1.0) as s:
        seeded = dict(max_tokens=20, temperature=0.8, top_p=0.95, seed=1234, num_draft_tokens=3)
        alone = s.client.complete(GREEDY_PROMPTS[1], **seeded)
        assert alone.stats.plain_rounds == 0

        def run(i):
            with Client(f"127.0.0.1:{s.orchestrator.port}", timeout_s=120) as client:
                if i == 0:
                    return client.complete(GREEDY_PROMPTS[1], **seeded)
                return client.complete(GREEDY_PROMPTS[i], max_tokens=n, temperature=0, num_draft_tokens=2,
                                       policy="goodput" if i % 2 else "fixed")

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(run, range(6)))
        gate = s.orchestrator.backends.targets.any().batcher.gate
    assert results[0].token_ids == alone.token_ids and results[0].stats.plain_rounds == 0
    for i, result in enumerate(results[1:], start=1):
        ref = greedy_reference(target, GREEDY_PROMPTS[i], n)
        assert same_as_reference(list(result.token_ids), ref), f"prompt {i}"
        st = result.stats
        assert st.plain_rounds <= st.k.histogram[0] and st.rounds == sum(st.k.histogram)
    assert gate.epochs >= 2 and gate.switches >= 2, gate.describe()
    assert sum(r.stats.plain_rounds for r in results[1:]) > 0, gate.describe()
    assert sum(r.stats.accepted_tokens for r in results[1:]) > 0


def test_the_gates_flags_are_checked_before_anything_starts():
    import asyncio

    from orchestrator.config import OrchestratorConfig
    from orchestrator.server import build_backends
    from specdec.errors import FailedPrecondition

    for bad in ({"gate_min_streams": 0}, {"gate_probe_cost": 0.0}, {"gate_probe_cost": 1.5},
                {"gate_epoch_ms": -1.0}):
        cfg = OrchestratorConfig(target="127.0.0.1:1", draft="", connect_timeout_s=0.1, **bad)
        with pytest.raises(FailedPrecondition, match=next(iter(bad)).replace("_", "-")):
            asyncio.run(build_backends(cfg))


def test_would_speculate_is_what_speculate_answers_whatever_the_gate_has_seen():
    """One route to the answer: across random loads, modes' costs, idle gaps
    past the staleness limit and requests that do not follow the gate, asking
    `would_speculate` (and `plain_now`) first changes nothing and agrees with
    the `speculate` that follows, which leaves the gate running the mode it
    answered."""
    import random

    rng = random.Random(7)
    gate, clock = make(min_streams=2, stale_s=5.0)
    answers = set()
    active = 8
    for _ in range(3000):
        if rng.random() < 0.02:  # the load changes now and then (epochs need a steady bucket to end)
            active = rng.choice([1, 2, 3, 4, 6, 8, 12])
        before = gate.describe()
        would = gate.would_speculate(active)
        assert gate.plain_now(active) is (not would)
        assert gate.describe() == before, "asking changed the gate"
        answer = gate.speculate(active)
        assert answer is would, (active, before)
        if active >= gate.settings.min_streams:  # the gate decides: it now runs the mode it answered
            assert answer is gate.mode, (active, before, gate.describe())
        answers.add(answer)
        clock.now += rng.choice([0.01, 0.05, 0.2]) if rng.random() > 0.05 else 6.0  # now and then, stale
        follows = rng.random() > 0.2
        # Speculation pays at low load, plain decoding at high load (more tokens in the same time).
        tokens = (rng.choice([2, 3, 4]) if active < 6 else 1) if answer else 2
        gate.record(active, answer if follows else None, tokens)
    assert answers == {True, False}, "both modes were chosen at some point"
