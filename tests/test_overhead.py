"""ProposeAll: the same drafts as a Propose stream, in one message."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from orchestrator.downstream import open_request
from specdec import eventloop
from specdec.bench.overhead import interleave, measure
from specdec.bench.overhead_report import report
from specdec.bench.overhead_stack import BackgroundLoop, start_stack
from specdec.v1 import draft_pb2

T = 30.0


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_propose_all_equals_the_stream_and_measures_itself(tmp_path: Path, temperature: float):
    async def run():
        bg = BackgroundLoop()
        stack = start_stack(bg, tracing=False, trace_dir=tmp_path)
        try:
            request = open_request(list(range(5, 40)), temperature, 0, 1.0, 7, 0, "t")
            sid, _ = await stack.draft_client.open(request, T)
            propose = draft_pb2.ProposeRequest(session_id=sid, keep_length=35, num_draft_tokens=4)
            streamed = [d async for d in stack.draft_client.stub.Propose(propose, timeout=T)]
            reply = await stack.draft_client.stub.ProposeAll(draft_pb2.ProposeAllRequest(propose=propose), timeout=T)
            assert [d.token_id for d in reply.drafts] == [d.token_id for d in streamed]
            assert [d.q for d in reply.drafts] == [d.q for d in streamed]
            assert [d.index for d in reply.drafts] == [0, 1, 2, 3]
            assert reply.drafts[-1].length == 39
            # The orchestrator's client takes ProposeAll when nothing wants the first token early.
            drafts, cost = await stack.draft_client.propose(sid, 35, [], 4, T)
            assert [d.token_id for d in drafts] == [d.token_id for d in streamed] and cost.wire_bytes > 0
            # Two concurrent ProposeAlls on two sessions both complete whole.
            sid2, _ = await stack.draft_client.open(request, T)
            both = await asyncio.gather(stack.draft_client.propose(sid, 35, [], 4, T),
                                        stack.draft_client.propose(sid2, 35, [], 3, T))
            assert [len(d) for d, _ in both] == [4, 3]
            assert [d.token_id for d in both[0][0]] == [d.token_id for d in streamed]
            assert [d.token_id for d in both[1][0]] == [d.token_id for d in streamed][:3]
            medians = await interleave({"noop": lambda: None}, reps=3, warmup=1)
            assert set(medians) == {"noop"}
        finally:
            await stack.close_clients()
            bg.run(stack.draft.stop(0))
            bg.run(stack.target.stop(0))
            bg.stop()

    asyncio.run(run())


def test_specd_overhead_prints_our_figures_against_bare_grpc(capsys):
    from specdec.cli.main import main

    assert main(["--log-level", "WARNING", "overhead", "--reps", "2", "--in-process"]) == 0
    out = capsys.readouterr().out
    assert "both services in the measuring process;" in out and "grpc iomgr" in out
    assert "| the same bare unary call under grpcio's default I/O (EventEngine" in out
    assert "| bare frame each way on an open lane connection (the lanes' TCP between two event loops, none of our " \
           "code; to this process) |" in out
    floor = next(line for line in out.splitlines() if line.startswith("| the lanes' floor as a round meets it"))
    assert float(floor.split(" | ")[1]) > 0
    assert "ms over the lanes' floor)" in out
    for figure in ("bare grpc.aio unary call", "no-op unary (target Rollback), tracing off",
                   "round overhead, greedy, k=4, lanes, tracing on", "round overhead, T=0.7, k=4, gRPC call streams, "
                   "tracing off", "tracing cost per round, T=0.7"):
        assert f"| {figure} |" in out
    assert "| ... of which the services' spans (the same round, the client neither spanning" in out


def test_specd_overhead_wire_prints_bytes_per_token_and_verify_throughput(capsys):
    from specdec.cli.main import main

    assert main(["--log-level", "WARNING", "overhead", "--wire", "--reps", "5", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    greedy, sampled = rows["greedy"].split(" | "), rows["T=0.7, q as lists"].split(" | ")
    packed = rows["T=0.7, q packed"].split(" | ")
    assert int(greedy[1]) == 0 and int(sampled[1]) == int(packed[1]) > 0  # q entries: none under greedy
    assert int(sampled[6]) > int(greedy[6]) > 0 and int(packed[6]) > int(greedy[6])  # the round's bytes: q costs bytes
    assert "**" in greedy[-1] and "Verify throughput through the server" in out
    assert [line.split(" | ")[1] for line in out.splitlines() if line.startswith("| tiny (fp32)")] == ["1", "4", "16"]
    # what the q's cost each role, in both encodings, for 1 and 8 sessions
    costs = [line.strip("| ").split(" | ") for line in out.splitlines() if line.startswith(("| lists |", "| packed |"))]
    assert [(c[0], c[1]) for c in costs] == [("lists", "1"), ("lists", "8"), ("packed", "1"), ("packed", "8")]
    assert all(float(x) > 0 for c in costs for x in c[2:])


def test_specd_overhead_measures_every_figure_it_prints():
    """A tiny run of the whole measurement (2 reps, both services in the
    measuring process, to keep it short): every row it prints, the round on
    lanes beside the call-stream and unary ones and the mutual-TLS round, has a
    positive wall time behind it."""
    figures = eventloop.run(measure(reps=2, k=2, tls=True, in_process=True))
    m = figures.medians
    for sampling in ("greedy", "T=0.7"):
        for prefix in ("plain", "traced", "unary", "stream", "tls"):
            assert m[f"{prefix} {sampling} round"] > 0
            assert f"{prefix} {sampling} round outside compute" in m
    assert figures.in_process and "inproc greedy round" not in m
    # tracing's split: the services' spans alone, from a client that neither spans nor carries a context
    assert m["services greedy round"] > 0 and "services greedy round outside compute" in m
    assert set(figures.cpu) == {"greedy", "T=0.7", "greedy, tracing on", "T=0.7, tracing on"}  # Linux: the kernel's
    for cpu in figures.cpu.values():
        assert cpu.rounds == 4 and list(cpu.outside) == ["client and services"] and cpu.compute["target"] > 0
    text = report(figures, reps=2)
    assert "CPU time per round outside the models, by process" in text
    assert m["bare cold round floor outside compute"] > 0 and m["cold floor draft gap"] > 0
    assert m["bare lane frame"] > 0 and m["bare lane cold round floor outside compute"] > 0
    assert m["bare lane frame, client CPU"] >= 0 and m["bare lane frame, client CPU after the draft's compute"] >= 0
    assert "A message's own price, before any code of ours: one bare frame each way" in text
    for row in ("two unary calls", "the unary calls)", "gRPC call streams", "the call streams;",
                "ms over the lanes' floor)", "lanes, mutual TLS", "TLS cost per round", "bare message each way",
                "bare frame each way on an open lane connection", "as a round meets it",
                "both services in the measuring process;"):
        assert row in text, row


async def _stop(stack, bg) -> None:
    """A stack's clients closed and its service processes stopped, then its loop."""
    await stack.close_clients()
    for service in (stack.target, stack.draft):
        await service.stop(0)
    bg.stop()


