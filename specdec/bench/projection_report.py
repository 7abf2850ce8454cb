"""The *projected* part of `specd bench`'s summary: speedups at assumed
acceptances, from the round costs the run measured (projection.py), and the
check of the same formula at the measured acceptance.

Inputs are the runs `aggregate.build_runs` makes: the fixed-k specdec runs at
one stream under the first network condition carry, in `bound`, the measured
Propose cost split per drafted token and per call (analysis.draft_cost_split),
t_verify (per round, k + 1 tokens) and overhead (per round); target-only's
tokens/s is the baseline.
"""
from __future__ import annotations

from pathlib import Path

from specdec.bench.projection import LAYOUTS, RoundCosts, check_row, projection_table

LAYOUT_LABELS = {"one-gpu": "both models on one device, sequential rounds",
                 "two-gpus-pipelined": "separate devices, pipelined drafting"}


def round_costs(run: dict) -> RoundCosts:
    """A fixed-k run's measured costs, its Propose split per call and per
    token (runs.jsonl from before the split: `reproject` first)."""
    b = run["bound"]
    if b.get("round_overhead_s") is None:  # runs.jsonl from before the prefill was taken out of o
        return RoundCosts(int(run["k"]), b["t_draft_token_s"], b["t_verify_s"], b["overhead_s"], b["t_draft_call_s"])
    return RoundCosts(int(run["k"]), b["t_draft_token_s"], b["t_verify_s"], b["round_overhead_s"], b["t_draft_call_s"],
                      prefill=b["prefill_per_request_s"])


def _fixed_runs(runs: list[dict], temperature: float, head: int | None = None) -> list[dict]:
    """The fixed-k runs of one draft head (default: the first one's; runs
    from before heads were recorded have None)."""
    first_net = runs[0]["network"] if runs else None
    fixed = [r for r in runs if r["policy"] == "fixed" and not r["pipeline"] and r["concurrency"] == 1
             and r["network"] == first_net and r["temperature"] == temperature and r.get("bound")
             and r["bound"].get("t_draft_s") is not None]
    head = draft_heads(fixed)[0] if head is None and fixed else head
    return [r for r in fixed if r.get("draft_vocab") == head]


def draft_heads(runs: list[dict]) -> list[int | None]:
    """The draft heads the speculative runs used, in order (0: full)."""
    return list(dict.fromkeys(r.get("draft_vocab") for r in runs if r["policy"] not in (None, "none")))


def request_tokens(run: dict) -> int | None:
    """The run's mean completion tokens per request: the length its requests
    are projected at (a short request makes fewer tokens per round). Over
    the requests that succeeded: completion_tokens counts only theirs."""
    succeeded = (run.get("requests") or 0) - (run.get("errors") or 0)
    if succeeded <= 0 or not run.get("completion_tokens"):
        return None
    return max(1, round(run["completion_tokens"] / succeeded))


def measured_costs(runs: list[dict], temperature: float,
                   head: int | None = None) -> tuple[list[RoundCosts], float | None, int | None]:
    """(round costs per measured k, target-only tokens/s, tokens per request)
    at one temperature, with one draft head (default: the first)."""
    fixed = _fixed_runs(runs, temperature, head)
    costs = [round_costs(r) for r in fixed]
    base = fixed[0]["target_only_tokens_per_s"] if fixed else None
    n = request_tokens(fixed[0]) if fixed else None
    return sorted(costs, key=lambda c: c.k), base, n


