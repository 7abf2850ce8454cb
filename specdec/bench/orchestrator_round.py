"""The orchestrator's own round, as a client's request meets it (`specd overhead`, deployed).

`specd overhead`'s round (overhead.py) is the orchestrator's two calls of a
round through its own clients, and its accept test, made as the loop makes
them: the transport and the services, not the loop. A round of the
orchestrator itself also runs the loop around those calls (the verify
batcher, the policy, the statistics, the spans) and hands its tokens to the
client's Generate stream. On the tiny pair that loop doubled the round's
overhead (3.8 ms a greedy round against 2.2 on this VM, 2026-11-27), so this
measures it too, as clients call it:

- an orchestrator in a process of its own (`specd serve orchestrator`, as
  deployed) on a stack's two services (`overhead_stack.ChildService`), tracing
  off; with `tracing`, a second one on traced services, tracing as `specd up`
  does (into a JSON-lines file);
- Generate requests of token ids (64 random ids, 256 new tokens, fixed k,
  no stop on the draft's confidence, the speculation gate and pipelining off:
  every round drafts k), greedy and T = 0.7, the kinds interleaved; the
  draft is the target's copy (the same seed), so a greedy round keeps all
  its drafts and emits k + 1 tokens, as a round of a well-matched pair does
  (at T = 0.7 nearly all: the draft sends q as its top 32 tokens,
  renormalized, which the target's p does not quite match);
- per request, from its GenerateStats: its time outside the models (the
  session opens and the services' reported compute), divided by its rounds
  (the request's setup, amortized over its ~50 rounds, is in it too); as the
  orchestrator times the request (the goal's figure: the server's round),
  and as the client does (the last replies' writes and reads in it too);
- per round, the orchestrator process's CPU (all its threads) over the
  requests of a kind.

The figure reported is the median over requests.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec import hops
from specdec.bench.overhead_stack import DEADLINE_S, START_S, ChildService
from specdec.bench.round_cpu import process_cpu_ns
from specdec.processes import log_tail, read_port, role_env, spawn_role, stop_processes, wait_serving

PROMPT_TOKENS = 64
NEW_TOKENS = 256
SAMPLINGS = {"greedy": 0.0, "T=0.7": 0.7}


@dataclass(frozen=True)
class OrchestratorRound:
    sampling: str  # "greedy" or "T=0.7"
    tracing: bool
    requests: int
    overhead_s: float  # median over requests of the request's time outside the models, per round, as the orchestrator times it
    seen_s: float  # the same with the request's time as the client saw it (the last replies' writes and reads in it)
    tokens_per_round: float
    cpu_s: float | None  # the orchestrator process's CPU a round (None where the kernel does not say)
    new_tokens: int = NEW_TOKENS


@dataclass
class _Kind:
    sampling: str
    tracing: bool
    orchestrator: object  # processes.Service
    per_round: list[float] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)
    rounds: int = 0
    tokens: int = 0
    cpu_ns: int | None = 0


async def measure(requests: int, k: int, threads: int, log_dir: Path, tracing: bool = True,
                  new_tokens: int = NEW_TOKENS, hops_dir: Path | None = None,
                  busy_poll_us: dict[str, int] | None = None) -> list[OrchestratorRound]:
    """`requests` Generate requests of each kind (greedy and T = 0.7, tracing
    off and, with `tracing`, on), interleaved, through orchestrators in
    processes of their own; see the module docstring. With `hops_dir`, every
    process of the stack records its hops there (specdec/hops.py).
    `busy_poll_us`: each role's --busy-poll-us (default 0: off)."""
    polls = busy_poll_us or {}
    hops_env = {hops.ENV: str(hops_dir)} if hops_dir is not None else {}
    service_env = role_env(extra=hops_env) if hops_env else None  # None: this process's own
    stacks = []  # (traced, its trace file, target, draft), every service started before any is waited for
    services: list[ChildService] = []
    orchestrators = []
    kinds: list[_Kind] = []
    try:
        for traced in (False, True) if tracing else (False,):
            trace_file = str(log_dir / "orchestrator-round-spans.jsonl") if traced else ""
            target = ChildService("target", 0, threads, log_dir, trace_file, env=service_env, busy_poll_us=polls)
            draft = ChildService("draft", 0, threads, log_dir, trace_file, env=service_env,  # the target's copy
                                 busy_poll_us=polls)
            services += [target, draft]
            stacks.append((traced, trace_file, target, draft))
        for traced, trace_file, target, draft in stacks:
            ports = await asyncio.to_thread(lambda: (target.port, draft.port))
            env = role_env(extra={"SPECD_TRACING": "on" if traced else "off", "SPECD_TRACE_FILE": trace_file,
                                  **hops_env})
            orchestrator = spawn_role(
                "orchestrator", ["--target", f"127.0.0.1:{ports[0]}", "--draft", f"127.0.0.1:{ports[1]}",
                                 "--policy", "fixed", "--num-draft-tokens", str(k), "--draft-min-confidence", "0",
                                 "--no-speculation-gate", "--no-pipeline",
                                 "--busy-poll-us", str(polls.get("orchestrator", 0))],
                log_dir, env, name=f"orchestrator-{'traced' if traced else 'plain'}")
            orchestrators.append(orchestrator)
            kinds += [_Kind(sampling, traced, orchestrator) for sampling in SAMPLINGS]
        for orchestrator in orchestrators:
            await asyncio.to_thread(_serving, orchestrator, [o.proc for o in orchestrators]
                                    + [s.process for s in services])
        await _run(kinds, requests, new_tokens)
    finally:
        stop_processes([o.proc for o in orchestrators], grace_s=10.0)
        for service in services:
            await service.stop()
    return [OrchestratorRound(kind.sampling, kind.tracing, len(kind.per_round), statistics.median(kind.per_round),
                              statistics.median(kind.seen), kind.tokens / max(1, kind.rounds),
                              kind.cpu_ns / 1e9 / kind.rounds if kind.cpu_ns is not None and kind.rounds else None,
                              new_tokens)
            for kind in kinds]


