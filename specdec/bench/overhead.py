"""What a speculative round spends outside the models (`specd overhead`).

Loopback, plaintext, tiny random models. The services run each in a
process of its own, as deployed (specdec/bench/overhead_service.py), or
with `in_process` on a background event loop in this process; the client
(the orchestrator's own `DraftClient` / `TargetClient` on channels built as
the orchestrator builds them) runs on the main one. Each figure is a median
over `reps` repetitions, the calls of a phase interleaved, so a
machine that slows down during the run moves all of them alike:

- bare unary: a grpc.aio unary call of a 16-byte message to a generic
  handler that echoes it (no interceptors, no protobuf): the floor of a call.
  It is measured in both phases (below), and each figure is compared with
  the bare call of its own phase.
- bare stream message: one message each way on an already-open
  bidirectional stream: the floor of a message.
- the same references under grpcio's default I/O engine (EventEngine), in
  a child process just before the rounds: this process runs the iomgr that
  specdec/rpc/grpc_io.py chooses, and grpc fixes its engine once per process
  (specdec/bench/bare_grpc.py). Where this process runs EventEngine itself
  (SPECD_GRPC_IO=event-engine) its own references are those, and no child
  is started; a child that fails is reported under the table, not fatal.
- bare lane frame: one frame each way on an open lane connection, the
  transport the round's two calls take (bare_lane.py: TCP between two
  event loops, none of our code), to an echo in a process of its own as
  the services are (or in this process, `in_process`); and the lanes'
  floor as a round meets it, two such frames each after the wait of one
  service's compute: what the round would cost if our code cost nothing.
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
  orchestrator's five spans of a round, with their attributes: round,
  draft.propose and target.verify around the calls, the verify batcher's
  verify.batch inside target.verify, and accept) minus the round with
  tracing off; and, greedy, the services'
  part of it: the round on traced services from a client that neither spans
  nor carries a trace context, minus the untraced round.

Three phases, calls interleaved within each: the bare calls with the
no-ops, then the bare calls with the rounds (a no-op interleaved with
rounds, whose compute churns the caches and the scheduler, reads about
twice its cost alone), then the calls that run the models in this process
(the same compute in-process, the round with both services here). The
orchestrator never runs a model, and a round measured just after the models
ran in its process read 0.1-0.3 ms dearer. Our figures are printed as
ratios to the bare unary call of their phase (the third phase has one
too); "round − in-process compute" compares medians of the second and third
phases.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

from specdec import busy_poll
from specdec.rpc import grpc_io
from specdec.bench import bare_lane
from specdec.bench.bare_grpc import calls as bare_calls
from specdec.bench.bare_grpc import ChildServer, cold_floor
from specdec.bench.bare_grpc import start_server as start_bare_server
from specdec.bench.interleave import Call, ReportedCompute, interleave
from specdec.bench.overhead_stack import DEADLINE_S, BackgroundLoop, Stack, StackSpec, start_stacks
from specdec.bench.overhead_report import LANE_CPU, LANE_CPU_COLD, MODELS_HERE_BARE, Figures
from specdec.bench.round_cpu import RoundCpu, round_cpu, stack_processes


# ------------------------------------------------------------ the measurement



async def round_calls(stack: Stack, sampling: str, k: int, prefix: str,
                      computed: list | None = None) -> dict[str, Call]:
    """A round through the services, and the same compute in-process; each
    round's (draft, target) compute as the services reported it is appended
    to `computed`."""
    computed = [] if computed is None else computed
    from orchestrator.downstream import open_request
    from specdec.rpc.model_service import SessionMeta
    from specdec.sampling.params import SamplingParams
    from opentelemetry import context as otel_context
    from opentelemetry.trace import SpanKind

    from specdec.telemetry import (A_ACCEPTED, A_BATCH_ITEMS, A_BATCH_SESSIONS, A_EMITTED, A_FALLBACK, A_K,
                                   A_MIN_CONFIDENCE, A_PEER, A_PLAIN, A_RETURNED, A_ROUND, SPAN_ACCEPT,
                                   SPAN_DRAFT_PROPOSE, SPAN_ROUND, SPAN_TARGET_VERIFY, SPAN_VERIFY_BATCH)
    from specdec.sampling import q_wire
    from specdec.spans import NO_SPAN
    from specdec.sampling.rejection import VerifyOutcome, accept_greedy, accept_sampled
    from specdec.v1 import target_pb2
    from target_service.verifier import VerifyRequestItem

    rng = random.Random(0)
    vocab = stack.verifier.info.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(64)]
    temperature = 0.7 if sampling == "T=0.7" else 0.0
    request = open_request(prompt, temperature, 0, 1.0, 1, 0, "overhead")
    t_sid, _ = await stack.target_client.open(request, DEADLINE_S)
    d_sid, _ = await stack.draft_client.open(request, DEADLINE_S)
    n = len(prompt)
    # The same sessions on the stack's own engines (the services' when they run
    # in this process, copies from the same seeds otherwise): the same compute in-process.
    meta = SessionMeta(params=SamplingParams(temperature, 0, 1.0), seed=1)
    local_d_sid, local_t_sid = stack.drafter.open(prompt, meta, 0)[0], stack.verifier.open(prompt, meta, 0)[0]
    proposal = list(stack.drafter.propose(local_d_sid, n, [], k))  # the same drafts and q, every rep
    drafts = [d.token_id for d in proposal]
    # As the orchestrator: the draft packs its q's when the target reads them packed;
    # the in-process Verify reads them as the service does.
    packed_q = bool(temperature) and stack.target_client.info.reads_packed_q
    qs = [(q_wire.pack(d.q) if packed_q else d.q.to_lists()) for d in proposal if d.q is not None]
    core_item = VerifyRequestItem(local_t_sid, n, [], drafts, qs)
    # ("services": the services trace, the client neither spans nor carries a trace context)
    traced = stack.telemetry.tracing and prefix != "services"
    span = stack.telemetry.span if traced else (lambda *a, **kw: NO_SPAN)
    leaf_span = stack.telemetry.leaf_span if traced else (lambda *a, **kw: NO_SPAN)
    current = otel_context.get_current if traced else (lambda: None)

    def remote_round(draft_client, target_client):
        async def one_round():
            # The spans of the orchestrator's round (orchestrator/speculation.py and the
            # verify batcher's RPC span, orchestrator/batcher.py), with their attributes.
            with span(SPAN_ROUND, {A_ROUND: 1}) as round_span:
                with span(SPAN_DRAFT_PROPOSE, {A_PEER: "draft", A_K: k, A_MIN_CONFIDENCE: 0.0},
                          kind=SpanKind.CLIENT) as propose_span:
                    drafts, _ = await draft_client.propose(d_sid, n, [], k, DEADLINE_S, packed_q=packed_q)
                    propose_span.set_attribute(A_RETURNED, len(drafts))
                # The Verify item made of the drafts received, as the orchestrator makes it.
                item = target_pb2.VerifyItem(session_id=t_sid, keep_length=n,
                                             draft_token_ids=[d.token_id for d in drafts])
                if temperature:
                    item.draft_q.extend(d.q for d in drafts)
                with span(SPAN_TARGET_VERIFY, {A_K: len(drafts)}) as verify_span:
                    with span(SPAN_VERIFY_BATCH, {A_PEER: "target", A_BATCH_ITEMS: 1}, parent=current(),
                              kind=SpanKind.CLIENT) as batch_span:
                        reply, _ = await target_client.verify([item], DEADLINE_S)
                        batch_span.set_attribute(A_BATCH_SESSIONS, reply.batch_size)
                    verify_span.set_attributes({A_BATCH_ITEMS: 1, A_BATCH_SESSIONS: reply.batch_size})
                with leaf_span(SPAN_ACCEPT) as accept_span:  # the orchestrator's accept test, as it runs it
                    result = reply.results[0]
                    ids = [d.token_id for d in drafts]
                    if temperature:
                        outcome = VerifyOutcome(target_probs=list(result.target_probs),
                                                recovery_ids=list(result.recovery_token_ids),
                                                bonus_id=result.bonus_token_id)
                        accept_sampled(ids, [q_wire.prob_of(d.q, d.token_id) for d in drafts], outcome, 1, n)
                    else:
                        accept_greedy(ids, list(result.argmax_token_ids))
                    accept_span.set_attribute(A_ACCEPTED, k)
                round_span.set_attributes({A_K: k, A_RETURNED: len(drafts), A_ACCEPTED: k, A_EMITTED: k + 1,
                                           A_FALLBACK: False, A_PLAIN: False})
            draft_s = sum(d.compute_micros for d in drafts) / 1e6
            computed.append((draft_s, reply.compute_micros / 1e6))
            return ReportedCompute(draft_s + reply.compute_micros / 1e6)

        return one_round

    def local_round():
        list(stack.drafter.propose(local_d_sid, n, [], k))
        stack.verifier.verify([core_item])

    rounds = {f"{prefix} {sampling} round": remote_round(stack.draft_client, stack.target_client),
              f"{prefix} {sampling} compute": local_round}
    if prefix in ("tls", "inproc", "services"):
        del rounds[f"{prefix} {sampling} compute"]
    if prefix == "plain":
        rounds[f"unary {sampling} round"] = remote_round(stack.unary_draft_client, stack.unary_target_client)
        rounds[f"stream {sampling} round"] = remote_round(stack.stream_draft_client, stack.stream_target_client)
    return rounds


def runs_models_here(name: str, in_process: bool) -> bool:
    """Whether a call of `round_calls` runs the models in this process:
    the compute in-process, and the round of a stack whose services run
    here beside the deployed ones (`inproc`). With every stack in this
    process (`in_process`), its rounds all do, alike, and stay together."""
    return name.endswith(" compute") or (not in_process and name.startswith("inproc "))


async def noop_call(stack: Stack, prefix: str) -> dict[str, Call]:
    from orchestrator.downstream import open_request
    from specdec.rpc.grpc_tracing import trace_metadata
    from specdec.v1 import common_pb2

    t_sid, _ = await stack.target_client.open(open_request([5, 6, 7], 0.0, 0, 1.0, 1, 0, "noop"), DEADLINE_S)
    request = common_pb2.RollbackRequest(session_id=t_sid, length=3)

    def noop():
        return stack.target_client.stub.Rollback(request, timeout=DEADLINE_S, metadata=trace_metadata())

    return {f"{prefix} noop": noop}


async def _event_engine_references(reps: int, gaps: tuple[float, float]) -> dict[str, float]:
    """The bare references under grpcio's default I/O engine (EventEngine),
    measured in a child process just before the rounds: this process runs the
    engine specdec/rpc/grpc_io.py chose, which grpc fixes once per process.
    Raises RuntimeError, with the child's last words, if the child fails."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"} | {"SPECD_GRPC_IO": "event-engine"}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "specdec.bench.bare_grpc", "--reps", str(reps), "--gaps", *map(str, gaps),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(child.communicate(), timeout=DEADLINE_S + reps)
    if child.returncode != 0:
        last = err.decode(errors="replace").strip().splitlines()[-1:] or ["nothing on stderr"]
        raise RuntimeError(f"their child process exited with {child.returncode} ({last[0][:200]})")
    return json.loads(out)["medians"]