def projection_markdown(runs: list[dict], alphas: list[float]) -> list[str]:
    """Summary lines: the projection table per temperature, and the check."""
    lines: list[str] = []
    temps = list(dict.fromkeys(r["temperature"] for r in runs))
    heads = draft_heads(runs) or [None]
    for temp, head in ((t, h) for t in temps for h in heads):
        costs, base, n = measured_costs(runs, temp, head)
        if not costs or not base:
            continue
        label = "greedy" if temp == 0 else f"T = {temp:g}"
        if len(heads) > 1:
            label += ", draft head " + (f"v{head}" if head else "full")
        lines += [f"## Projected speedup ({label}): measured costs, assumed acceptance", "",
                  "**Projected, not measured**: E(α, k) = (1 − α^(k+1)) / (1 − α) tokens per round over the "
                  "round cost measured in this run, for requests of "
                  f"{n} tokens (this run's mean; the last rounds of a request draft fewer: projection.py); "
                  f"against target-only's measured {base:.2f} tok/s. Layouts: " + "; ".join(f"*{k}* = {v}" for k, v in LAYOUT_LABELS.items()) + ".",
                  ""]
        lines += ["| measured k | draft ms/token | draft call ms | t_verify ms | overhead ms/round |",
                  "|---|---|---|---|---|"]
        lines += [f"| {c.k} | {c.t_draft * 1e3:.2f} | {c.t_draft_call * 1e3:.2f} | {c.t_verify * 1e3:.2f} | "
                  f"{c.overhead * 1e3:.2f} |" for c in costs] + [""]
        rows = projection_table(costs, alphas, base, n)
        lines += ["| assumed α | layout | best k | projected tok/s | projected speedup |", "|---|---|---|---|---|"]
        lines += [f"| {p.alpha:g} | {p.layout} | {p.k} | {p.tokens_per_s:.2f} | **{p.speedup:.2f}x** (projected) |"
                  for p in rows] + [""]
        checks = check_rows(runs, temp, head)
        if checks:
            lines += ["Check: the same formula (one device) at the acceptance this run measured, against the "
                      "speedup it measured. The formula drafts k a round (fewer only in a request's last "
                      "rounds); where the rounds drafted fewer (the draft's min confidence ended them), it "
                      "overcharges the drafting, and the drafts a round say by how much:", "",
                      "| k | drafts a round | measured α | projected speedup | measured speedup | error |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {c['k']} | {_drafts(c.get('mean_k'))} | {c['alpha']:.2f} | {c['projected_speedup']:.2f}x | "
                      f"{c['measured_speedup']:.2f}x | {c['error']:+.1%} |" for c in checks] + [""]
    return lines


def _drafts(mean_k: float | None) -> str:
    return "-" if mean_k is None else f"{mean_k:.2f}"


def check_rows(runs: list[dict], temperature: float, head: int | None = None) -> list[dict]:
    out = []
    for r in _fixed_runs(runs, temperature, head):
        alpha = r["bound"].get("alpha_hat")
        if alpha is None or not r.get("target_only_tokens_per_s") or not r.get("tokens_per_s"):
            continue
        costs = round_costs(r)
        out.append(check_row(costs, alpha, r["tokens_per_s"], r["target_only_tokens_per_s"],
                             request_tokens=request_tokens(r)) | {"mean_k": r.get("mean_k")})
    return out


def projection_plot(runs: list[dict], out_dir: Path, alphas_grid=None) -> list[str]:
    """projected_speedup.png: projected speedup against acceptance, per
    layout, at the best measured k, greedy (or the first temperature), with
    the first draft head."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = list(dict.fromkeys(r["temperature"] for r in runs))
    if not temps:
        return []
    costs, base, n = measured_costs(runs, 0.0 if 0.0 in temps else temps[0])
    if not costs or not base:
        return []
    grid = alphas_grid or [a / 100 for a in range(30, 100, 2)]
    fig, ax = plt.subplots(figsize=(6.0, 3.8), dpi=80)
    for layout in LAYOUTS:
        ys = [p.speedup for p in projection_table(costs, grid, base, n) if p.layout == layout]
        ax.plot(grid, ys, label=f"projected: {LAYOUT_LABELS[layout]}")
    for c in check_rows(runs, 0.0 if 0.0 in temps else temps[0]):
        ax.plot([c["alpha"]], [c["measured_speedup"]], "ko")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("per-draft acceptance α")
    ax.set_ylabel("speedup over target-only")
    ax.set_title("Projected speedup from measured round costs (dots: measured)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(out_dir) / "projected_speedup.png")
    plt.close(fig)
    return ["projected_speedup.png"]


def reproject(runs: list[dict]) -> list[dict]:
    """A past run's runs, with each bound's Propose cost split again from
    its pooled counters (runs.jsonl from before the split have none)."""
    from specdec.bench.analysis import draft_cost_split

    for r in runs:
        bound, pooled = r.get("bound"), r.get("pooled_stats")
        if bound and pooled and bound.get("t_draft_s") is not None:
            bound.update(draft_cost_split(pooled, bound["t_draft_s"]))
    return runs


def main(argv: list[str] | None = None) -> int:
    """The projection of a past `specd bench` run, from its runs.jsonl, as the
    current formulas make it:

        python -m specdec.bench.projection_report RESULTS/runs.jsonl [--assume-acceptance 0.7 0.8 0.85]
    """
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m specdec.bench.projection_report", description=main.__doc__)
    parser.add_argument("runs", type=Path, help="a runs.jsonl that specd bench wrote")
    parser.add_argument("--assume-acceptance", type=float, nargs="+", default=[0.7, 0.8, 0.85])
    args = parser.parse_args(argv)
    runs = reproject([json.loads(line) for line in args.runs.read_text().splitlines() if line.strip()])
    lines = projection_markdown(runs, args.assume_acceptance)
    print("\n".join(lines) if lines else "no fixed-k runs with measured costs in this file")
    return 0 if lines else 1


if __name__ == "__main__":
    raise SystemExit(main())
