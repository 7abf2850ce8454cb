"""Timing calls against each other: each call's median over repetitions,
the calls taken in turn so that a machine that slows down during the run
moves all of them alike (`specd overhead`)."""
from __future__ import annotations

import inspect
import random
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


def orders(names: list[str], reps: int, seed: int = 0) -> list[list[str]]:
    """Each rep's order of the calls: shuffled afresh (seeded), and never the
    last call of one rep first in the next. Taking them in one fixed order
    and back, as this did before, ran the first and the last call twice in
    a row at every turn: a round on services that had just served one, warm,
    which read about 0.05-0.1 ms cheaper than a round on services that had
    sat through the other calls (`specd overhead`: the last round was the
    traced T=0.7 one, whose tracing then looked cheaper than the greedy
    round's)."""
    rng = random.Random(seed)
    result: list[list[str]] = []
    for _ in range(reps):
        order = list(names)
        rng.shuffle(order)
        if result and len(order) > 1 and order[0] == result[-1][-1]:
            swap = rng.randrange(1, len(order))
            order[0], order[swap] = order[swap], order[0]
        result.append(order)
    return result


async def interleave(calls: dict[str, Call], reps: int, warmup: int = 20) -> dict[str, float]:
    """Median seconds of each call, the calls taken in turn, in a new order
    each rep (`orders`), so that drift, and what a call leaves behind for
    the next, touch all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for rep, order in enumerate(orders(list(calls), reps + warmup)):
        for name in order:
            seconds, result = await timed(calls[name])
            if rep < warmup:
                continue
            times[name].append(seconds)
            if isinstance(result, ReportedCompute):
                times.setdefault(name + OUTSIDE, []).append(seconds - result)
    return {name: statistics.median(t) for name, t in times.items()}