async def _close_server(server: asyncio.AbstractServer) -> None:
    server.close()
    await server.wait_closed()


async def measure(reps: int, k: int, tls: bool = False, in_process: bool = False, threads: int = 1,
                  busy_poll_us: dict[str, int] | None = None) -> Figures:
    """`tls`: also the rounds over mutual TLS (tracing off), as `tls <sampling> round`.
    The services run each in a process of their own, as deployed, and beside
    them the greedy round with both services in this process (`inproc`);
    `in_process`: every stack's services in this process (no `inproc` rounds).
    `busy_poll_us`: the service processes' --busy-poll-us, by role."""
    bg = BackgroundLoop()
    stacks: list[Stack] = []
    cpu: dict[str, RoundCpu | None] = {}
    bare_server = child = lane_server = None
    ee_note = ""
    # A traced service may still flush spans into it as it stops: they are throwaway.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as trace_dir:
        try:
            bare_server, bare_port = bg.run(start_bare_server())
            bare, close_bare = await bare_calls(bare_port)
            # The deployed layout's no-op crosses into another process: so does this bare call.
            child = None if in_process else ChildServer()
            child_bare, close_child = (await bare_calls(child.port)) if child else ({}, None)
            # The lanes' own floor, to an echo where the services are: a process of its own, or this one.
            if child is None:
                lane_server, lane_port = bg.run(bare_lane.start_echo())
            lane, close_lane = await bare_lane.calls(child.lane_port if child else lane_port)
            calls: dict[str, Call] = {}
            noops: dict[str, Call] = {}
            greedy_compute: list[tuple[float, float]] = []
            cpu_rounds = {}  # "greedy", "T=0.7, tracing on", ...: (the lanes' round, its computed list, its stack)
            # One stack per kind of round: each draft service then serves one
            # request, as in a single stream (a draft service serving several
            # shares its steps between them: draft_service/step_batcher.py).
            kinds = [(prefix, sampling) for prefix in ("plain", "traced") for sampling in ("greedy", "T=0.7", "noop")]
            kinds.append(("services", "greedy"))  # tracing's cost split: the services' spans alone
            if tls:
                from specdec.security.local_ca import LocalTls

                certificates = LocalTls.create(Path(trace_dir) / "tls")
                kinds += [("tls", "greedy"), ("tls", "T=0.7")]
            if not in_process:
                kinds.append(("inproc", "greedy"))
            specs = [StackSpec(tracing=prefix in ("traced", "services"), tls=certificates if prefix == "tls" else None,
                               in_process=in_process or prefix == "inproc") for prefix, _ in kinds]
            stacks += start_stacks(bg, specs, Path(trace_dir), threads, busy_poll_us)
            for (prefix, sampling), stack in zip(kinds, stacks):
                await stack.use_lanes()
                if sampling == "noop":
                    noops |= await noop_call(stack, prefix)
                    continue
                computed = greedy_compute if (prefix, sampling) == ("plain", "greedy") else []
                calls |= await round_calls(stack, sampling, k, prefix, computed)
                if prefix in ("plain", "traced"):
                    label = sampling + (", tracing on" if prefix == "traced" else "")
                    cpu_rounds[label] = (calls[f"{prefix} {sampling} round"], computed, stack)
            # Two phases, each with the bare calls interleaved: the no-ops
            # against the bare calls alone (interleaved with rounds, whose
            # compute churns the caches and the scheduler, a no-op measured
            # 1.1-1.3 ms before and after the changes of issue 15 alike), then
            # the rounds.
            no_op_phase = bare | noops | ({"bare unary, child server": child_bare["bare unary"]} if child else {})
            medians = {f"{name} (calls)": t for name, t in (await interleave(no_op_phase, reps)).items()}
            for _ in range(10):  # what a greedy round's two services compute, for the cold floor's waits
                await calls["plain greedy round"]()
            gaps = (statistics.median(d for d, _ in greedy_compute), statistics.median(t for _, t in greedy_compute))
            medians["cold floor draft gap"], medians["cold floor target gap"] = gaps
            bare["bare cold round floor"] = cold_floor(bare["bare stream message"], gaps)
            # The lanes' references join the rounds' phase only: the no-ops' phase compares gRPC calls.
            bare |= lane
            bare["bare lane cold round floor"] = cold_floor(bare["bare lane frame"], gaps)
            # Under EventEngine already (SPECD_GRPC_IO=event-engine), this process's own
            # references are those; a child forked from it then is not needed (on the H200
            # host one such child died of SIGSEGV before it ran, 2026-11-27).
            if not grpc_io.runs_event_engine():
                try:
                    ee = await _event_engine_references(reps, gaps)
                except (RuntimeError, asyncio.TimeoutError) as exc:
                    ee_note = f"The EventEngine references were not measured: {exc or 'their child timed out'}."
                    ee = {}
                medians |= {f"{name} (event engine)": t for name, t in ee.items()}
            # The rounds with the bare calls, then apart from them every call
            # that runs the models in this process (the same compute
            # in-process, the round with both services here): the
            # orchestrator never runs a model, and a round measured just after
            # one read 0.1-0.3 ms dearer (its caches churned), which fell on
            # the traced rounds every time and on the plain ones every other
            # time, the order of the calls being what it was.
            in_client = {name: call for name, call in calls.items() if runs_models_here(name, in_process)}
            medians |= await interleave(bare | {n: c for n, c in calls.items() if n not in in_client}, reps)
            # (with the bare call again, for the ratio of the round with both services here)
            # (no polling here meanwhile: a polling loop holds the GIL and a CPU from the models'
            # threads here; on the H200 host the in-process compute read 1.4-1.7x the services')
            with busy_poll.paused():
                medians |= await interleave(in_client | {MODELS_HERE_BARE: bare["bare unary"]}, reps)
            for label, (one_round, computed, stack) in cpu_rounds.items():
                cpu[label] = await round_cpu(one_round, computed, *stack_processes(stack), rounds=2 * reps)
            # What a message costs this process by itself, before any code of ours: back to
            # back, and after the idle a round's first message follows (the draft's compute).
            for name, idle in ((LANE_CPU, 0.0), (LANE_CPU_COLD, gaps[0])):
                spent = await bare_lane.cpu_per_frame(bare["bare lane frame"], idle, reps)
                if spent is not None:
                    medians[name] = spent
            await close_bare()
            await close_lane()
            if close_child:
                await close_child()
            for stack in stacks:
                await stack.close_clients()
        finally:
            try:
                if child is not None:
                    child.stop()
                for stack in stacks:
                    bg.run(stack.target.stop(0))
                    bg.run(stack.draft.stop(0))
                if bare_server is not None:
                    bg.run(bare_server.stop(0))
                if lane_server is not None:
                    bg.run(_close_server(lane_server))
            finally:
                bg.stop()
    return Figures(medians, k, in_process, None if None in cpu.values() else cpu, ee_note)
