"""A round's hops (specdec/hops.py) and their cutting into segments
(specdec/bench/hops_report.py): the recorder writes nothing when off, a real
round through the lanes records its whole path, and the segments of a round
add up to its wall time less the compute its replies report."""
from __future__ import annotations

import copy

import pytest

from specdec import hops
from specdec.bench import hops_report
from specdec.bench.hops_report import BETWEEN, Event, rounds
from tests.conftest import tiny_engine
from tests.harness import running_system
from tests.service_calls import TARGET_MODEL


@pytest.fixture
def recording(tmp_path):
    hops.start(str(tmp_path))
    try:
        yield tmp_path
    finally:
        hops.stop()


def _round(t0: int, number: int, kind: str = "greedy", draft_compute_us: int = 3000, target_compute_us: int = 5000):
    """The events of one round: each 1 µs after the one before, a handler's
    answer also its compute later; and the round's last event's time (ns)."""
    events, t = [], t0

    def at(event, where, value=0, gap_ns=1000):
        nonlocal t
        t += gap_ns
        events.append(Event(t, event, where, value))

    at("round.start", kind, number, gap_ns=0)
    for service, compute in (("draft", draft_compute_us), ("target", target_compute_us)):
        at("call.sent", service)
        at("frame.in", service)
        at("call.start", service)
        at("call.answered", service, compute, gap_ns=1000 + compute * 1000)
        at("frame.in", f"from-{service}")
        at("call.back", service)
    at("round.end", kind, number)
    return events, t


def test_the_segments_of_a_round_add_up_to_its_time_less_the_compute_it_reports():
    first, end = _round(0, 0)
    second, _ = _round(end + 2000, 1)
    noise = [Event(500, "frame.in", "draft", 0)]  # a frame outside the path (a hello): ignored
    kinds = rounds(sorted(first + second + noise, key=lambda e: e.ns))
    greedy = kinds["greedy"]
    assert greedy.skipped == 0
    assert len(greedy.segments[hops_report.SEGMENTS[0][0]]) == 2
    # Each segment is 1 µs here (1000 ns), the handlers' less their compute too; the gap between the
    # rounds (2 µs) is the between-rounds segment of the first round only (the second has no next).
    for name, _, _ in hops_report.SEGMENTS:
        assert greedy.segments[name] == [1.0, 1.0], name
    assert greedy.segments[BETWEEN] == [2.0]
    assert greedy.overhead_us == [len(hops_report.SEGMENTS) + 2.0]
    assert "| **the segments' medians, summed** | **15** |" in hops_report.report_lines(kinds)
    assert "| ... its mean / 90th percentile | 15 / 15 |" in hops_report.report_lines(kinds)
    greedy.overhead_us = [float(v) for v in range(10, 0, -1)] + [100.0]  # one slow round in eleven
    assert "| ... its mean / 90th percentile | 14 / 10 |" in hops_report.report_lines(kinds)


def test_a_round_without_the_whole_path_is_left_out_and_counted():
    events, end = _round(0, 0)
    plain = [e for e in _round(end + 1000, 1)[0] if e.where not in ("draft", "from-draft")]  # no draft call
    kinds = rounds(sorted(events + plain, key=lambda e: e.ns))
    assert kinds["greedy"].skipped == 1
    assert len(kinds["greedy"].segments[hops_report.SEGMENTS[0][0]]) == 1


def test_nothing_is_recorded_while_off(tmp_path):
    assert not hops.ON
    hops.record("round.start", "greedy", 1)
    path = hops.start(str(tmp_path))
    hops.stop()
    hops.record("round.start", "greedy", 2)
    assert open(path).read() == ""


def test_a_real_round_on_the_lanes_records_its_whole_path(recording):
    """The orchestrator, the draft and the target in this process, on their
    lanes: every round but the first's start records the path, and each
    segment is a duration (never negative)."""
    with running_system(tiny_engine(model=TARGET_MODEL), tiny_engine(model=copy.deepcopy(TARGET_MODEL))) as system:
        for seed in (1, 2):
            system.client.complete([5, 6, 7, 8], max_tokens=24, temperature=0.0 if seed == 1 else 0.7, seed=seed,
                                   num_draft_tokens=3)
    hops.stop()
    kinds = rounds(hops_report.read_events(recording))
    assert set(kinds) == {"greedy", "sampled"}
    for kind in kinds.values():
        cut = kind.segments[hops_report.SEGMENTS[0][0]]
        assert len(cut) >= 3, (kind.kind, kind.skipped)
        for name, values in kind.segments.items():
            assert all(v >= 0 for v in values), name
        assert kind.overhead_us and all(v > 0 for v in kind.overhead_us)
    lines = hops_report.report_lines(kinds)
    assert lines[2] == "| segment | greedy | sampled |"


def test_each_kinds_first_request_can_be_left_out_as_a_warm_up():
    events, t = [], 0
    for number in (0, 1, 0, 1, 2):  # two requests of two and three rounds
        more, t = _round(t + 1000, number)
        events += more
    assert len(rounds(events)["greedy"].overhead_us) == 3  # each round followed by its request's next
    warm = rounds(events, skip_first_request=True)["greedy"]
    assert len(warm.segments[hops_report.SEGMENTS[0][0]]) == 3, "the second request's rounds"
    assert len(warm.overhead_us) == 2


def test_recording_into_a_directory_not_made_yet_makes_it(tmp_path):
    path = hops.start(str(tmp_path / "not" / "yet"))
    hops.record("round.start", "greedy", 0)
    hops.stop()
    assert open(path).read().split()[1:] == ["round.start", "greedy", "0"]
