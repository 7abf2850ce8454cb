"""What `specd bench` writes once it has measured: requests.jsonl (rewritten with
the identity marks), runs.jsonl, the plots and summary.md, whose header says
how the run was set up (settings, models, notes). The run itself: bench_cmd.
"""
from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

from specdec.bench.runner import SERVICE


def write_results(args, o: dict, prompts: list, runner, interrupted: bool, machine, command: str, out_dir: Path,
                  started: float) -> None:
    """requests.jsonl (rewritten with the identity marks), runs.jsonl, the
    plots and summary.md, which is also printed."""
    from specdec.bench import plots as bench_plots
    from specdec.bench import report
    from specdec.bench.aggregate import build_runs
    from specdec.bench.projection_report import projection_markdown, projection_plot
    from specdec.bench.runner import mark_identity

    records = runner.records
    mark_identity(records)
    report.write_jsonl(out_dir / "requests.jsonl", records)
    dtypes = _dtypes(args, o)
    extra = {"machine": machine, "command": command, "models": {"draft": o["draft"], "target": o["target"],
             "draft_device": o["draft_device"], "target_device": o["target_device"], "dtype": dtypes,
             "draft_vocabs": o["draft_vocabs"], "draft_quantize": o["draft_quantize"],
             "packed_linears": args.packed_linears, "hf_packed_linears": args.hf_packed_linears,
             "threads": args.threads}, "started_utc": dt.datetime.fromtimestamp(started, dt.timezone.utc).isoformat()}
    runs = build_runs(records, extra)
    report.write_jsonl(out_dir / "runs.jsonl", runs)
    plots = bench_plots.write_plots(runs, out_dir) + projection_plot(runs, out_dir)
    wall = time.time() - started
    meta = {"machine": machine, "command": command, "settings": _settings(args, o, prompts),
            "models": _models(args, o, dtypes), "skipped": runner.skipped, "interrupted": interrupted,
            "wall_s": wall, "notes": run_notes(o, runs), "plots": plots}
    summary = "\n".join([report.summary_markdown(runs, meta=meta), "",
                         *projection_markdown(runs, args.assume_acceptance)])
    (out_dir / "summary.md").write_text(summary + "\n")
    print(summary)
    print(f"\nspecd bench: results in {out_dir} ({wall:.0f} s)")


def _dtypes(args, o: dict) -> dict:
    from specdec.engine.loading import resolve_dtype

    return {role: str(resolve_dtype(args.dtype, o[f"{role}_device"])).removeprefix("torch.")
            for role in ("draft", "target")}


def _settings(args, o: dict, prompts: list) -> dict:
    return {
        "prompts": f"{len(prompts)} ({_prompt_kinds(prompts)}), sent to the orchestrator as token ids",
        "max tokens": o["max_tokens"], "configs": ", ".join(c.name for c in o["configs"]),
        "temperatures": ", ".join(f"{t:g}" for t in o["temperatures"]),
        "concurrency": ", ".join(map(str, o["concurrency"])), "repeats": o["repeats"],
        "network": ", ".join(c.name for c in o["conditions"]) + (f", jitter {args.jitter_ms:g} ms"
                                                                  if args.jitter_ms else ""),
        "seeds": f"{args.seed} + prompt index",
    }


def _models(args, o: dict, dtypes: dict) -> dict:
    return {"draft": f"{o['draft']} on {o['draft_device']}, {dtypes['draft']}",
            "draft heads": _heads_label(o["draft_vocabs"]), "draft weights": _draft_weights(o, dtypes),
            "verify batcher": _on_off_label(o["batching"], "batcher-off"),
            "speculation gate": _on_off_label(o["gates"], "gate-off"),
            "draft min confidence": " ".join(f"{v:g}" for v in args.draft_min_confidence) or "the server's default",
            "bf16 linears packed for oneDNN": f"services {args.packed_linears}, HF baselines {args.hf_packed_linears}",
            "target": f"{o['target']} on {o['target_device']}, {dtypes['target']}",
            "threads per service": args.threads or "torch default"}


def _draft_weights(o: dict, dtypes: dict) -> str:
    weights = {"int8": "int8 linear layers (fbgemm)", "auto": f"int8 or {dtypes['draft']}"}
    weights = weights.get(o["draft_quantize"], dtypes["draft"])
    return weights if o["draft_quantize_setting"] != "auto" else f"{weights} ({o['draft_quantize_why']})"


def _heads_label(heads: list[int]) -> str:
    """The draft heads and, with several, how the configs on each are named."""
    several = len(heads) > 1
    return ", ".join((f"{v} most frequent ids" + (f" (NAME/v{v})" if several else "")) if v
                     else "full" + (" (NAME)" if several else "") for v in heads)


def _on_off_label(settings: list[bool], off_suffix: str) -> str:
    """A setting run one way, or both (the off configs named NAME/off_suffix)."""
    if len(settings) == 1:
        return "on" if settings[0] else "off"
    return f"on (NAME), and off at concurrency > 1 (NAME/{off_suffix})"


def run_notes(o: dict, runs: list) -> list[str]:
    """summary.md's Notes: the settings the bench changed on its own
    (`bench_options.resolve`), then how the runs were made."""
    notes = [*o["notes"], "The HF baselines run in this process at concurrency 1, under the first network condition "
             "only.", "At concurrency c > 1 each wave sends the prompts (cycled up to a multiple of c) through c "
             "client threads pulling from one queue."]
    if any(r.get("time_split") and not r["time_split"]["draft_compute_reported"] for r in runs):
        notes.append("This orchestrator does not report draft_compute_time_s: the draft share (*) is the propose "
                     "RPC time, network included, and the ideal bound is not computed.")
    if any(r.get("kind") == SERVICE and r.get("policy") != "none" and r.get("round_trips_per_token") is None
           for r in runs):
        notes.append("This orchestrator does not report round_trips: round trips/token shows -.")
    return notes


def _prompt_kinds(prompts: list) -> str:
    kinds: dict[str, int] = {}
    for p in prompts:
        kinds[p.kind] = kinds.get(p.kind, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in kinds.items())
