"""`specd overhead`'s report: the figures `overhead.measure` took, as the
table of ratios to the bare references (the rows the issue's goals are read
from), the rounds against their compute in-process, and each process's CPU
a round outside the models."""
from __future__ import annotations

from dataclasses import dataclass

from specdec import eventloop
from specdec.bench.interleave import OUTSIDE
from specdec.bench.round_cpu import RoundCpu
from specdec.rpc import grpc_io

# The bare unary call of the phase whose calls run the models in the measuring process.
MODELS_HERE_BARE = "bare unary, the phase of the models run here"
# The measuring thread's CPU for one bare lane frame each way, back to back and after a round's idle.
LANE_CPU = "bare lane frame, client CPU"
LANE_CPU_COLD = "bare lane frame, client CPU after the draft's compute"


@dataclass
class Figures:
    medians: dict[str, float]
    k: int
    in_process: bool = False  # every stack's services ran in the measuring process
    cpu: dict[str, RoundCpu] | None = None  # by sampling (and tracing): the lanes' rounds, back to back
    note: str = ""  # what the report must say was not measured, and why

    def round_overhead(self, prefix: str, sampling: str) -> float:
        """Median over rounds of (round wall time − the compute the services
        reported for it): the overhead of the issue's definition."""
        return self.medians[f"{prefix} {sampling} round{OUTSIDE}"]

    def round_minus_local_compute(self, prefix: str, sampling: str) -> float:
        """Median round wall time − median of the same compute in-process:
        also counts what the services' compute loses to running in a
        server (thread contention, caches)."""
        return self.medians[f"{prefix} {sampling} round"] - self.medians[f"{prefix} {sampling} compute"]


