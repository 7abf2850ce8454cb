"""What a soak run found, from its outcomes, memory samples and session
counts: a JSON-ready dict (`summarize`) and a table for people (`table`)."""
from __future__ import annotations

import math
from collections import Counter

from specdec.soak.load import OK, Outcome


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), nearest rank; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


def rss_growth(samples: list[tuple[float, dict[str, float | None]]], until_s: float) -> dict[str, dict]:
    """Per process: RSS at the first sample, at the run's middle and at its
    end (`until_s`, the last sample before the drain), and the growth over the
    second half and over the whole run, in percent. A process that died
    (a fault) is measured until its last sample."""
    during = [(t, rss) for t, rss in samples if t <= until_s] or samples
    names = sorted({n for _, rss in during for n in rss})
    found = {}
    for name in names:
        series = [(t, rss[name]) for t, rss in during if rss.get(name) is not None]
        if not series:
            continue
        start, end = series[0], series[-1]
        middle = min(series, key=lambda s: abs(s[0] - (start[0] + end[0]) / 2))
        found[name] = {"start_mb": round(start[1], 1), "mid_mb": round(middle[1], 1), "end_mb": round(end[1], 1),
                       "max_mb": round(max(v for _, v in series), 1),
                       "growth_second_half_pct": round(100 * (end[1] / middle[1] - 1), 2),
                       "growth_total_pct": round(100 * (end[1] / start[1] - 1), 2)}
    return found


def split_growth(breakdowns: list[tuple[float, dict]], until_s: float) -> dict[str, dict]:
    """Per process and part (kv_store, other): MiB at the
    middle and the end of the load, from the sparse smaps samples."""
    during = [(t, b) for t, b in breakdowns if t <= until_s] or breakdowns
    found = {}
    for name in sorted({n for _, b in during for n in b}):
        series = [(t, b[name]) for t, b in during if b.get(name)]
        if len(series) < 2:
            continue
        end = series[-1]
        middle = min(series, key=lambda s: abs(s[0] - (series[0][0] + end[0]) / 2))
        found[name] = {part: {"start_mb": series[0][1][part], "mid_mb": middle[1][part], "end_mb": end[1][part]}
                       for part in end[1] if end[1][part] is not None}
    return found


def summarize(outcomes: list[Outcome], duration_s: float) -> dict:
    by_status = Counter(o.status for o in outcomes)
    unplanned = [o for o in outcomes if not o.planned]
    done = [o for o in outcomes if o.status == OK]
    latencies = [o.seconds for o in done]
    firsts = [o.first_token_s for o in done if o.first_token_s is not None]

    def rounded(v):
        return None if v is None else round(v, 3)

    return {
        "requests": len(outcomes),
        "completed": len(done),
        "by_status": dict(sorted(by_status.items())),
        "cancels_requested": sum(o.plan.cancel_after is not None for o in outcomes),
        "deadlines_requested": sum(o.plan.deadline_s is not None for o in outcomes),
        "unplanned_errors": len(unplanned),
        "unplanned_examples": [f"{o.status}: {o.detail} (stream {o.plan.stream}, request {o.plan.index})"
                               for o in unplanned[:5]],
        "greedy_completed": sum(o.plan.greedy for o in done),
        "sampled_completed": sum(not o.plan.greedy for o in done),
        "tokens": sum(len(o.tokens) for o in outcomes),
        "tokens_per_s": round(sum(len(o.tokens) for o in outcomes) / duration_s, 1) if duration_s else None,
        "latency_s": {"p50": rounded(percentile(latencies, 50)), "p99": rounded(percentile(latencies, 99))},
        "first_token_s": {"p50": rounded(percentile(firsts, 50)), "p99": rounded(percentile(firsts, 99))},
        "target_recoveries": sum(o.target_recoveries for o in outcomes),
        "fallback_rounds": sum(o.fallback_rounds for o in outcomes),
    }


def table(result: dict) -> str:
    """The figures people read first, one per line."""
    lines = [(f"soak: {result['streams']} streams, {result['seconds']:.0f} s of load, "
              f"{result['replicas']} target replica(s), seed {result['seed']}"),
             f"  requests       {result['requests']} ({result['completed']} completed)",
             "  by status      " + ", ".join(f"{k} {v}" for k, v in result["by_status"].items()),
             f"  planned        {result['cancels_requested']} cancels, {result['deadlines_requested']} short deadlines",
             f"  unplanned      {result['unplanned_errors']} errors",
             (f"  latency        p50 {result['latency_s']['p50']} s, p99 {result['latency_s']['p99']} s "
              f"(first token p50 {result['first_token_s']['p50']} s, p99 {result['first_token_s']['p99']} s)"),
             f"  tokens         {result['tokens']} ({result['tokens_per_s']}/s)"]
    lines.append(f"  recovery       {result['target_recoveries']} target sessions re-opened, "
                 f"{result['fallback_rounds']} rounds without the draft")
    for fault in result.get("faults", []):
        lines.append(f"  fault          {fault['signal']} to {fault['name']} at {fault['at_s']:.1f} s")
    lines.append("  after drain    " + ", ".join(
        f"{name}: {'down' if n is None else f'{n} open'}" for name, n in result["sessions_after_drain"].items())
        + f" (settled in {result['settle_s']} s); expired: "
        + ", ".join(f"{name} {'down' if n is None else n}" for name, n in result["sessions_expired"].items()))
    for name, rss in result["rss"].items():
        lines.append(f"  RSS {name:<13}{rss['start_mb']} -> {rss['mid_mb']} -> {rss['end_mb']} MiB "
                     f"(second half {rss['growth_second_half_pct']:+.2f} %, whole run {rss['growth_total_pct']:+.2f} %)")
    for name, parts in result.get("rss_by_mapping", {}).items():
        lines.append(f"  RSS {name:<13}" + "; ".join(
            f"{part} {p['start_mb']} -> {p['mid_mb']} -> {p['end_mb']}" for part, p in parts.items()))
    if "greedy_identity" in result:
        g = result["greedy_identity"]
        lines.append(f"  greedy         {g['identical']} of {g['checked']} identical to target-only")
    return "\n".join(lines)
