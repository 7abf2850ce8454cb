"""Timestamps of a round's hops across the three processes (`specd overhead --hops`).

A round's overhead is spread over three processes and four crossings
between them: a profile of one process does not say which part of the
round's wall time each piece is. So, when SPECD_HOPS names a directory,
each process writes one line per event of a round's path to a file of its
own there (`<pid>.hops`): the time (CLOCK_MONOTONIC, nanoseconds: on Linux
one clock for every process of the host), the event, and where it was:

    round.start   greedy 12      round 12 of a request starts (greedy, sampled; +traced)
    call.sent     draft          the orchestrator writes a call, serialized, on the draft's lane
    frame.in      draft          a frame arrives at the draft's lane
    call.start    draft          the draft's handler of that call starts
    call.answered draft 10412    its reply, serialized, is about to be written; the compute
                                 the reply reports, µs
    frame.in      from-draft     the reply arrives at the orchestrator
    call.back     draft          the orchestrator's call returns with it
    ... the same for the target ...
    round.end     greedy 12      the round has accepted and accounted for its tokens

`specdec/bench/hops_report.py` turns the files into the round's segments.
Off (the default) each event costs one global read and a call: the places
that record stay on the hot path of every round.
"""
from __future__ import annotations

import atexit
import os
import sys
import time

ENV = "SPECD_HOPS"
SUFFIX = ".hops"

ON = False
_out = None


def start(directory: str) -> str:
    """Record this process's events into DIRECTORY/<pid>.hops (appending); the file's path."""
    global ON, _out
    stop()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{os.getpid()}{SUFFIX}")
    _out = open(path, "a", buffering=1 << 20)
    ON = True
    return path


def stop() -> None:
    """Stop recording; what was recorded is written out."""
    global ON, _out
    ON = False
    if _out is not None:
        _out.close()
        _out = None


def record(event: str, where: str, value: int = 0) -> None:
    if ON:
        _out.write(f"{time.monotonic_ns()} {event} {where} {value}\n")


def compute_micros(response) -> int:
    """The compute a round call's response reports (a Verify's, or the sum of a ProposeAll's drafts)."""
    if hasattr(response, "compute_micros"):
        return response.compute_micros
    return sum(draft.compute_micros for draft in getattr(response, "drafts", ()))


if os.environ.get(ENV):
    try:
        start(os.environ[ENV])
        atexit.register(stop)
    except OSError as exc:  # a diagnostic: the process runs without it
        print(f"specdec.hops: not recording ({ENV}={os.environ[ENV]!r}): {exc}", file=sys.stderr)