def report(fig: Figures, reps: int) -> str:
    m = fig.medians
    unary, message = m["bare unary"], m["bare stream message"]
    cold = m[f"bare cold round floor{OUTSIDE}"]

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.3f}"

    calls_unary = m["bare unary (calls)"]  # the no-ops' phase: bare calls interleaved with the no-ops alone
    ee = lambda name: m[f"{name} (event engine)"]  # noqa: E731
    rows = [
        ("bare grpc.aio unary call", unary, "1.00x", ""),
        ("bare message each way on an open stream", message, f"{message / unary:.2f}x", ""),
        ("a round's floor on call streams: two bare messages each way", 2 * message,
         f"{2 * message / unary:.2f}x", ""),
        (f"the same floor as a round meets it: each message after waiting as long as one service's compute "
         f"(greedy: {m['cold floor draft gap'] * 1e3:.1f} and {m['cold floor target gap'] * 1e3:.1f} ms)", cold,
         f"{cold / unary:.2f}x", ""),
    ]
    lane = m.get("bare lane frame")
    lane_floor = m.get(f"bare lane cold round floor{OUTSIDE}")
    if lane is not None and lane_floor is not None:
        where = "this process" if fig.in_process else "a process of its own, as each service is"
        rows += [
            (f"bare frame each way on an open lane connection (the lanes' TCP between two event loops, none of "
             f"our code; to {where})", lane, f"{lane / unary:.2f}x", ""),
            ("the lanes' floor as a round meets it: two bare frames each way, each after waiting as long as one "
             "service's compute", lane_floor, f"{lane_floor / unary:.2f}x", ""),
        ]
    if "bare unary (event engine)" in m:
        rows += [
            ("the same bare unary call under grpcio's default I/O (EventEngine; a child process, just before)",
             ee("bare unary"), f"{ee('bare unary') / unary:.2f}x", ""),
            ("... a bare message each way, EventEngine", ee("bare stream message"),
             f"{ee('bare stream message') / unary:.2f}x", ""),
            ("... the floor as a round meets it, EventEngine", ee(f"bare cold round floor{OUTSIDE}"),
             f"{ee(f'bare cold round floor{OUTSIDE}') / unary:.2f}x", ""),
        ]
    rows += [
        ("bare grpc.aio unary call, the no-ops' phase", calls_unary, "1.00x", ""),
        ("no-op unary (target Rollback), tracing off", m["plain noop (calls)"],
         f"{m['plain noop (calls)'] / calls_unary:.2f}x", "<= 1.3x"),
        ("no-op unary (target Rollback), tracing on", m["traced noop (calls)"],
         f"{m['traced noop (calls)'] / calls_unary:.2f}x", ""),
    ]
    child = m.get("bare unary, child server (calls)")
    if child:  # the deployed layout: the goal's comparison is with a bare server in a process of its own
        rows[-2] = (*rows[-2][:3], "")
        rows += [("bare grpc.aio unary call to a server in a process of its own (as each service is)", child,
                  f"{child / calls_unary:.2f}x", ""),
                 ("no-op unary (target Rollback), tracing off, ÷ that call", m["plain noop (calls)"],
                  f"{m['plain noop (calls)'] / child:.2f}x", "<= 1.3x")]
    for sampling in ("greedy", "T=0.7"):
        plain = fig.round_overhead("plain", sampling)
        traced = fig.round_overhead("traced", sampling)
        as_unary = fig.round_overhead("unary", sampling)
        streamed = fig.round_overhead("stream", sampling)
        rows.append((f"round overhead, {sampling}, k={fig.k}, two unary calls, tracing off", as_unary,
                     f"{as_unary / unary:.2f}x", ""))
        rows.append((f"round overhead, {sampling}, k={fig.k}, gRPC call streams, tracing off", streamed,
                     f"{streamed / unary:.2f}x ({streamed / as_unary:.2f}x the unary calls)", ""))
        above = f"; {(plain - lane_floor) * 1e3:.3f} ms over the lanes' floor" if lane_floor is not None else ""
        rows.append((f"round overhead, {sampling}, k={fig.k}, lanes, tracing off", plain,
                     f"{plain / unary:.2f}x ({plain / streamed:.2f}x the call streams{above})", "<= 1.0 ms"))
        rows.append((f"round overhead, {sampling}, k={fig.k}, lanes, tracing on", traced, f"{traced / unary:.2f}x",
                     "<= 1.0 ms"))
        rows.append((f"tracing cost per round, {sampling}", traced - plain, f"{(traced - plain) / unary:.2f}x", ""))
        if f"services {sampling} round{OUTSIDE}" in m:
            services = fig.round_overhead("services", sampling) - plain
            rows.append(("... of which the services' spans (the same round, the client neither spanning nor "
                         "carrying a trace context)", services, f"{services / unary:.2f}x", ""))
        if f"inproc {sampling} round{OUTSIDE}" in m:
            shared = fig.round_overhead("inproc", sampling)
            own_phase = m.get(MODELS_HERE_BARE, unary)  # the bare call of the round's own phase
            rows.append((f"round overhead, {sampling}, k={fig.k}, lanes, tracing off, both services in the measuring "
                         "process (one GIL with the client)", shared, f"{shared / own_phase:.2f}x", ""))
        if f"tls {sampling} round{OUTSIDE}" in m:
            secured = fig.round_overhead("tls", sampling)
            rows.append((f"round overhead, {sampling}, k={fig.k}, lanes, mutual TLS, tracing off", secured,
                         f"{secured / unary:.2f}x", ""))
            rows.append((f"TLS cost per round, {sampling}", secured - plain, f"{(secured - plain) / unary:.2f}x", ""))
    layout = ("both services in the measuring process" if fig.in_process
              else "each service in a process of its own, as deployed")
    lines = [f"Loopback, plaintext, tiny models, {layout}; {eventloop.loop_name()} event loops, "
             f"{grpc_io.describe()}; median of {reps}, calls interleaved.", "",
             "| figure | ms | / bare unary | goal |", "|---|---|---|---|"]
    lines += [f"| {name} | {ms(value)} | {ratio} | {goal} |" for name, value, ratio, goal in rows]
    if fig.note:
        lines += ["", fig.note]
    lines += ["", "Round overhead = round wall time − the compute the services reported for that round (their "
              "engine jobs, timed where they ran), median over rounds. Beside it, the round's median wall time, "
              "the same drafter and verifier calls run in-process, and the difference (ms):", "",
              "| sampling | tracing | round through the services | round overhead | compute in-process "
              "| round − in-process compute |", "|---|---|---|---|---|---|"]
    for sampling in ("greedy", "T=0.7"):
        for prefix in ("plain", "traced"):
            lines.append(f"| {sampling} | {'on' if prefix == 'traced' else 'off'} | "
                         f"{ms(m[f'{prefix} {sampling} round'])} | {ms(fig.round_overhead(prefix, sampling))} | "
                         f"{ms(m[f'{prefix} {sampling} compute'])} | "
                         f"{ms(fig.round_minus_local_compute(prefix, sampling))} |")
    if fig.cpu:
        lines += ["", *cpu_table(fig.cpu)]
    if LANE_CPU in m and LANE_CPU_COLD in m:
        lines += ["", f"A message's own price, before any code of ours: one bare frame each way on a lane connection "
                      f"costs the measuring thread {m[LANE_CPU] * 1e6:.0f} µs of CPU back to back and "
                      f"{m[LANE_CPU_COLD] * 1e6:.0f} µs after waiting as long as the draft's compute "
                      f"({m['cold floor draft gap'] * 1e3:.1f} ms; medians of {reps}). A round's process handles two "
                      "such messages."]
    return "\n".join(lines)


def cpu_table(cpu: dict[str, RoundCpu]) -> list[str]:
    """The CPU a round costs each process outside the models (round_cpu.py), µs."""
    some = next(iter(cpu.values()))
    names = list(some.outside)
    lines = [f"CPU time per round outside the models, by process (µs; lanes, {some.rounds} rounds back to back; "
             "each process's CPU, all threads, less the compute its services reported). A round's overhead is a "
             "chain, so their sum is close to it, without the machine's wake-ups; tracing's rows include its "
             "exporter's thread:", "",
             "| round | " + " | ".join(names) + (" | sum" if len(names) > 1 else "") + " | the services' compute |",
             "|---|" + "---|" * (len(names) + (2 if len(names) > 1 else 1))]
    for label, figures in cpu.items():
        cells = [f"{figures.outside[n]:.0f}" for n in names] + ([f"{figures.total_outside:.0f}"] if len(names) > 1 else [])
        lines.append(f"| {label} | " + " | ".join(cells) + f" | draft {figures.compute['draft']:.0f}, "
                     f"target {figures.compute['target']:.0f} |")
    return lines
