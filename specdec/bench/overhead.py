"""What a speculative round spends outside the models (`specd overhead`).

Everything runs in one process on loopback, plaintext, over tiny random
models, with the services on a background event loop and the client (the
orchestrator's own `DraftClient` / `TargetClient` on channels built as the
orchestrator builds them) on the main one. Each figure is a median over
`reps` repetitions, every kind of call interleaved with the others, so a
machine that slows down during the run moves all of them alike:

- bare unary: a grpc.aio unary call of a 16-byte message to a generic
  handler that echoes it (no interceptors, no protobuf): the floor of a call.
  It is measured in both phases (below), and each figure is compared with
  the bare call of its own phase.
- bare stream message: one message each way on an already-open
  bidirectional stream: the floor of a message.
- no-op unary: our target service's Rollback to the length the session
  already has (answered on the event loop when the engine is idle), on
  services that serve nothing else, as the bare echo server does.
- round overhead: Verify (k drafts) + Propose (k) through the services,
  minus the compute the services reported for that very round (their engine
  jobs, timed where they ran), median over rounds; greedy and T=0.7. The
  calls go as the orchestrator sends them, as messages on the services'
  long-lived call streams (specdec/rpc/call_stream.py); the same round as
  two unary calls (`--no-call-streams`) is measured beside it. Beside
  it, the round minus the same `Verifier.verify` and drafter calls run
  in-process (which also counts what the compute loses to running inside a
  server).
- tracing: the same round with tracing on as `specd up` runs it (a batch span
  processor into a JSON-lines file, trace context on every call, the
  orchestrator's client spans round / draft.propose / target.verify around
  the calls) minus the round with tracing off.

Two phases, calls interleaved within each: the bare calls with the no-ops,
then the bare calls with the rounds (a no-op interleaved with rounds, whose
compute churns the caches and the scheduler, reads about twice its cost
alone). Our figures are printed as ratios to the bare ones of their phase.
"""
from __future__ import annotations

import asyncio
import inspect
import random
import statistics
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from specdec import eventloop
from specdec.bench.overhead_stack import (BARE_SERVICE, DEADLINE_S, BackgroundLoop, Stack, start_bare_server,
                                          start_stack)


# ------------------------------------------------------------ the measurement


Call = Callable[[], Awaitable[object] | object]


class ReportedCompute(float):
    """What a call returns to say how many of its seconds the services
    reported as their own compute: `interleave` then also records, rep by
    rep, the call's wall time minus it (`<name> outside compute`)."""


OUTSIDE = " outside compute"


async def _timed(call: Call) -> tuple[float, object]:
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
            seconds, result = await _timed(calls[name])
            if rep < warmup:
                continue
            times[name].append(seconds)
            if isinstance(result, ReportedCompute):
                times.setdefault(name + OUTSIDE, []).append(seconds - result)
    return {name: statistics.median(t) for name, t in times.items()}


async def round_calls(stack: Stack, sampling: str, k: int, prefix: str,
                      computed: list | None = None) -> dict[str, Call]:
    """A round through the services, and the same compute in-process; each
    round's (draft, target) compute as the services reported it is appended
    to `computed`."""
    computed = [] if computed is None else computed
    from orchestrator.downstream import open_request
    from specdec.telemetry import SPAN_DRAFT_PROPOSE, SPAN_ROUND, SPAN_TARGET_VERIFY
    from specdec.v1 import common_pb2, target_pb2
    from target_service.verifier import VerifyRequestItem

    rng = random.Random(0)
    vocab = stack.verifier.info.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(64)]
    temperature = 0.7 if sampling == "T=0.7" else 0.0
    request = open_request(prompt, temperature, 0, 1.0, 1, 0, "overhead")
    t_sid, _ = await stack.target_client.open(request, DEADLINE_S)
    d_sid, _ = await stack.draft_client.open(request, DEADLINE_S)
    n = len(prompt)
    proposal = list(stack.drafter.propose(d_sid, n, [], k))  # realistic drafts and q, reused every rep
    drafts = [d.token_id for d in proposal]
    qs = [d.q.to_lists() for d in proposal if d.q is not None]
    item = target_pb2.VerifyItem(session_id=t_sid, keep_length=n, draft_token_ids=drafts,
                                 draft_q=[common_pb2.SparseDistribution(token_ids=i, probs=p) for i, p in qs])
    core_item = VerifyRequestItem(t_sid, n, [], drafts, qs)
    span = stack.telemetry.span if stack.telemetry.tracing else (lambda *a, **kw: nullcontext())

    def remote_round(draft_client, target_client):
        async def one_round():
            with span(SPAN_ROUND):
                with span(SPAN_DRAFT_PROPOSE):
                    drafts, _ = await draft_client.propose(d_sid, n, [], k, DEADLINE_S)
                with span(SPAN_TARGET_VERIFY):
                    reply, _ = await target_client.verify([item], DEADLINE_S)
            draft_s = sum(d.compute_micros for d in drafts) / 1e6
            computed.append((draft_s, reply.compute_micros / 1e6))
            return ReportedCompute(draft_s + reply.compute_micros / 1e6)

        return one_round

    def local_round():
        list(stack.drafter.propose(d_sid, n, [], k))
        stack.verifier.verify([core_item])

    rounds = {f"{prefix} {sampling} round": remote_round(stack.draft_client, stack.target_client),
              f"{prefix} {sampling} compute": local_round}
    if prefix == "tls":
        del rounds[f"{prefix} {sampling} compute"]
    if prefix == "plain":
        rounds[f"unary {sampling} round"] = remote_round(stack.unary_draft_client, stack.unary_target_client)
    return rounds


