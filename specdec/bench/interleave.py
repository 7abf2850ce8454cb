"""Timing calls against each other: each call's median over repetitions,
the calls taken in turn so that a machine that slows down during the run
moves all of them alike (`specd overhead`)."""
from __future__ import annotations

import inspect
import statistics
import time
from typing import Awaitable, Callable

Call = Callable[[], Awaitable[object] | object]


class ReportedCompute(float):
    """What a call returns to say how many of its seconds the services
    reported as their own compute (or, for the cold floor, as idle waiting):
    `interleave` then also records, rep by rep, the call's wall time minus it
    (`<name> outside compute`)."""


OUTSIDE = " outside compute"


async def timed(call: Call) -> tuple[float, object]:
    start = time.perf_counter()
    result = call()
    if inspect.isawaitable(result):
        result = await result
    return time.perf_counter() - start, result


async def interleave(calls: dict[str, Call], reps: int, warmup: int = 20) -> dict[str, float]:
    """Median seconds of each call, the calls taken in turn (forwards, then
    backwards) so that drift touches all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for rep in range(reps + warmup):
        order = list(calls) if rep % 2 else list(reversed(calls))
        for name in order:
            seconds, result = await timed(calls[name])
            if rep < warmup:
                continue
            times[name].append(seconds)
            if isinstance(result, ReportedCompute):
                times.setdefault(name + OUTSIDE, []).append(seconds - result)
    return {name: statistics.median(t) for name, t in times.items()}