def test_services_in_processes_of_their_own_serve_traced_rounds_and_stop(tmp_path: Path):
    """The deployed layout `specd overhead` measures by default: each service
    in its own process (specdec/bench/overhead_service.py) serves the
    orchestrator's clients, reports its compute, traces into the trace
    file, and exits when the stack stops."""
    from specdec.bench.overhead import round_calls
    from specdec.bench.overhead_stack import StackSpec, start_stacks
    from specdec.bench.round_cpu import round_cpu, stack_processes
    from specdec.trace_file import read_spans

    async def run():
        bg = BackgroundLoop()
        stack = start_stacks(bg, [StackSpec(tracing=True)], tmp_path)[0]
        try:
            await stack.use_lanes()  # the round's calls on the services' lanes, as the orchestrator sends them
            computed = []
            rounds = await round_calls(stack, "T=0.7", 3, "traced", computed)
            for _ in range(2):
                assert await rounds["traced T=0.7 round"]() > 0  # the compute the services reported
            # Each process's CPU apart, each service's compute off its own process.
            cpu = await round_cpu(rounds["traced T=0.7 round"], computed, *stack_processes(stack), rounds=3)
            assert list(cpu.outside) == ["client", "draft", "target"]
            assert cpu.compute["draft"] > 0 and cpu.compute["target"] > 0
            # Every process spent CPU on the rounds. (What is left outside the
            # compute can read below zero over three rounds on a busy host:
            # the services time their compute on the wall clock.)
            assert list(cpu.spent) == ["client", "draft", "target"]
            assert all(value > 0 for value in cpu.spent.values())
            for service in ("draft", "target"):
                assert cpu.spent[service] - cpu.outside[service] == pytest.approx(cpu.compute[service])
            stack.telemetry.force_flush()
        finally:
            await _stop(stack, bg)
        return stack

    stack = asyncio.run(run())
    assert stack.target.process.poll() == 0 and stack.draft.process.poll() == 0
    spans = read_spans(tmp_path / "spans.jsonl")
    names = {span["name"] for span in spans}
    assert {"propose", "verify", "prefill"} <= names, names
    # The client spans its rounds as the orchestrator does, and the services' spans join them.
    by_id = {span["span_id"]: span for span in spans}
    parent = {span["name"]: by_id.get(span["parent_id"], {}).get("name") for span in spans if span["service"] != "draft"
              and span["name"] != "prefill"}
    assert parent["draft.propose"] == parent["target.verify"] == parent["accept"] == "round"
    assert parent["verify.batch"] == "target.verify" and parent["verify"] == "verify.batch"
    assert any(span["name"] == "propose" and by_id.get(span["parent_id"], {}).get("name") == "draft.propose"
               for span in spans)


