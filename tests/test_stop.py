"""Stop sequences on streamed text: hold back possible starts, cut at the earliest start."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.stop import StopMatcher, validate_stops


def run(stops, chunks):
    """Feed chunks; return (emitted text, stopped) including the final flush."""
    matcher = StopMatcher(stops)
    emitted = []
    for chunk in chunks:
        text, stopped = matcher.feed(chunk)
        emitted.append(text)
        if stopped:
            return "".join(emitted), True
    emitted.append(matcher.flush())
    return "".join(emitted), matcher.stopped


def test_no_stops_passes_text_through_immediately():
    matcher = StopMatcher([])
    assert matcher.feed("hello ") == ("hello ", False)
    assert matcher.feed("world") == ("world", False)
    assert matcher.flush() == ""


def test_stop_split_across_many_feeds():
    matcher = StopMatcher(["</end>"])
    assert matcher.feed("abc<") == ("abc", False)
    assert matcher.feed("/e") == ("", False)
    assert matcher.feed("n") == ("", False)
    assert matcher.feed("d>tail") == ("", True)
    assert matcher.stopped
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_held_text_is_released_once_it_cannot_be_a_stop():
    matcher = StopMatcher(["</end>"])
    assert matcher.feed("x</e") == ("x", False)
    assert matcher.feed("x") == ("</ex", False)


def test_stop_at_the_very_start():
    assert run(["##"], ["##", "after"]) == ("", True)
    assert run(["##"], ["#", "#after"]) == ("", True)


def test_overlapping_prefixes_stop_at_the_shorter_one_when_it_starts_first():
    # "ab" and "abc" both start at 2: the earliest start is 2 either way.
    assert run(["ab", "abc"], ["xy", "a", "bc"]) == ("xy", True)
    assert run(["abc", "ab"], ["xyab"]) == ("xy", True)


def test_a_pending_earlier_stop_wins_over_a_complete_later_one():
    matcher = StopMatcher(["bc", "abcd"])
    # "bc" is complete at 2, but "abcd" may still start at 1.
    assert matcher.feed("xabc") == ("x", False)
    assert matcher.feed("d") == ("", True)
    assert run(["bc", "abcd"], ["xabc", "x"]) == ("xa", True)


def test_flush_cuts_at_a_match_behind_a_pending_prefix():
    matcher = StopMatcher(["bc", "abcd"])
    assert matcher.feed("xabc") == ("x", False)
    assert matcher.flush() == "a"
    assert matcher.stopped


def test_flush_returns_an_unfinished_prefix_as_text():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("go ST") == ("go ", False)
    assert matcher.flush() == "ST"
    assert not matcher.stopped


def test_multibyte_text_and_stops():
    assert run(["☃ 日"], ["héllo ☃", " 日本"]) == ("héllo ", True)


@pytest.mark.parametrize("stops, message", [
    ([""], "stop sequence 0 is empty"),
    (["ok", ""], "stop sequence 1 is empty"),
    (["x"] * 9, "at most 8 stop sequences"),
    (["x" * 257], "stop sequence 0 is 257 characters long; the limit is 256"),
    ([3], "stop sequence 0 must be a string"),
])
def test_validate_stops_rejects_bad_input(stops, message):
    with pytest.raises(ValueError, match=message):
        validate_stops(stops)


def test_validate_stops_accepts_the_limits():
    stops = ["x" * 256] * 8
    assert validate_stops(stops) == stops
    assert validate_stops(["abc"], max_count=1, max_len=3) == ["abc"]


def test_matcher_rejects_empty_stops():
    with pytest.raises(ValueError, match="must not be empty"):
        StopMatcher(["a", ""])


def truncate_at_earliest_start(text, stops):
    """The documented semantics, computed on the whole text at once."""
    starts = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return (text[:min(starts)], True) if starts else (text, False)


def unresolved_from(text, stops):
    """Where streaming must stop emitting: the first position where a stop matches or
    may still match."""
    for i in range(len(text)):
        tail = text[i:]
        if any(tail.startswith(s) or s.startswith(tail) for s in stops):
            return i
    return len(text)


ALPHABET = "ab☃"
stop_lists = st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=4)


@st.composite
def chunked_text(draw):
    text = draw(st.text(ALPHABET, max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(stop_lists, chunked_text())
def test_streamed_output_equals_truncation_at_the_earliest_start(stops, text_and_chunks):
    text, chunks = text_and_chunks
    assert run(stops, chunks) == truncate_at_earliest_start(text, stops)


@settings(max_examples=200, deadline=None)
@given(stop_lists, chunked_text())
def test_only_possible_stop_starts_are_held_back(stops, text_and_chunks):
    text, chunks = text_and_chunks
    matcher = StopMatcher(stops)
    emitted, seen = "", ""
    for chunk in chunks:
        out, stopped = matcher.feed(chunk)
        emitted += out
        seen += chunk
        if stopped:
            break
        assert emitted == seen[:unresolved_from(seen, stops)]