async def noop_call(stack: Stack, prefix: str) -> dict[str, Call]:
    from orchestrator.downstream import open_request
    from specdec.rpc.grpc_tracing import trace_metadata
    from specdec.v1 import common_pb2

    t_sid, _ = await stack.target_client.open(open_request([5, 6, 7], 0.0, 0, 1.0, 1, 0, "noop"), DEADLINE_S)
    request = common_pb2.RollbackRequest(session_id=t_sid, length=3)

    def noop():
        return stack.target_client.stub.Rollback(request, timeout=DEADLINE_S, metadata=trace_metadata())

    return {f"{prefix} noop": noop}


async def bare_calls(port: int) -> tuple[dict[str, Call], Callable[[], Awaitable[None]]]:
    import grpc

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    unary = channel.unary_unary(f"/{BARE_SERVICE}/Echo")
    stream = channel.stream_stream(f"/{BARE_SERVICE}/EchoStream")()
    payload = b"0123456789abcdef"

    async def one_message():
        await stream.write(payload)
        await stream.read()

    async def close():
        await stream.done_writing()
        await channel.close()

    return {"bare unary": lambda: unary(payload, timeout=DEADLINE_S), "bare stream message": one_message}, close


def cold_floor(one_message: Call, gaps: tuple[float, float]) -> Call:
    """A round's floor as a round meets it: two bare stream messages, each
    after the caller has waited as long as one service's compute (the
    draft's, then the target's). The wait is reported as compute, so its
    "outside compute" figure is the two messages alone, sent to threads that
    have gone idle: on this VM a message after 5 ms of idle costs about
    twice one sent back to back (`specd overhead` prints both)."""

    async def call():
        slept = 0.0
        for gap in gaps:
            start = time.perf_counter()
            await asyncio.sleep(gap)
            slept += time.perf_counter() - start
            await one_message()
        return ReportedCompute(slept)

    return call


@dataclass
class Figures:
    medians: dict[str, float]
    k: int

    def round_overhead(self, prefix: str, sampling: str) -> float:
        """Median over rounds of (round wall time − the compute the services
        reported for it): the overhead of the issue's definition."""
        return self.medians[f"{prefix} {sampling} round{OUTSIDE}"]

    def round_minus_local_compute(self, prefix: str, sampling: str) -> float:
        """Median round wall time − median of the same compute in-process:
        also counts what the services' compute loses to running in a
        server (thread contention, caches)."""
        return self.medians[f"{prefix} {sampling} round"] - self.medians[f"{prefix} {sampling} compute"]


