"""The results folder: runs.jsonl, requests.jsonl and summary.md (the PNG plots: plots.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from specdec.bench.aggregate import evaluate_goals
from specdec.bench.analysis import EARLY_STOPS
from specdec.bench.machine import machine_line
from specdec.bench.runner import SERVICE, TARGET_ONLY

# --------------------------------------------------------------------- jsonl


def write_jsonl(path: Path | str, rows: Iterable[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")


def read_jsonl(path: Path | str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------ markdown


def _f(value, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}{suffix}"


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _pct(value) -> str:
    return "-" if value is None else f"{value * 100:.0f}"


def temperature_label(t: float) -> str:
    """How a temperature heads a table or labels a plot line."""
    return "T=0 (greedy)" if t == 0 else f"T={t:g} (sampled)"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def _peak(run: dict) -> str:
    peaks = run.get("peak_mb") or {}
    if run["kind"] == SERVICE:
        parts = [_f(peaks.get(role), 0) for role in ("target", *_route_services(run, peaks))]
        text = " / ".join(parts)
    else:
        text = f"bench {_f(peaks.get('bench'), 0)}"
    gpu = run.get("gpu_mb")
    if gpu:
        text += " (GPU " + ", ".join(f"{k} {v:.0f}" for k, v in gpu.items()) + ")"
    return text


def _route_services(run: dict, peaks: dict) -> tuple[str, str]:
    """The names of the draft and orchestrator services a run used: with
    several heads, batcher or gate settings the bench starts several (services.py
    names them; the first of each is named plainly)."""
    from specdec.bench.configs import Route
    from specdec.bench.services import draft_name

    head, batching, gate = run.get("draft_vocab"), run.get("batching"), run.get("gate")
    draft = draft_name(head, first=False) if head is not None else "draft"
    orch = "orchestrator-" + Route(head or 0, batching is not False, gate is not False).name
    return (draft if draft in peaks else "draft"), (orch if orch in peaks else "orchestrator")


def _split(run: dict) -> str:
    ts = run.get("time_split")
    if not ts or run["policy"] == "none" and not ts.get("duration_s"):
        return "-"
    mark = "" if ts["draft_compute_reported"] else "*"
    prefill = _pct(ts.get("prefill_share") or 0.0)  # records from before prefill was reported: 0
    return f"{_pct(ts['draft_share'])}{mark} / {_pct(ts['target_share'])} / {prefill} / {_pct(ts['other_share'])}"


def _pipelined(run: dict) -> str:
    pooled = run.get("pooled_stats")
    if not pooled or not run.get("pipeline"):
        return "-"
    return f"{pooled['pipelined_rounds']}/{pooled['rounds']}"


def _identical(run: dict) -> str:
    ident = run.get("identical_to_target_only") or {}
    if run["temperature"] != 0 or not ident.get("compared"):
        return "-"
    if run["config"] == TARGET_ONLY and run["concurrency"] == 1:
        return "(reference)"
    return f"{ident['identical']}/{ident['compared']}"


MAIN_HEADER = ["config", "tok/s", "vs target-only", "vs HF assisted", "TTFT s", "p50 ms/tok", "p95 ms/tok",
               "acceptance", "tokens/round", "expected speedup", "efficiency",
               "draft / target / prefill / other %", "B/token", "round trips/token", "pipelined rounds",
               "peak MB (target / draft / orch)", "identical"]


def main_rows(runs: list[dict]) -> list[list[str]]:
    rows = []
    for r in runs:
        name = r["config"] + (f" (mean k {r['mean_k']:.1f})" if r.get("mean_k") and r["policy"] not in ("fixed", "none")
                              else "")
        if r["errors"]:
            name += f" [{r['errors']} errors]"
        rows.append([
            name, _f(r["tokens_per_s"]), _x(r["speedup_vs_target_only"]), _x(r["speedup_vs_hf_assisted"]),
            _f(r["ttft_s"]), _ms(r["itl_p50_s"]), _ms(r["itl_p95_s"]), _f(r.get("acceptance_rate")),
            _f(r.get("tokens_per_round")), _x(r.get("expected_speedup")), _f(r.get("efficiency")), _split(r),
            _f(r.get("wire_bytes_per_token"), 0), _f(r.get("round_trips_per_token")), _pipelined(r), _peak(r),
            _identical(r),
        ])
    return rows


BATCHER_OFF = "/batcher-off"
GATE_OFF = "/gate-off"


def concurrency_table(runs: list[dict], conc: list[int], network: str) -> tuple[list[str], list[list[str]]]:
    """Aggregate tok/s per concurrency level for each service config that ran
    above one stream, and vs target-only at the highest level; with
    `--batcher on off`, two more columns: the same config at the highest level
    with the verify batcher off, and on / off; with `--speculation-gate on
    off`, the same two for the speculation gate."""
    def tps(name: str, temp: float, c: int):
        return next((r["tokens_per_s"] for r in runs if r["config"] == name and r["temperature"] == temp
                     and r["concurrency"] == c and r["network"] == network), None)

    variants = [(suffix, what) for suffix, what in ((BATCHER_OFF, "batcher"), (GATE_OFF, "gate"))
                if any(r["config"].endswith(suffix) for r in runs)]
    top = conc[-1]
    header = ["config", "temperature"] + [f"c={c}" for c in conc]
    header += ([f"c={top} / c=1"] if 1 in conc else []) + [f"c={top} vs target-only"]
    for _, what in variants:
        header += [f"c={top} {what} off", f"{what} on / off"]
    rows = []
    for temp in dict.fromkeys(r["temperature"] for r in runs):
        for name in dict.fromkeys(r["config"] for r in runs if r["kind"] == SERVICE):
            by_c = {c: tps(name, temp, c) for c in conc}
            if any(suffix in name for suffix, _ in variants) or not any(by_c[c] for c in conc if c > 1):
                continue
            row = [name, temperature_label(temp)] + [_f(by_c[c]) for c in conc]
            row += [_ratio(by_c[top], by_c[1])] if 1 in conc else []
            row.append(_ratio(by_c[top], tps(TARGET_ONLY, temp, top)))
            for suffix, _ in variants:
                without = tps(name + suffix, temp, top)
                row += [_f(without), _ratio(by_c[top], without)]
            rows.append(row)
    return header, rows


def _ratio(a, b) -> str:
    return _x(a / b) if a and b else "-"


def summary_markdown(runs: list[dict], *, meta: dict) -> str:
    """The whole summary.md. meta: machine, command, settings, models, skipped,
    out_dir, wall_s, interrupted, notes."""
    lines = ["# specd bench", ""]
    if meta.get("interrupted"):
        lines += ["**Interrupted**: the figures below cover only what finished.", ""]
    lines += ["## Machine", "", f"- {machine_line(meta['machine'])}"]
    if meta["machine"].get("other_load"):
        lines.append(f"- {meta['machine']['other_load']}")
    for key, value in (meta.get("models") or {}).items():
        lines.append(f"- {key}: {value}")
    lines += ["", "## Command", "", "```", meta["command"], "```", ""]
    settings = meta.get("settings") or {}
    if settings:
        lines += ["## Settings", ""] + [f"- {k}: {v}" for k, v in settings.items()] + [""]
    if meta.get("wall_s") is not None:
        lines += [f"Wall time: {meta['wall_s']:.0f} s.", ""]

    goals = evaluate_goals(runs)
    if goals:
        lines += ["## Goals", ""]
        rows = [[g["goal"], temperature_label(g["temperature"]), f">= {g['threshold']}",
                 "-" if g["measured"] is None else f"{g['measured']:.2f}", g["detail"],
                 {True: "met", False: "not met", None: "not evaluated"}[g["met"]]] for g in goals]
        lines += _table(["goal", "temperature", "target", "measured", "config", "result"], rows) + [""]

    first_net = runs[0]["network"] if runs else None
    for temp in dict.fromkeys(r["temperature"] for r in runs):
        sel = [r for r in runs if r["temperature"] == temp and r["concurrency"] == 1 and r["network"] == first_net]
        if not sel:
            continue
        lines += [f"## {temperature_label(temp)}, one stream, network: {first_net}", ""]
        lines += _table(MAIN_HEADER, main_rows(sel)) + [""]

    conc = sorted({r["concurrency"] for r in runs})
    if max(conc) > 1:
        lines += ["## Concurrency (aggregate tok/s)", ""]
        lines += _table(*concurrency_table(runs, conc, first_net)) + [""]

    nets = list(dict.fromkeys(r["network"] for r in runs))
    if len(nets) > 1:
        lines += ["## Network (tok/s per round-trip time, one stream)", ""]
        header = ["config", "temperature"] + nets
        rows = []
        for temp in dict.fromkeys(r["temperature"] for r in runs):
            for name in dict.fromkeys(r["config"] for r in runs if r["kind"] == SERVICE):
                by_n = {r["network"]: r for r in runs if r["config"] == name and r["temperature"] == temp
                        and r["concurrency"] == 1}
                cells = []
                for n in nets:
                    r = by_n.get(n)
                    cells.append("-" if r is None else (f"{_f(r['tokens_per_s'])} ({_x(r['speedup_vs_target_only'])})"
                                                        if r["config"] != TARGET_ONLY else _f(r["tokens_per_s"])))
                rows.append([name, temperature_label(temp)] + cells)
        lines += _table(header, rows) + [""]

    bounded = [r for r in runs if r.get("bound") and r["network"] == first_net]
    if bounded:
        lines += ["## Analytic bound (Leviathan et al.), one stream", ""]
        header = ["config", "temperature", "k", "α̂", "E tokens/round", "measured tokens/round", "t_draft ms/token",
                  "t_verify ms/round", "overhead ms/round", "expected tok/s", "measured tok/s", "expected speedup",
                  "measured speedup", "efficiency", "ideal speedup (compute only)"]
        rows = []
        for r in bounded:
            b = r["bound"]
            k = "-" if b["k"] is None else (f"{b['k']:.2f} (mean)" if b["k_is_mean"] else f"{b['k']}")
            rows.append([r["config"], temperature_label(r["temperature"]), k, _f(b["alpha_hat"], 3),
                         _f(b["expected_tokens_per_round"]), _f(r.get("tokens_per_round")), _ms(b["t_draft_s"]),
                         _ms(b["t_verify_s"]), _ms(b["overhead_s"]), _f(b["expected_tokens_per_s"]),
                         _f(r["tokens_per_s"]), _x(b["expected_speedup"]), _x(b["measured_speedup"]),
                         _f(b["efficiency"]), _x(b["ideal"]["expected_speedup"])])
        lines += _table(header, rows) + [""]

    spec = [r for r in runs if r.get("acceptance_per_position") and r["concurrency"] == 1 and r["network"] == first_net]
    if spec:
        width = max(len(r["acceptance_per_position"]) for r in spec)
        lines += ["## Acceptance per draft position (accepted / rounds that drafted there), one stream", ""]
        header = ["config", "temperature"] + [f"pos {i + 1}" for i in range(width)]
        rows = [[r["config"], temperature_label(r["temperature"])]
                + [_f(v) for v in r["acceptance_per_position"]] + ["-"] * (width - len(r["acceptance_per_position"]))
                for r in spec]
        lines += _table(header, rows) + [""]

    if meta.get("skipped"):
        lines += ["## Skipped configs", ""]
        lines += [f"- {name}: {reason}" for name, reason in meta["skipped"].items()] + [""]
    errors = [r for r in runs if r["errors"]]
    if errors:
        lines += ["## Errors", ""]
        lines += [f"- {r['config']} {temperature_label(r['temperature'])} c={r['concurrency']} {r['network']}: "
                  f"{r['errors']} of {r['requests']} requests failed ({'; '.join(r['error_examples'])})"
                  for r in errors] + [""]
    lines += ["## Definitions", ""] + [f"- {d}" for d in DEFINITIONS] + [""]
    if meta.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in meta["notes"]] + [""]
    if meta.get("plots"):
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in meta["plots"]] + [""]
    return "\n".join(lines)


DEFINITIONS = (
    "tok/s: emitted tokens over client-side wall time, per repeat, median across repeats; at concurrency c, "
    "all tokens of a wave of requests over the wave's wall time (aggregate). The tokens are those of the "
    "requests that succeeded, the time that of the requests (or waves) in which one did: a failed request's "
    "time is not charged to the others' tokens; the errors are listed apart.",
    "target-only: the same orchestrator and target service with speculation disabled; hf: transformers "
    "generate with the target in the bench process; hf-assisted: generate(..., assistant_model=draft) with "
    "transformers' default assistant settings. All get identical prompt token ids.",
    "TTFT: client-side time from sending the request to the first token; p50/p95 ms/tok: per-token latency "
    "after the first chunk (a chunk of n tokens dt after the previous one gives n samples of dt/n).",
    "acceptance: accepted drafts / drafted tokens; tokens/round: emitted tokens / rounds (all rounds).",
    "draft / target / prefill / other %: shares of the orchestrator's request time: the draft service's "
    "forward time (draft_compute_time_s; * = not reported, the propose RPC time instead), the target's verify "
    "compute (target_compute_time_s), the session opens the request waited for (prefill_time_s: both "
    "prefills at once, re-opens included; model time, not overhead), and the rest = network + orchestration "
    "(gRPC, batching window, session close, acceptance, added network delay). With pipelined drafting the "
    "draft computes while the target verifies: the model shares can add up past 100%, and other, the rest, is "
    "then the system's own time less that overlap, negative when the overlap is larger (shown as it is, not "
    "floored at 0).",
    "α̂: per-draft acceptance MLE = accepted / (accepted + rounds ending in a rejection), with the "
    "rejections counted by the orchestrator (GenerateStats.rejected_rounds); for records without that count, "
    "the rejections of smaller rounds are estimated from the k histogram (acceptance.estimate_alpha).",
    "expected speedup: E(α̂, k) / (k·t_draft + t_verify + overhead) ÷ measured target-only tok/s, with "
    "t_draft = draft_time_s / drafted tokens, t_verify = verify_time_s / rounds, overhead = (duration − "
    "draft_time − verify_time) / rounds, all as the orchestrator measured them; for adaptive/goodput, "
    f"and for a fixed k whose rounds drafted under {EARLY_STOPS} k on average (stopped early by the draft's min "
    "confidence), k is the mean k. efficiency = measured speedup / expected speedup: since the overhead term is "
    "what the rounds' wall time leaves after the two calls, the cost adds up to the measured time, and "
    "efficiency tests the acceptance model (tokens per round against E(α̂, k)) and the client/server timing, "
    "not the system's own cost: that is the *other* share, and the gap to the ideal speedup. ideal speedup: "
    "compute only (draft_compute_time_s per drafted token, target_compute_time_s per round, no overhead) "
    "against target-only's compute-only rate. For pipelined configs draft_time counts only what a round "
    "waited for its drafts; the overhead term takes the rest.",
    "B/token: protobuf bytes exchanged with both services / emitted tokens; round trips/token: downstream "
    "RPCs / emitted tokens (- when the orchestrator does not report them); pipelined rounds: rounds whose "
    "drafts were proposed during the previous verification and used / all rounds.",
    "peak MB: VmHWM (peak resident memory) of each service process, reset before every unit by writing 5 to "
    "/proc/PID/clear_refs; for HF runs the bench process's own peak. GPU: nvidia-smi's used memory per "
    "service process sampled after each unit, and torch's peak allocation for the HF runs.",
    "identical: greedy outputs token-for-token equal to target-only (service) on the same prompt.",
)
