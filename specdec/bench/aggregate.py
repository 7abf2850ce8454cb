"""Per-request records → one record per run.

A run is one config × temperature × concurrency × network condition, over
all prompts and repeats. Rates and latencies are computed per repeat and
reported as the median across repeats (so one slow repeat of a drifting
machine does not decide); the orchestrator's counters (acceptance, tokens
per round, time split, bytes) are pooled over every request of the run.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from specdec.bench import acceptance as AC
from specdec.bench import analysis as A
from specdec.bench.runner import HF_ASSISTED, SERVICE, TARGET_ONLY

RUN_KEY = ("config", "temperature", "concurrency", "network")


def run_key(record: dict) -> tuple:
    return tuple(record[k] for k in RUN_KEY)


def _units(records: Iterable[dict]) -> dict[int, list[dict]]:
    units: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        units[r["unit"]].append(r)
    return units


def _repeat_figures(records: list[dict]) -> dict:
    """tokens/s (tokens of the successful requests over the summed wall time of
    their units: aggregate for concurrency > 1), median TTFT, and per-token
    latency percentiles for one repeat of one run.

    A unit none of whose requests succeeded adds no tokens, so it adds no
    time either (counting it added a failed request's wall time, up to its
    deadline, to the successful ones' tokens); the errors are reported on
    their own. A repeat with no successful request has no rate (None, left
    out of the median), not 0."""
    ok = [r for r in records if r["ok"]]
    units = _units(ok)
    wall = sum(rs[0]["unit_wall_s"] for rs in units.values())
    tokens = sum(r["completion_tokens"] for r in ok)
    samples = [s for r in ok for s in A.inter_token_samples([tuple(a) for a in r["arrivals"]])]
    return {"tokens_per_s": A.ratio(tokens, wall), "ttft_s": A.median(r["ttft_s"] for r in ok),
            "itl_p50_s": A.percentile(samples, 50), "itl_p95_s": A.percentile(samples, 95)}


def _max_by_role(dicts: Iterable[dict | None]) -> dict | None:
    out: dict = {}
    for d in dicts:
        for role, v in (d or {}).items():
            if v is not None:
                out[role] = max(out.get(role, 0.0), v)
    return out or None


def summarize_run(records: list[dict]) -> dict:
    """The figures of one run that depend only on its own records."""
    first = records[0]
    ok = [r for r in records if r["ok"]]
    by_repeat: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        by_repeat[r["repeat"]].append(r)
    per_repeat = [_repeat_figures(rs) for _, rs in sorted(by_repeat.items())]
    run = {
        "config": first["config"], "kind": first["kind"], "policy": first["policy"], "k": first["k"],
        "pipeline": first["pipeline"], "draft_vocab": first.get("draft_vocab"), "batching": first.get("batching"),
        "gate": first.get("gate"),
        "temperature": first["temperature"], "concurrency": first["concurrency"],
        "network": first["network"], "draft_rtt_ms": first["draft_rtt_ms"], "target_rtt_ms": first["target_rtt_ms"],
        "jitter_ms": first["jitter_ms"], "max_tokens": first["max_tokens"],
        "repeats": len(by_repeat), "prompts": len({r["prompt_index"] for r in records}),
        "requests": len(records), "errors": len(records) - len(ok),
        "error_examples": sorted({r["error"] for r in records if r["error"]})[:3],
        "completion_tokens": sum(r["completion_tokens"] for r in ok),
        "tokens_per_s": A.median(f["tokens_per_s"] for f in per_repeat),
        "tokens_per_s_repeats": [f["tokens_per_s"] for f in per_repeat],
        "ttft_s": A.median(f["ttft_s"] for f in per_repeat),
        "itl_p50_s": A.median(f["itl_p50_s"] for f in per_repeat),
        "itl_p95_s": A.median(f["itl_p95_s"] for f in per_repeat),
        "peak_mb": _max_by_role(r["peak_mb"] for r in records),
        "gpu_mb": _max_by_role(r["gpu_mb"] for r in records),
    }
    compared = [r["identical_to_target_only"] for r in ok if r["identical_to_target_only"] is not None]
    run["identical_to_target_only"] = {"identical": sum(compared), "compared": len(compared)}
    stats = [r["stats"] for r in ok if r["stats"]]
    if first["kind"] == SERVICE and stats:
        pooled = A.pool_stats(stats)
        tokens = pooled["completion_tokens"]
        speculative = first["policy"] != "none"
        run.update({
            "acceptance_rate": A.ratio(pooled["accepted_tokens"], pooled["proposed_tokens"]) if speculative else None,
            "tokens_per_round": A.ratio(tokens, pooled["rounds"]),
            "mean_k": A.mean_k(pooled["k_histogram"]),
            "k_histogram": pooled["k_histogram"],
            "accepted_per_position": pooled["accepted_per_position"],
            "acceptance_per_position": AC.acceptance_per_position(pooled["accepted_per_position"],
                                                                  pooled["k_histogram"]) if speculative else [],
            "conditional_acceptance_per_position": AC.conditional_acceptance_per_position(
                pooled["accepted_per_position"], pooled["k_histogram"]) if speculative else [],
            "time_split": A.time_split(pooled),
            "wire_bytes_per_token": A.ratio(pooled["wire_bytes"], tokens),
            "round_trips_per_token": A.ratio(pooled["round_trips"], tokens) if pooled["round_trips"] else None,
            "pipelined_rounds": pooled["pipelined_rounds"],
            "fallback_rounds": pooled["fallback_rounds"],
            "plain_rounds": pooled["plain_rounds"],
            "server_ttft_s": A.median(s["time_to_first_token_s"] for s in stats),
            "pooled_stats": pooled,
        })
        proxy = {r["unit"]: r["unit_proxy_bytes"] for r in ok if r["unit_proxy_bytes"] is not None}
        run["proxy_bytes_per_token"] = A.ratio(sum(proxy.values()), tokens) if proxy else None
    return run


def build_runs(records: list[dict], extra: dict | None = None) -> list[dict]:
    """Every run, with speedups against target-only (service) under the same
    temperature, concurrency and network, against HF assisted (same
    temperature, concurrency 1) and, for speculative runs at concurrency 1,
    the analytic bound and efficiency. `extra` is merged into every run
    (machine, command, ...)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[run_key(r)].append(r)
    runs = [summarize_run(rs) for rs in groups.values()]
    index = {(r["config"], r["temperature"], r["concurrency"], r["network"]): r for r in runs}
    hf_assisted = {r["temperature"]: r for r in runs if r["kind"] == HF_ASSISTED and r["concurrency"] == 1}
    for run in runs:
        base = index.get((TARGET_ONLY, run["temperature"], run["concurrency"], run["network"]))
        if base is None and run["kind"] != SERVICE:  # HF runs: the first network condition's target-only
            base = next((r for r in runs if r["config"] == TARGET_ONLY and r["temperature"] == run["temperature"]
                         and r["concurrency"] == run["concurrency"]), None)
        base_tps = base["tokens_per_s"] if base else None
        run["target_only_tokens_per_s"] = base_tps
        run["speedup_vs_target_only"] = A.ratio(run["tokens_per_s"], base_tps)
        hfa = hf_assisted.get(run["temperature"]) if run["concurrency"] == 1 else None
        run["speedup_vs_hf_assisted"] = A.ratio(run["tokens_per_s"], hfa["tokens_per_s"]) if hfa else None
        run["bound"] = None
        if run["kind"] == SERVICE and run["policy"] != "none" and run["concurrency"] == 1 and run.get("pooled_stats"):
            base_pooled = base.get("pooled_stats") if base else None
            base_compute = (A.ratio(base_pooled["completion_tokens"], base_pooled["target_compute_time_s"])
                            if base_pooled else None)
            run["bound"] = A.bound_for_run(run["pooled_stats"], nominal_k=run["k"] if run["policy"] == "fixed" else None,
                                           measured_tokens_per_s=run["tokens_per_s"], baseline_tokens_per_s=base_tps,
                                           baseline_compute_tokens_per_s=base_compute)
        run["alpha_hat"] = run["bound"]["alpha_hat"] if run["bound"] else None
        run["expected_speedup"] = run["bound"]["expected_speedup"] if run["bound"] else None
        run["efficiency"] = run["bound"]["efficiency"] if run["bound"] else None
        run["ideal_speedup"] = run["bound"]["ideal"]["expected_speedup"] if run["bound"] else None
        if extra:
            run.update(extra)
    order = {name: i for i, name in enumerate(dict.fromkeys(r["config"] for r in records))}
    conds = {name: i for i, name in enumerate(dict.fromkeys(r["network"] for r in records))}
    runs.sort(key=lambda r: (conds[r["network"]], r["temperature"], r["concurrency"], order[r["config"]]))
    return runs


def best_speculative(runs: list[dict], temperature: float, network: str, concurrency: int = 1) -> dict | None:
    """The fastest specdec run at this temperature, network and concurrency."""
    cands = [r for r in runs if r["kind"] == SERVICE and r["policy"] != "none" and r["temperature"] == temperature
             and r["network"] == network and r["concurrency"] == concurrency and r["tokens_per_s"]]
    return max(cands, key=lambda r: r["tokens_per_s"], default=None)


GOALS = (
    ("specdec best vs target-only (service)", 2.0),
    ("specdec best vs HF assisted", 1.3),
    ("efficiency of the best specdec config", 0.9),
    ("8-stream aggregate vs one stream", 3.0),
)


def evaluate_goals(runs: list[dict]) -> list[dict]:
    """The issue's goals per temperature, at concurrency 1 under the first
    network condition; the concurrency goal uses the best config's highest
    concurrency (it says so when that is not 8)."""
    if not runs:
        return []
    network = runs[0]["network"]
    out = []
    for temp in dict.fromkeys(r["temperature"] for r in runs):
        best = best_speculative(runs, temp, network)
        if best is None:
            continue
        name = best["config"]
        # the concurrency goal: the fastest one-stream specdec config that also ran with more streams
        multi = [r for r in runs if r["kind"] == SERVICE and r["policy"] != "none" and r["temperature"] == temp
                 and r["network"] == network and r["concurrency"] > 1 and r["tokens_per_s"]]
        names = {r["config"] for r in multi}
        one = max((r for r in runs if r["config"] in names and r["temperature"] == temp and r["network"] == network
                   and r["concurrency"] == 1 and r["tokens_per_s"]), key=lambda r: r["tokens_per_s"], default=None)
        multi = [r for r in multi if one is not None and r["config"] == one["config"]]
        top = max(multi, key=lambda r: r["concurrency"], default=None)
        values = [
            (GOALS[0], best["speedup_vs_target_only"], f"{name}"),
            (GOALS[1], best["speedup_vs_hf_assisted"], f"{name}"),
            (GOALS[2], best["efficiency"], f"{name}"),
            (GOALS[3], A.ratio(top["tokens_per_s"], one["tokens_per_s"]) if top else None,
             f"{top['config']}, {top['concurrency']} streams"
             + ("" if top["concurrency"] == 8 else " (goal is 8: not evaluated)")
             if top else "no specdec config ran with more than one stream"),
        ]
        for (goal, threshold), value, detail in values:
            evaluable = value is not None and not (goal == GOALS[3][0] and top is not None and top["concurrency"] != 8)
            out.append({"goal": goal, "temperature": temp, "threshold": threshold, "measured": value,
                        "detail": detail, "met": (value >= threshold) if evaluable else None})
    return out
