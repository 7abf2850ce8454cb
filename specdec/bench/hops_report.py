"""Where a round's overhead goes, hop by hop (`specd overhead --hops`).

Reads the events the processes recorded (specdec/hops.py) and cuts each
round that made both of its lane calls into its segments: what each
process did between two events of the round's path, and what each crossing
cost (the send, the wire and the wake-up of the process that receives).
The segments of a round add up to its wall time less the compute its two
replies report, which is `specd overhead`'s round overhead. Rounds whose
path differs (no draft call, a call that went by gRPC, a round that failed)
are left out and counted.

Reading the files needs one request in flight at a time (the events of
concurrent requests would interleave): as `orchestrator_round` runs them.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from specdec.hops import SUFFIX
from specdec.soak.report import percentile  # nearest rank, as the soak reports its latencies

# The events of a round with both lane calls, in order: (event, where).
PATH = [
    ("round.start", None),
    ("call.sent", "draft"), ("frame.in", "draft"), ("call.start", "draft"), ("call.answered", "draft"),
    ("frame.in", "from-draft"), ("call.back", "draft"),
    ("call.sent", "target"), ("frame.in", "target"), ("call.start", "target"), ("call.answered", "target"),
    ("frame.in", "from-target"), ("call.back", "target"),
    ("round.end", None),
]
# Each segment: its name, and the indices in PATH of its two ends.
SEGMENTS = [
    ("orchestrator: the round's start, to the draft's call sent", 0, 1),
    ("draft call: send, wire, the draft's wake-up", 1, 2),
    ("draft: the frame, to its handler", 2, 3),
    ("draft: the handler, less its compute (the reply serialized)", 3, 4),
    ("draft reply: send, wire, the orchestrator's wake-up", 4, 5),
    ("orchestrator: the reply, to its call's return", 5, 6),
    ("orchestrator: between the calls (the verify built, the batcher)", 6, 7),
    ("target call: send, wire, the target's wake-up", 7, 8),
    ("target: the frame, to its handler", 8, 9),
    ("target: the handler, less its compute (the reply serialized)", 9, 10),
    ("target reply: send, wire, the orchestrator's wake-up", 10, 11),
    ("orchestrator: the reply, to its call's return (target)", 11, 12),
    ("orchestrator: after the verify (accept, statistics, policy)", 12, 13),
]
BETWEEN = "orchestrator: between rounds (the tokens handed to the client's stream)"
CROSSINGS = {1, 4, 7, 10}  # the segments that are crossings between processes


@dataclass(frozen=True)
class Event:
    ns: int
    event: str
    where: str
    value: int


@dataclass
class KindHops:
    """One kind of round's (greedy, sampled, +traced) segments, µs per round."""

    kind: str
    segments: dict[str, list[float]] = field(default_factory=dict)
    overhead_us: list[float] = field(default_factory=list)  # each whole round's, start to the next start
    skipped: int = 0  # rounds whose path was not PATH


def read_events(directory: Path) -> list[Event]:
    events = []
    for path in sorted(Path(directory).glob(f"*{SUFFIX}")):
        for line in path.read_text().splitlines():
            parts = line.split(" ")
            if len(parts) == 4:
                events.append(Event(int(parts[0]), parts[1], parts[2], int(parts[3])))
    events.sort(key=lambda e: e.ns)
    return events


def rounds(events: list[Event], skip_first_request: bool = False) -> dict[str, KindHops]:
    """Each round's segments, by kind; with `skip_first_request`, not those
    of each kind's first request (a warm-up, as `orchestrator_round` runs one)."""
    starts = [i for i, e in enumerate(events) if e.event == "round.start"]
    kinds: dict[str, KindHops] = {}
    requests: dict[str, int] = {}  # requests of each kind seen so far (a request's rounds count from 0)
    for n, first in enumerate(starts):
        start = events[first]
        if start.value == 0:
            requests[start.where] = requests.get(start.where, 0) + 1
        if skip_first_request and requests.get(start.where, 0) <= 1:
            continue
        kind = kinds.setdefault(start.where, KindHops(start.where))
        stop = starts[n + 1] if n + 1 < len(starts) else len(events)
        found = _path(events, first, stop)
        if found is None:
            kind.skipped += 1
            continue
        at = [events[i] for i in found]
        compute_us = (at[4].value + at[10].value)
        for name, a, b in SEGMENTS:
            took = (at[b].ns - at[a].ns) / 1e3
            if b in (4, 10):
                took -= at[b].value
            kind.segments.setdefault(name, []).append(took)
        following = events[stop] if stop < len(events) else None
        if following is not None and following.where == start.where and following.value == start.value + 1:
            kind.segments.setdefault(BETWEEN, []).append((following.ns - at[-1].ns) / 1e3)
            kind.overhead_us.append((following.ns - start.ns) / 1e3 - compute_us)
    return kinds


def _path(events: list[Event], first: int, stop: int) -> list[int] | None:
    """The indices of PATH's events between `first` (a round.start) and
    `stop`, each the first of its kind after the one before; None if one
    is missing (or the round's end names another kind)."""
    found = [first]
    i = first + 1
    for event, where in PATH[1:]:
        while i < stop and not (events[i].event == event and (where is None or events[i].where == where)):
            i += 1
        if i >= stop:
            return None
        found.append(i)
        i += 1
    end = events[found[-1]]
    if end.where != events[first].where or end.value != events[first].value:
        return None
    return found


def report_lines(kinds: dict[str, KindHops]) -> list[str]:
    order = sorted(kinds, key=lambda k: ("traced" in k, k != "greedy", k))
    kinds_shown = [kinds[k] for k in order if kinds[k].segments]
    if not kinds_shown:
        return ["No round made both of its calls on the lanes: nothing to cut into hops."]
    names = [name for name, _, _ in SEGMENTS] + [BETWEEN]
    lines = ["Where the orchestrator's round goes, hop by hop (specdec/hops.py: each process's events on one "
             "clock; medians over rounds, µs; a handler's segment is less the compute its reply reports):", "",
             "| segment | " + " | ".join(k.kind for k in kinds_shown) + " |",
             "|---|" + "---|" * len(kinds_shown)]
    for index, name in enumerate(names):
        cells = [f"{statistics.median(k.segments[name]):.0f}" if k.segments.get(name) else "-" for k in kinds_shown]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    sums = [sum(statistics.median(v) for v in k.segments.values()) for k in kinds_shown]
    crossings = [sum(statistics.median(k.segments[SEGMENTS[i][0]]) for i in CROSSINGS)
                 for k in kinds_shown]
    lines.append("| **the segments' medians, summed** | " + " | ".join(f"**{s:.0f}**" for s in sums) + " |")
    lines.append("| ... of which the four crossings | " + " | ".join(f"{c:.0f}" for c in crossings) + " |")
    lines.append("| a whole round's overhead (start to the next start, less compute), median | "
                 + " | ".join(f"{statistics.median(k.overhead_us):.0f}" if k.overhead_us else "-"
                              for k in kinds_shown) + " |")
    # The slow rounds a median hides (a contended host makes them): what a mean over rounds, as
    # `specd overhead` reports the orchestrator's round, also counts.
    lines.append("| ... its mean / 90th percentile | "
                 + " | ".join(f"{statistics.fmean(k.overhead_us):.0f} / {percentile(k.overhead_us, 90):.0f}" if k.overhead_us
                              else "-" for k in kinds_shown) + " |")
    lines.append("| rounds cut / left out (another path) | "
                 + " | ".join(f"{len(k.segments[names[0]])} / {k.skipped}" for k in kinds_shown) + " |")
    return lines

