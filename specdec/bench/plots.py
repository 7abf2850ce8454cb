"""`specd bench`'s PNG plots of the runs in a results folder: tokens/s per config,
speedup vs k, acceptance per draft position, throughput vs concurrency and vs
round-trip time (the projection's plot: projection_report.py)."""
from __future__ import annotations

from pathlib import Path

from specdec.bench.report import temperature_label
from specdec.bench.runner import HF_ASSISTED, SERVICE


def _style(temperature: float) -> str:
    """Solid lines with circles for greedy runs, dashed with squares for sampled ones."""
    return "o-" if temperature == 0 else "s--"


def config_variant(name: str) -> str:
    """What a config's name says after its base (fixed-k4/v16384/c0.5: "v16384/c0.5"): its draft head,
    batcher, gate and min-confidence variant; "" for the plain config."""
    return name.split("/", 1)[1] if "/" in name else ""


def speedup_vs_k_lines(fixed: list[dict], temperature: float) -> dict[str, list[tuple]]:
    """The speedup-vs-k plot's lines at one temperature: one per variant
    (config_variant), each [(k, measured speedup, expected speedup)] in
    order of k. Runs of one k on several draft heads or min confidences are
    other configs, not other points of one line (drawn as one, the line went
    back and forth between them at each k)."""
    lines: dict[str, list[tuple]] = {}
    for r in fixed:
        if r["temperature"] == temperature and r["speedup_vs_target_only"] is not None:
            lines.setdefault(config_variant(r["config"]), []).append(
                (r["k"], r["speedup_vs_target_only"], r.get("expected_speedup")))
    return {variant: sorted(pts, key=lambda p: p[0]) for variant, pts in lines.items()}


def write_plots(runs: list[dict], out_dir: Path | str) -> list[str]:
    """PNG plots into out_dir; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    written: list[str] = []
    if not runs:
        return written
    first_net = runs[0]["network"]
    temps = list(dict.fromkeys(r["temperature"] for r in runs))
    one = [r for r in runs if r["concurrency"] == 1 and r["network"] == first_net]

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(name)

    # tokens/s per config, one stream, one bar group per temperature
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=80)
    names = list(dict.fromkeys(r["config"] for r in one))
    for i, temp in enumerate(temps):
        tps = {r["config"]: r["tokens_per_s"] or 0 for r in one if r["temperature"] == temp}
        ax.bar([x + i * 0.8 / len(temps) for x in range(len(names))], [tps.get(n, 0) for n in names],
               0.8 / len(temps), label=temperature_label(temp))
    ax.set_xticks([x + 0.4 - 0.4 / len(temps) for x in range(len(names))], names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("tokens/s, one stream")
    ax.set_title("Tokens/s per config")
    ax.legend(fontsize=7)
    save(fig, "tokens_per_s_per_config.png")

    # speedup vs k, one line per temperature and variant (draft head, min confidence)
    fixed = [r for r in one if r["policy"] == "fixed" and not r["pipeline"]]
    if fixed:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for temp in temps:
            colors = {}  # each line's colour, by variant
            for variant, pts in speedup_vs_k_lines(fixed, temp).items():
                what = temperature_label(temp) + (f", {variant}" if variant else "")
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"measured, {what}")
                colors[variant] = line.get_color()
                exp = [(p[0], p[2]) for p in pts if p[2] is not None]
                if exp:
                    ax.plot([p[0] for p in exp], [p[1] for p in exp], "x--", color=line.get_color(),
                            label=f"expected (bound), {what}")
            for r in one:
                if r["temperature"] == temp and r["kind"] == HF_ASSISTED and r["speedup_vs_target_only"]:
                    ax.axhline(r["speedup_vs_target_only"], color=colors.get("", next(iter(colors.values()), None)),
                               linestyle=":",
                               label=f"HF assisted, {temperature_label(temp)}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(sorted({r["k"] for r in fixed}))
        ax.set_xlabel("k (draft tokens per round)")
        ax.set_ylabel("speedup vs target-only (service)")
        ax.set_title("Speedup vs k")
        ax.legend(fontsize=7)
        save(fig, "speedup_vs_k.png")

    # acceptance per position
    spec = [r for r in one if r.get("acceptance_per_position")]
    if spec:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for r in spec:
            vals = [(i + 1, v) for i, v in enumerate(r["acceptance_per_position"]) if v is not None]
            if vals:
                ax.plot([v[0] for v in vals], [v[1] for v in vals], _style(r["temperature"]),
                        label=f"{r['config']}, T={r['temperature']:g}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("accepted / rounds that drafted there")
        ax.set_ylim(0, 1.05)
        ax.set_title("Acceptance per draft position")
        ax.legend(fontsize=7)
        save(fig, "acceptance_per_position.png")

    # tokens/s vs concurrency
    concs = sorted({r["concurrency"] for r in runs})
    if len(concs) > 1:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for temp in temps:
            for name in dict.fromkeys(r["config"] for r in runs if r["kind"] == SERVICE):
                pts = sorted((r["concurrency"], r["tokens_per_s"]) for r in runs if r["config"] == name
                             and r["temperature"] == temp and r["network"] == first_net and r["tokens_per_s"])
                if len(pts) > 1:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], _style(temp), label=f"{name}, T={temp:g}")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_xticks(concs)
        ax.set_title("Throughput vs concurrency")
        ax.legend(fontsize=7)
        save(fig, "tokens_per_s_vs_concurrency.png")

    # tokens/s vs RTT
    nets = [r for r in runs if r["concurrency"] == 1 and r["kind"] == SERVICE and r["target_rtt_ms"] is not None]
    if len({(r["draft_rtt_ms"], r["target_rtt_ms"]) for r in nets}) > 1:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for temp in temps:
            for name in dict.fromkeys(r["config"] for r in nets):
                pts = sorted((r["target_rtt_ms"], r["tokens_per_s"]) for r in nets if r["config"] == name
                             and r["temperature"] == temp and r["tokens_per_s"])
                if len(pts) > 1:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], _style(temp), label=f"{name}, T={temp:g}")
        ax.set_xlabel("round-trip time to each service, ms")
        ax.set_ylabel("tokens/s")
        ax.set_title("Throughput vs network round-trip time")
        ax.legend(fontsize=7)
        save(fig, "tokens_per_s_vs_rtt.png")
    return written