def test_service_processes_take_their_roles_busy_polling_and_serve_rounds(tmp_path: Path):
    """`specd overhead --busy-poll-us US --busy-poll-roles ...`: each service
    process gets its role's setting, and polling changes no round."""
    from specdec.bench.overhead import round_calls
    from specdec.bench.overhead_stack import StackSpec, start_stacks

    async def run():
        bg = BackgroundLoop()
        stack = start_stacks(bg, [StackSpec(tracing=False)], tmp_path, busy_poll_us={"draft": 50_000})[0]
        try:
            await stack.use_lanes()
            rounds = await round_calls(stack, "greedy", 3, "plain", [])
            for _ in range(3):
                assert await rounds["plain greedy round"]() > 0
        finally:
            await _stop(stack, bg)
        return stack

    stack = asyncio.run(run())
    assert "busy polling" in stack.draft.service.log_path.read_text()
    assert "busy polling" not in stack.target.service.log_path.read_text()


def test_the_bare_server_in_a_process_of_its_own_answers_and_stops():
    """The deployed layout's reference for the no-op: a bare call that, like
    the no-op, crosses into another process (bare_grpc.ChildServer)."""
    from specdec.bench import bare_lane
    from specdec.bench.bare_grpc import ChildServer, calls

    child = ChildServer()
    try:
        async def one_call():
            references, close = await calls(child.port)
            try:
                return await references["bare unary"]()
            finally:
                await close()

        async def one_frame():  # the lanes' floor: the child's frame echo beside its grpc echo
            references, close = await bare_lane.calls(child.lane_port)
            try:
                await references["bare lane frame"]()
            finally:
                await close()

        assert eventloop.run(one_call()) == b"0123456789abcdef"
        eventloop.run(one_frame())
    finally:
        child.stop()
    assert child.process.returncode == 0


def test_the_deployed_report_puts_the_no_op_against_the_bare_call_to_a_child_server():
    from specdec.bench.overhead_report import Figures

    figures = eventloop.run(measure(reps=2, k=2, in_process=True))
    m = dict(figures.medians)
    assert "bare unary, child server (calls)" not in m  # in-process: no child server
    m["bare unary, child server (calls)"] = m["plain noop (calls)"] / 1.25
    text = report(Figures(m, figures.k, in_process=False), reps=2)
    assert "| bare grpc.aio unary call to a server in a process of its own (as each service is) |" in text
    noop = f"{m['plain noop (calls)'] * 1e3:.3f}"
    assert f"| no-op unary (target Rollback), tracing off, ÷ that call | {noop} | 1.25x | <= 1.3x |" in text
    # The goal's mark moves to that row: the in-process bare call is no longer its reference.
    assert [line for line in text.splitlines() if "<= 1.3x" in line] == [
        f"| no-op unary (target Rollback), tracing off, ÷ that call | {noop} | 1.25x | <= 1.3x |"]