async def measure(reps: int, k: int, tls: bool = False) -> Figures:
    """`tls`: also the rounds over mutual TLS (tracing off), as `tls <sampling> round`."""
    bg = BackgroundLoop()
    stacks: list[Stack] = []
    with tempfile.TemporaryDirectory() as trace_dir:
        try:
            bare_server, bare_port = bg.run(start_bare_server())
            bare, close_bare = await bare_calls(bare_port)
            calls: dict[str, Call] = {}
            noops: dict[str, Call] = {}
            greedy_compute: list[tuple[float, float]] = []
            for tracing in (False, True):
                prefix = "traced" if tracing else "plain"
                # One stack per kind of round: each draft service then serves
                # one request, as in a single stream (a draft service serving
                # several shares its steps between them: draft_service/step_batcher.py).
                for sampling in ("greedy", "T=0.7"):
                    stack = start_stack(bg, tracing, Path(trace_dir))
                    stacks.append(stack)
                    computed = greedy_compute if (prefix, sampling) == ("plain", "greedy") else None
                    calls |= await round_calls(stack, sampling, k, prefix, computed)
                stacks.append(start_stack(bg, tracing, Path(trace_dir)))
                noops |= await noop_call(stacks[-1], prefix)
            if tls:
                from specdec.security.local_ca import LocalTls

                certificates = LocalTls.create(Path(trace_dir) / "tls")
                for sampling in ("greedy", "T=0.7"):
                    stacks.append(start_stack(bg, False, Path(trace_dir), tls=certificates))
                    calls |= await round_calls(stacks[-1], sampling, k, "tls")
            # Two phases, each with the bare calls interleaved: the no-ops
            # against the bare calls alone (interleaved with rounds, whose
            # compute churns the caches and the scheduler, a no-op measured
            # 1.1-1.3 ms before and after the changes of issue 15 alike), then
            # the rounds.
            medians = {f"{name} (calls)": t for name, t in (await interleave(bare | noops, reps)).items()}
            for _ in range(10):  # what a greedy round's two services compute, for the cold floor's waits
                await calls["plain greedy round"]()
            gaps = (statistics.median(d for d, _ in greedy_compute), statistics.median(t for _, t in greedy_compute))
            medians["cold floor draft gap"], medians["cold floor target gap"] = gaps
            bare["bare cold round floor"] = cold_floor(bare["bare stream message"], gaps)
            medians |= await interleave(bare | calls, reps)
            await close_bare()
            for stack in stacks:
                await stack.close_clients()
        finally:
            for stack in stacks:
                bg.run(stack.target.stop(0))
                bg.run(stack.draft.stop(0))
            bg.run(bare_server.stop(0))
            bg.stop()
    return Figures(medians, k)


def report(fig: Figures, reps: int) -> str:
    m = fig.medians
    unary, message = m["bare unary"], m["bare stream message"]
    cold = m[f"bare cold round floor{OUTSIDE}"]

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.3f}"

    calls_unary = m["bare unary (calls)"]  # the no-ops' phase: bare calls interleaved with the no-ops alone
    rows = [
        ("bare grpc.aio unary call", unary, "1.00x", ""),
        ("bare message each way on an open stream", message, f"{message / unary:.2f}x", ""),
        ("a round's floor on call streams: two bare messages each way", 2 * message,
         f"{2 * message / unary:.2f}x", ""),
        (f"the same floor as a round meets it: each message after waiting as long as one service's compute "
         f"(greedy: {m['cold floor draft gap'] * 1e3:.1f} and {m['cold floor target gap'] * 1e3:.1f} ms)", cold,
         f"{cold / unary:.2f}x", ""),
        ("bare grpc.aio unary call, the no-ops' phase", calls_unary, "1.00x", ""),
        ("no-op unary (target Rollback), tracing off", m["plain noop (calls)"],
         f"{m['plain noop (calls)'] / calls_unary:.2f}x", "<= 1.3x"),
        ("no-op unary (target Rollback), tracing on", m["traced noop (calls)"],
         f"{m['traced noop (calls)'] / calls_unary:.2f}x", ""),
    ]
    for sampling in ("greedy", "T=0.7"):
        plain = fig.round_overhead("plain", sampling)
        traced = fig.round_overhead("traced", sampling)
        as_unary = fig.round_overhead("unary", sampling)
        rows.append((f"round overhead, {sampling}, k={fig.k}, two unary calls, tracing off", as_unary,
                     f"{as_unary / unary:.2f}x", ""))
        rows.append((f"round overhead, {sampling}, k={fig.k}, tracing off", plain,
                     f"{plain / unary:.2f}x ({plain / as_unary:.2f}x the unary calls)", "<= 1.0 ms"))
        rows.append((f"round overhead, {sampling}, k={fig.k}, tracing on", traced, f"{traced / unary:.2f}x",
                     "<= 1.0 ms"))
        rows.append((f"tracing cost per round, {sampling}", traced - plain, f"{(traced - plain) / unary:.2f}x", ""))
        if f"tls {sampling} round{OUTSIDE}" in m:
            secured = fig.round_overhead("tls", sampling)
            rows.append((f"round overhead, {sampling}, k={fig.k}, mutual TLS, tracing off", secured,
                         f"{secured / unary:.2f}x", ""))
            rows.append((f"TLS cost per round, {sampling}", secured - plain, f"{(secured - plain) / unary:.2f}x", ""))
    lines = [f"Loopback, plaintext, tiny models, {eventloop.loop_name()} event loops; median of {reps}, "
             "calls interleaved.", "",
             "| figure | ms | / bare unary | goal |", "|---|---|---|---|"]
    lines += [f"| {name} | {ms(value)} | {ratio} | {goal} |" for name, value, ratio, goal in rows]
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
    return "\n".join(lines)