def _serving(orchestrator, watched) -> None:
    """Wait until `orchestrator` serves (SERVING once it has connected to its
    services); on failure, say why with its log's last lines (the log
    directory is temporary)."""
    try:
        orchestrator.port = read_port(orchestrator, START_S)
        wait_serving(orchestrator.port, watched, START_S)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}; the orchestrator's log ends with:\n{log_tail(orchestrator.log_path)}") from None


async def _run(kinds: list[_Kind], requests: int, new_tokens: int) -> None:
    import grpc

    from orchestrator.client import build_request
    from specdec.v1 import orchestrator_pb2_grpc

    # One channel per orchestrator (greedy and T = 0.7 share one), keyed by its port.
    channels = {kind.orchestrator.port: grpc.aio.insecure_channel(f"127.0.0.1:{kind.orchestrator.port}")
                for kind in kinds}
    try:
        stubs = {port: orchestrator_pb2_grpc.OrchestratorServiceStub(channel) for port, channel in channels.items()}
        rng = random.Random(0)
        order = list(kinds)
        for rep in range(requests + 1):  # the first rep warms each kind up, uncounted
            rng.shuffle(order)
            for kind in order:
                prompt = [rng.randrange(3, 128) for _ in range(PROMPT_TOKENS)]
                request = build_request(prompt, max_tokens=new_tokens, temperature=SAMPLINGS[kind.sampling],
                                        seed=rep + 1)
                pid = kind.orchestrator.pid
                before, start = process_cpu_ns(pid), time.perf_counter()
                stats = await _generate(stubs[kind.orchestrator.port], request)
                seen, after = time.perf_counter() - start, process_cpu_ns(pid)
                if rep == 0:
                    continue
                models = stats.prefill_time_s + stats.draft_compute_time_s + stats.target_compute_time_s
                kind.per_round.append((stats.duration_s - models) / stats.rounds)
                kind.seen.append((seen - models) / stats.rounds)
                kind.rounds += stats.rounds
                kind.tokens += stats.completion_tokens
                kind.cpu_ns = None if None in (before, after, kind.cpu_ns) else kind.cpu_ns + after - before
    finally:
        for channel in channels.values():
            await channel.close()


async def _generate(stub, request):
    """One Generate to its end; its statistics."""
    stats = None
    async for reply in stub.Generate(request, timeout=DEADLINE_S):
        if reply.HasField("stats"):
            stats = reply.stats
    if stats is None:
        raise RuntimeError("a Generate ended without its statistics")
    return stats


def report_lines(rounds: list[OrchestratorRound]) -> list[str]:
    """The table `specd overhead` prints under its own."""
    if not rounds:
        return []
    first = rounds[0]
    lines = ["The orchestrator's own round, as a client's request meets it (an orchestrator in a process of its "
             f"own on the two services, Generate of {PROMPT_TOKENS} token ids, {first.new_tokens} new tokens, fixed "
             "k, every round drafting k, the draft the target's copy): per request, its time outside the models "
             "and the session opens, over its rounds, timed by the orchestrator (and by the client, the last "
             f"replies' writes and reads included); median of {first.requests} requests of each kind, interleaved "
             "(ms; the orchestrator process's CPU a round, µs):", "",
             "| round | tracing | overhead a round (ms) | goal | seen by the client (ms) | tokens a round "
             "| the orchestrator's CPU a round (µs) |",
             "|---|---|---|---|---|---|---|"]
    for r in rounds:
        cpu = f"{r.cpu_s * 1e6:.0f}" if r.cpu_s is not None else "-"
        lines.append(f"| {r.sampling} | {'on' if r.tracing else 'off'} | {r.overhead_s * 1e3:.3f} | <= 1.0 ms | "
                     f"{r.seen_s * 1e3:.3f} | {r.tokens_per_round:.2f} | {cpu} |")
    return lines