def test_a_child_server_that_never_reports_its_port_fails_in_time_and_is_stopped(monkeypatch):
    import subprocess

    from specdec.bench import bare_grpc

    started = []
    popen = subprocess.Popen

    def silent(command, **kwargs):  # a child that prints nothing and waits
        started.append(popen([bare_grpc.sys.executable, "-c", "import sys; sys.stdin.read()"], **kwargs))
        return started[-1]

    monkeypatch.setattr(bare_grpc.subprocess, "Popen", silent)
    with pytest.raises(RuntimeError, match="gave no port within 1 s"):
        bare_grpc.ChildServer(start_s=1.0)
    assert started[0].returncode == 0  # stopped: its stdin closed


def test_the_calls_that_run_models_in_the_client_are_timed_apart_from_the_rounds():
    """A round timed just after the models ran in the measuring process
    reads dearer, and the orchestrator never runs one: the compute in-process
    and the in-process stack's round have a phase of their own (deployed
    layout); with every stack in-process the rounds all run models here
    alike and stay together."""
    from specdec.bench.overhead import runs_models_here

    for name in ("plain greedy compute", "traced T=0.7 compute", "inproc greedy round"):
        assert runs_models_here(name, in_process=False)
    for name in ("plain greedy round", "traced T=0.7 round", "unary greedy round", "tls T=0.7 round", "bare unary"):
        assert not runs_models_here(name, in_process=False)
    assert runs_models_here("plain greedy compute", in_process=True)
    assert not runs_models_here("plain greedy round", in_process=True)


def test_each_rep_takes_the_calls_in_a_new_order_and_no_call_twice_in_a_row():
    """A call taken twice in a row finds its services warm: none is, at any
    turn between reps, and every call is taken once a rep, in orders that
    vary (seeded: the same run, the same orders)."""
    from specdec.bench.interleave import orders

    names = [f"call {i}" for i in range(6)]
    taken = orders(names, 200)
    assert all(sorted(order) == names for order in taken)
    sequence = [name for order in taken for name in order]
    assert all(a != b for a, b in zip(sequence, sequence[1:]))
    assert len({tuple(order) for order in taken}) > 100
    firsts = {order[0] for order in taken}
    assert firsts == set(names)  # no call is always first, or always last
    assert orders(names, 50) == orders(names, 50)
    assert orders(["alone"], 3) == [["alone"]] * 3


def test_specd_overhead_reports_event_engine_references_it_could_not_measure(capsys, monkeypatch):
    """The EventEngine references come from a child process; one that dies
    (it did, of SIGSEGV, on a GPU host) leaves their rows out and says why
    under the table, instead of losing the whole run. A process that already
    runs EventEngine starts no such child: its own references are those."""
    from specdec.bench import overhead
    from specdec.cli.main import main

    async def dies(reps, gaps):
        raise RuntimeError("their child process exited with -11 (nothing on stderr)")

    monkeypatch.setattr(overhead, "_event_engine_references", dies)
    assert main(["--log-level", "WARNING", "overhead", "--reps", "2", "--in-process"]) == 0
    out = capsys.readouterr().out
    assert "The EventEngine references were not measured: their child process exited with -11" in out
    assert "EventEngine; a child process" not in out
    assert "| round overhead, greedy, k=4, lanes, tracing off |" in out

    async def must_not_run(reps, gaps):
        raise AssertionError("a child was started for references this process measures itself")

    monkeypatch.setattr(overhead, "_event_engine_references", must_not_run)
    monkeypatch.setattr(overhead.grpc_io, "runs_event_engine", lambda env=None: True)
    assert main(["--log-level", "WARNING", "overhead", "--reps", "2", "--in-process"]) == 0
    out = capsys.readouterr().out
    assert "not measured" not in out and "EventEngine; a child process" not in out
    assert "| round overhead, T=0.7, k=4, lanes, tracing off |" in out


def test_the_bare_lane_echo_answers_each_frame_with_itself():
    """The lanes' floor: one frame each way through `FrameConnection` to an
    echo, back to back and from several callers at once, in order."""
    from specdec.bench import bare_lane

    async def run():
        server, port = await bare_lane.start_echo()
        try:
            calls, close = await bare_lane.calls(port)
            one = calls["bare lane frame"]
            for _ in range(20):
                await one()
            await asyncio.wait_for(asyncio.gather(*(one() for _ in range(8))), 10)
            await close()
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(run())
