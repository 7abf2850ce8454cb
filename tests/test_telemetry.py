"""Tracing and metrics across the three services (issue 5), with the SDK's
in-memory exporters and tiny models, all servers in-process on 127.0.0.1:0:
one Generate is one connected trace, health checks are not traced, metric
counters agree with the request statistics, tracing off records nothing, and
`specd trace` reads a trace file written by a real run."""
from __future__ import annotations

import concurrent.futures
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specdec import telemetry as T
from specdec.cli.main import main as specd
from specdec.metrics import prometheus_reader, start_metrics_server
from specdec.trace_file import read_spans
from specdec.v1 import common_pb2, target_pb2_grpc
from tests.conftest import tiny_engine, tiny_model
from tests.harness import running_system
from tests.test_orchestrator import GREEDY_PROMPTS, perturbed

ROLES = {"draft": T.SERVICE_DRAFT, "target": T.SERVICE_TARGET, "orchestrator": T.SERVICE_ORCHESTRATOR}

# The parent every span must have, within one request's trace.
PARENT = {
    T.SPAN_SESSION_OPEN: T.SPAN_GENERATE, T.SPAN_PREFILL: T.SPAN_SESSION_OPEN,
    T.SPAN_ROUND: T.SPAN_GENERATE, T.SPAN_DRAFT_PROPOSE: T.SPAN_ROUND, T.SPAN_PROPOSE: T.SPAN_DRAFT_PROPOSE,
    T.SPAN_TARGET_VERIFY: T.SPAN_ROUND, T.SPAN_VERIFY_BATCH: T.SPAN_TARGET_VERIFY,
    T.SPAN_VERIFY: T.SPAN_VERIFY_BATCH, T.SPAN_ACCEPT: T.SPAN_ROUND,
    T.SPAN_SESSION_CLOSE: T.SPAN_GENERATE, T.SPAN_CLOSE: T.SPAN_SESSION_CLOSE,
}


def in_memory_telemetry(exporter, settings: T.TelemetrySettings | None = None) -> dict:
    """Per role: its own providers (its own service.name), one shared span
    exporter, its own metric reader (`.reader`)."""
    roles = {}
    for role, service in ROLES.items():
        reader = InMemoryMetricReader()
        roles[role] = T.setup_telemetry(service, settings or T.TelemetrySettings(), span_exporters=[exporter],
                                        metric_readers=[reader])
        roles[role].reader = reader
    return roles


@pytest.fixture(scope="module")
def traced():
    exporter = InMemorySpanExporter()
    telemetry = in_memory_telemetry(exporter)
    target = tiny_model(seed=0, init_range=0.3)
    with running_system(tiny_engine(model=target), tiny_engine(model=perturbed(target, 0.15, seed=1)),
                        telemetry=telemetry) as system:
        system.exporter, system.telemetry = exporter, telemetry
        yield system
    for t in telemetry.values():
        t.shutdown()


def wait_for_spans(exporter, name: str, count: int, timeout_s: float = 10.0, generates: int = 0) -> list:
    """The finished spans, once `count` spans called `name` are among them
    (session closes run in the background after the stream ends; wait for
    the client's session.close, which ends after the service's close), and
    `generates` generate spans (a Generate call's span ends once its last
    reply is written, which may be after the loop has closed its sessions:
    orchestrator/reply_relay.py)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = list(exporter.get_finished_spans())
        if (sum(s.name == name for s in spans) >= count and sum(s.name == T.SPAN_GENERATE for s in spans) >= generates
                or time.monotonic() > deadline):
            return spans
        time.sleep(0.02)


def wait_until_quiet(exporter, quiet_s: float = 0.3, timeout_s: float = 10.0) -> None:
    """Return once no span has finished for `quiet_s` (what earlier tests'
    requests still close in the background has landed)."""
    deadline = time.monotonic() + timeout_s
    seen = -1
    while time.monotonic() < deadline:
        count = len(exporter.get_finished_spans())
        if count == seen:
            return
        seen = count
        time.sleep(quiet_s)


def service_of(span) -> str:
    return span.resource.attributes["service.name"]


# ---------------------------------------------------------------- traces

def test_one_generate_is_one_connected_trace_across_the_three_services(traced):
    traced.exporter.clear()
    prompt = GREEDY_PROMPTS[3]
    result = traced.client.complete(prompt, max_tokens=16, temperature=0, num_draft_tokens=3, seed=7)
    st = result.stats
    spans = wait_for_spans(traced.exporter, T.SPAN_SESSION_CLOSE, 2, generates=1)

    assert len({s.context.trace_id for s in spans}) == 1, "every span belongs to the request's trace"
    assert {service_of(s) for s in spans} == set(ROLES.values())
    by_id = {s.context.span_id: s for s in spans}
    roots = [s for s in spans if s.parent is None]
    assert [r.name for r in roots] == [T.SPAN_GENERATE]
    for span in spans:
        if span.parent is not None:
            assert span.parent.span_id in by_id, f"{span.name}: parent missing"
            assert by_id[span.parent.span_id].name == PARENT[span.name], span.name

    names = [s.name for s in spans]
    where = {name: {service_of(s) for s in spans if s.name == name} for name in set(names)}
    assert where[T.SPAN_PROPOSE] == {T.SERVICE_DRAFT} and where[T.SPAN_VERIFY] == {T.SERVICE_TARGET}
    assert where[T.SPAN_PREFILL] == {T.SERVICE_DRAFT, T.SERVICE_TARGET}
    for prefill in (s for s in spans if s.name == T.SPAN_PREFILL):
        peer = by_id[prefill.parent.span_id].attributes[T.A_PEER]
        assert service_of(prefill) == f"specdec-{peer}"
        assert prefill.attributes[T.A_PROMPT_TOKENS] == len(prompt) and prefill.attributes[T.A_KV_BYTES] > 0
        assert prefill.attributes[T.A_BATCH_SESSIONS] == 1  # one request: its open had a job of its own

    rounds = [s for s in spans if s.name == T.SPAN_ROUND]
    assert len(rounds) == st.rounds == names.count(T.SPAN_TARGET_VERIFY) == names.count(T.SPAN_VERIFY)
    assert sorted(r.attributes[T.A_ROUND] for r in rounds) == list(range(st.rounds))
    assert sum(r.attributes[T.A_ACCEPTED] for r in rounds) == st.accepted_tokens
    assert sum(r.attributes[T.A_RETURNED] for r in rounds) == st.proposed_tokens
    assert sum(r.attributes[T.A_EMITTED] for r in rounds) >= st.completion_tokens
    assert all(r.attributes[T.A_K] <= 3 and not r.attributes[T.A_FALLBACK] for r in rounds)
    proposes = [s for s in spans if s.name == T.SPAN_PROPOSE]
    assert len(proposes) == names.count(T.SPAN_DRAFT_PROPOSE) == sum(r.attributes[T.A_K] > 0 for r in rounds)
    assert sum(p.attributes[T.A_TOKENS] for p in proposes) == st.proposed_tokens
    accepts = [s for s in spans if s.name == T.SPAN_ACCEPT]
    assert sum(a.attributes[T.A_ACCEPTED] for a in accepts) == st.accepted_tokens
    for verify in (s for s in spans if s.name == T.SPAN_VERIFY):
        assert verify.attributes[T.A_BATCH_ITEMS] == 1 and verify.attributes[T.A_FORWARD_S] > 0
    # Each round's calls went on the services' lanes (specdec/rpc/lane.py), and their client spans say so.
    carried = [s.attributes.get(T.A_CARRIER) for s in spans if s.name in (T.SPAN_DRAFT_PROPOSE, T.SPAN_VERIFY_BATCH)]
    assert carried and set(carried) == {"lane"}, carried

    generate = roots[0].attributes
    assert generate[T.GEN_AI_REQUEST_MODEL] == generate[T.GEN_AI_RESPONSE_MODEL] == st.target_model
    assert generate[T.GEN_AI_INPUT_TOKENS] == len(prompt)
    assert generate[T.GEN_AI_OUTPUT_TOKENS] == st.completion_tokens == len(result.token_ids)
    assert generate[T.GEN_AI_MAX_TOKENS] == 16 and generate[T.GEN_AI_TEMPERATURE] == 0.0
    assert generate[T.GEN_AI_TOP_P] == 1.0
    assert tuple(generate[T.GEN_AI_FINISH_REASONS]) == ("length",)
    assert generate[T.A_SEED] == 7 and generate[T.A_POLICY] == "fixed"
    assert generate[T.A_DRAFT_MODEL] == st.draft_model
    assert generate[T.A_ROUNDS] == st.rounds
    assert generate[T.A_ACCEPTANCE_RATE] == pytest.approx(st.acceptance_rate)


def test_a_batched_verify_joins_one_trace_and_links_the_others(traced):
    traced.exporter.clear()

    def run(i):
        client = traced.client.__class__(f"127.0.0.1:{traced.orchestrator.port}", timeout_s=60)
        try:
            return client.complete(GREEDY_PROMPTS[i], max_tokens=12, temperature=0, num_draft_tokens=2)
        finally:
            client.close()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, range(4)))
    spans = wait_for_spans(traced.exporter, T.SPAN_SESSION_CLOSE, 8, generates=4)
    assert len({s.context.trace_id for s in spans}) == 4, "one trace per request"
    by_id = {s.context.span_id: s for s in spans}
    batches = [s for s in spans if s.name == T.SPAN_VERIFY_BATCH]
    verifies = [s for s in spans if s.name == T.SPAN_TARGET_VERIFY]
    assert len(verifies) == sum(r.stats.rounds for r in results)
    assert sum(b.attributes[T.A_BATCH_ITEMS] for b in batches) == len(verifies)
    assert any(b.attributes[T.A_BATCH_ITEMS] > 1 for b in batches), "nothing was batched"
    carried = set()
    for batch in batches:
        parent = by_id[batch.parent.span_id]
        assert parent.name == T.SPAN_TARGET_VERIFY and parent.context.trace_id == batch.context.trace_id
        assert len(batch.links) == batch.attributes[T.A_BATCH_ITEMS] - 1
        carried |= {parent.context.span_id, *(link.context.span_id for link in batch.links)}
        for link in batch.links:  # and back: each other request's verify links to the batch
            other = by_id[link.context.span_id]
            assert other.name == T.SPAN_TARGET_VERIFY
            assert batch.context.span_id in {lk.context.span_id for lk in other.links}
    assert carried == {v.context.span_id for v in verifies}, "every request's verify is carried by one batch"


def test_health_checks_are_not_traced(traced):
    wait_until_quiet(traced.exporter)  # the last test's session closes may still be landing
    traced.exporter.clear()
    # a caller's trace context must not make a health check traced either
    caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    metadata = (("traceparent", f"00-{caller_trace}-00f067aa0ba902b7-01"),)
    for port in (traced.orchestrator.port, traced.draft.port, traced.target.port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5,
                                                              metadata=metadata)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    time.sleep(0.1)
    # A health check's span would continue the caller's trace, or start one
    # of its own (a root that is no request's generate span). Only those
    # count: an earlier test's request may still be closing its sessions in
    # the background (spans under that request's generate span).
    spans = [s for s in traced.exporter.get_finished_spans()
             if f"{s.context.trace_id:032x}" == caller_trace or (s.parent is None and s.name != T.SPAN_GENERATE)]
    assert spans == [], [(s.name, service_of(s), f"{s.context.trace_id:032x}") for s in spans]


def test_a_callers_trace_context_is_continued(traced):
    traced.exporter.clear()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    metadata = (("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01"),)
    from orchestrator.client import build_request

    replies = list(traced.client.stub.Generate(build_request(GREEDY_PROMPTS[0], max_tokens=4, temperature=0),
                                               timeout=60, metadata=metadata))
    assert replies[-1].HasField("stats")
    spans = wait_for_spans(traced.exporter, T.SPAN_SESSION_CLOSE, 2, generates=1)
    # This request's spans, the orchestrator's and both services', are all in
    # the caller's trace. (Only these: a late span of an earlier test's request,
    # a background close, may arrive after the clear.)
    mine = [s for s in spans if f"{s.context.trace_id:032x}" == trace_id]
    assert {T.SPAN_GENERATE, T.SPAN_ROUND, T.SPAN_PREFILL, T.SPAN_PROPOSE, T.SPAN_VERIFY} <= {s.name for s in mine}
    assert all(s.name not in (T.SPAN_GENERATE, T.SPAN_PREFILL, T.SPAN_PROPOSE, T.SPAN_VERIFY)
               for s in spans if s not in mine), [s.name for s in spans if s not in mine]
    generate = next(s for s in mine if s.name == T.SPAN_GENERATE)
    assert generate.parent.span_id == 0x00F067AA0BA902B7 and generate.parent.is_remote


# --------------------------------------------------------------- metrics

def metric_values(reader) -> dict[str, list]:
    """name -> data points of the reader's latest collection."""
    out: dict[str, list] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = list(m.data.data_points)
    return out


def counter(points: dict, name: str, **attrs) -> int:
    return sum(p.value for p in points.get(name, ()) if all(p.attributes.get(k) == v for k, v in attrs.items()))


def hist_count(points: dict, name: str, **attrs) -> int:
    return sum(p.count for p in points.get(name, ()) if all(p.attributes.get(k) == v for k, v in attrs.items()))


def test_metric_counters_agree_with_the_request_statistics(traced):
    orch, target = traced.telemetry["orchestrator"].reader, traced.telemetry["target"].reader
    before, target_before = metric_values(orch), metric_values(target)
    runs = [dict(num_draft_tokens=3), dict(num_draft_tokens=5), dict(policy="adaptive", num_draft_tokens=2)]
    stats = [traced.client.complete(GREEDY_PROMPTS[5 + i], max_tokens=20, temperature=0, **kw).stats
             for i, kw in enumerate(runs)]
    after, target_after = metric_values(orch), metric_values(target)

    def delta(name, **attrs):
        return counter(after, name, **attrs) - counter(before, name, **attrs)

    def hist_delta(points_after, points_before, name, **attrs):
        return hist_count(points_after, name, **attrs) - hist_count(points_before, name, **attrs)

    assert delta("specdec_draft_tokens") == sum(s.proposed_tokens for s in stats)
    assert delta("specdec_accepted_tokens") == sum(s.accepted_tokens for s in stats)
    assert delta("specdec_drafts") == sum(s.rounds - (s.k.histogram[0] if s.k.histogram else 0) for s in stats)
    positions = max(len(s.accepted_per_position) for s in stats)
    for i in range(positions):
        expected = sum(s.accepted_per_position[i] for s in stats if i < len(s.accepted_per_position))
        assert delta("specdec_accepted_tokens_per_position", position=i) == expected, f"position {i}"
    assert delta("specdec_requests", finish_reason="length") + delta("specdec_requests", finish_reason="eos") == 3
    assert hist_delta(after, before, "specdec_time_to_first_token_seconds") == 3
    assert hist_delta(after, before, "specdec_request_duration_seconds") == 3
    assert hist_delta(after, before, "specdec_num_draft_tokens") == sum(s.rounds for s in stats)
    assert hist_delta(after, before, "specdec_rpc_round_trip_seconds", service="draft", method="Propose") == \
        sum(s.rounds - (s.k.histogram[0] if s.k.histogram else 0) for s in stats)
    assert hist_delta(after, before, "specdec_rpc_round_trip_seconds", service="target", method="Verify") == \
        sum(s.rounds for s in stats)
    # The target records a Verify's batch size on its loop's next turn, after the
    # reply is on its way: the last one may land just after the client has it.
    deadline = time.monotonic() + 5
    while (hist_delta(target_after, target_before, "specdec_verify_batch_size") < sum(s.rounds for s in stats)
           and time.monotonic() < deadline):
        time.sleep(0.01)
        target_after = metric_values(target)
    assert hist_delta(target_after, target_before, "specdec_verify_batch_size") == sum(s.rounds for s in stats)


def test_model_services_report_sessions_and_kv_bytes(traced):
    reader = traced.telemetry["target"].reader
    with grpc.insecure_channel(f"127.0.0.1:{traced.target.port}") as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        opened = stub.OpenSession(common_pb2.OpenSessionRequest(prompt_token_ids=[3, 4, 5]), timeout=10)
        try:
            points = metric_values(reader)
            assert points["specdec_active_sessions"][0].value >= 1
            assert points["specdec_kv_cache_bytes"][0].value >= opened.kv_bytes > 0
        finally:
            stub.CloseSession(common_pb2.CloseSessionRequest(session_id=opened.session_id), timeout=10)


def test_prometheus_endpoint_serves_the_metrics_under_prometheus_names():
    reader, registry = prometheus_reader()
    t = T.setup_telemetry("specdec-test", T.TelemetrySettings(tracing=False), metric_readers=[reader])
    t.metrics.record_round(k_chosen=4, proposed=4, accepted=2)
    t.metrics.record_request(duration_s=0.5, first_token_s=0.1, completion_tokens=5, finish_reason="length")
    t.metrics.record_rpc("draft", "Propose", 0.003)
    t.metrics.observe_sessions(lambda: (2, 4096))
    server = start_metrics_server("127.0.0.1", 0, registry)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        t.shutdown()
    for line in ("specdec_drafts_total", "specdec_draft_tokens_total", "specdec_accepted_tokens_total",
                 'specdec_accepted_tokens_per_position_total{otel_scope_name="specdec"',
                 "specdec_time_to_first_token_seconds_bucket", "specdec_time_per_output_token_seconds_count",
                 "specdec_request_duration_seconds_sum", "specdec_num_draft_tokens_bucket",
                 "specdec_rpc_round_trip_seconds_bucket", "specdec_active_sessions", "specdec_kv_cache_bytes",
                 'specdec_requests_total{finish_reason="length"'):
        assert line in text, line
    assert 'position="1"' in text and 'service="draft"' in text
    assert "specdec_kv_cache_bytes_bytes" not in text and "_seconds_seconds" not in text


# ---------------------------------------------------------- tracing off

def test_settings_come_from_the_environment():
    off = T.TelemetrySettings.from_env({"SPECD_TRACING": "off"})
    assert not off.tracing
    assert T.TelemetrySettings.from_env({}).traces_exporter == ()  # no endpoint: no OTLP export
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "SPECD_TRACE_FILE": "/tmp/t.jsonl"}
    s = T.TelemetrySettings.from_env(env)
    assert s.tracing and s.traces_exporter == ("otlp",) and s.trace_file == "/tmp/t.jsonl"
    assert s.traces_protocol == "grpc"
    s = T.TelemetrySettings.from_env({**env, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none",
                                      "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert s.traces_exporter == () and s.metrics_exporter == () and s.traces_protocol == "http/protobuf"
    with pytest.raises(ValueError, match="zipkin"):
        T.setup_telemetry("x", T.TelemetrySettings(traces_exporter=("zipkin",)))
    # nothing to export to: no tracer provider at all, spans cost nothing
    assert not T.setup_telemetry("x", T.TelemetrySettings()).tracing


def test_tracing_off_records_no_spans():
    exporter = InMemorySpanExporter()
    telemetry = in_memory_telemetry(exporter, T.TelemetrySettings.from_env({"SPECD_TRACING": "off"}))
    assert not any(t.tracing for t in telemetry.values())
    with running_system(tiny_engine(seed=0), tiny_engine(seed=1), telemetry=telemetry) as s:
        result = s.client.complete(GREEDY_PROMPTS[1], max_tokens=8, temperature=0, num_draft_tokens=2)
        time.sleep(0.2)  # let the background session closes run
    assert result.stats.completion_tokens > 0
    assert list(exporter.get_finished_spans()) == []
    # metrics stay on when tracing is off
    assert counter(metric_values(telemetry["orchestrator"].reader), "specdec_requests") == 1


# ------------------------------------------------------------ specd trace

def test_specd_trace_lists_and_shows_a_real_run(tmp_path, capsys):
    path = tmp_path / "traces.jsonl"
    settings = T.TelemetrySettings(trace_file=str(path))  # the three roles share one file, as under `specd up`
    # The spans also go to memory as they end, to tell when the last one has.
    ended = InMemorySpanExporter()
    telemetry = {role: T.setup_telemetry(service, settings, span_exporters=[ended]) for role, service in ROLES.items()}
    target = tiny_model(seed=0, init_range=0.3)
    try:
        with running_system(tiny_engine(model=target), tiny_engine(model=perturbed(target, 0.15, seed=1)),
                            telemetry=telemetry) as s:
            first = s.client.complete(GREEDY_PROMPTS[2], max_tokens=6, temperature=0, num_draft_tokens=2)
            last = s.client.complete(GREEDY_PROMPTS[4], max_tokens=10, temperature=0, num_draft_tokens=3)

            # Each request's two sessions close in the background after its
            # stream ends: wait for both close phases of both (the service's
            # `close`, the orchestrator's `session.close`) before the shutdown flushes the file.
            def closed(name: str) -> int:
                return sum(span.name == name for span in ended.get_finished_spans())

            deadline = time.monotonic() + 20.0
            while closed(T.SPAN_CLOSE) < 4 or closed(T.SPAN_SESSION_CLOSE) < 4 or closed(T.SPAN_GENERATE) < 2:
                assert time.monotonic() < deadline, [span.name for span in ended.get_finished_spans()]
                time.sleep(0.02)
    finally:
        for t in telemetry.values():
            t.shutdown()  # flushes the batch processors into the file

    spans = read_spans(path)
    assert {s["service"] for s in spans} == set(ROLES.values())
    generates = sorted((s for s in spans if s["name"] == T.SPAN_GENERATE), key=lambda s: s["start_ns"])
    assert len(generates) == 2 and generates[0]["parent_id"] is None

    assert specd(["trace", "list", "--file", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["trace", "id"] and len(out) == 3
    assert out[1].split()[0] == generates[1]["trace_id"], "newest first"
    assert out[1].split()[4] == str(last.stats.completion_tokens)
    assert out[2].split()[4] == str(first.stats.completion_tokens)

    assert specd(["trace", "show", "--file", str(path)]) == 0  # the latest
    lines = capsys.readouterr().out.splitlines()
    assert generates[1]["trace_id"] in lines[0] and f"tokens {last.stats.completion_tokens}" in lines[0]
    assert lines[1].split()[:4] == ["phase", "service", "start", "ms"]
    body = lines[2:]
    assert body[0].startswith("generate ") and "orchestrator" in body[0]
    assert len(body) == sum(s["trace_id"] == generates[1]["trace_id"] for s in spans)
    phases = [line.split()[0] for line in body]
    assert phases.count("round") == last.stats.rounds
    assert {"propose", "verify", "prefill", "draft.propose", "target.verify", "accept", "close"} <= set(phases)
    assert any(line.startswith("      propose ") and " draft " in line for line in body), "indented by depth"
    assert all(line.endswith("|") and "=" in line.rsplit("|", 2)[1] for line in body)

    assert specd(["trace", "show", generates[0]["trace_id"][:10], "--file", str(path)]) == 0
    assert f"tokens {first.stats.completion_tokens}" in capsys.readouterr().out
    assert specd(["trace", "show", "ffff", "--file", str(path)]) == 1
    assert specd(["trace", "list", "--file", str(tmp_path / "missing.jsonl")]) == 1


def test_serve_commands_serve_metrics_on_the_metrics_port(monkeypatch):
    import socket

    from specdec.cli.serve_cmd import role_telemetry
    from specdec.rpc.serving import ServerConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("SPECD_TRACING", "off")
    with role_telemetry("target", ServerConfig(host="127.0.0.1", metrics_port=port)) as t:
        t.metrics.observe_sessions(lambda: (3, 1024))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    assert "specdec_active_sessions{" in text and "specdec_kv_cache_bytes{" in text
    with pytest.raises(OSError):  # stopped with the role
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_a_leaf_span_is_built_after_its_work_with_its_times_parent_attributes_and_error():
    """`leaf_server_span` notes the span and builds it on the event loop's
    next turn (off the reply's path): the same span a current one would be,
    its caller's trace context as parent, attributes set inside it, an error
    recorded, the times of the work itself."""
    import asyncio

    from opentelemetry.trace import StatusCode

    exporter = InMemorySpanExporter()
    telemetry = T.setup_telemetry("leaf", span_exporters=[exporter])
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    metadata = (("traceparent", f"00-{trace_id}-{parent_id}-01"),)

    async def run():
        with telemetry.leaf_server_span(T.SPAN_VERIFY, metadata, {T.A_BATCH_ITEMS: 2}) as span:
            before = time.time_ns()
            span.set_attribute(T.A_BATCH_SESSIONS, 2)
        assert exporter.get_finished_spans() == (), "built only once the loop turns"
        await asyncio.sleep(0)
        with pytest.raises(ValueError):
            with telemetry.leaf_span(T.SPAN_ACCEPT):
                raise ValueError("bad drafts")
        await asyncio.sleep(0)
        return before

    before = asyncio.run(run())
    verify, accept = exporter.get_finished_spans()
    assert verify.name == T.SPAN_VERIFY and verify.kind is T.SpanKind.SERVER
    assert format(verify.context.trace_id, "032x") == trace_id and format(verify.parent.span_id, "016x") == parent_id
    assert dict(verify.attributes) == {T.A_BATCH_ITEMS: 2, T.A_BATCH_SESSIONS: 2}
    assert verify.start_time <= before <= verify.end_time
    assert accept.status.status_code is StatusCode.ERROR and accept.events[0].name == "exception"
    assert accept.parent is None  # no span was current: a root
    telemetry.shutdown()


def test_a_rounds_data_points_are_recorded_on_the_loops_next_turn_and_not_without_a_meter():
    """The round's data points leave its path: inside a running loop they are
    recorded on its next turn (all of them), outside one at once; with a
    no-op meter they are not recorded at all."""
    import asyncio

    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.sdk.metrics import MeterProvider

    from specdec.metrics import Metrics

    reader = InMemoryMetricReader()
    metrics = Metrics(MeterProvider(metric_readers=[reader]).get_meter("test"))

    async def a_round():
        metrics.record_round(4, 4, 3)
        metrics.record_rpc("draft", "Propose", 0.002)
        metrics.record_verify_batch(3)
        during = metric_values(reader)
        await asyncio.sleep(0)
        return during

    during = asyncio.run(a_round())
    assert not {"specdec_accepted_tokens", "specdec_rpc_round_trip_seconds", "specdec_verify_batch_size"} & set(during)
    points = metric_values(reader)
    assert counter(points, "specdec_drafts") == 1 and counter(points, "specdec_draft_tokens") == 4
    assert counter(points, "specdec_accepted_tokens") == 3
    assert [counter(points, "specdec_accepted_tokens_per_position", position=i) for i in range(3)] == [1, 1, 1]
    assert len(points["specdec_rpc_round_trip_seconds"]) == 1
    assert hist_count(points, "specdec_verify_batch_size") == 1

    metrics.record_round(2, 2, 2)  # no loop runs here: at once
    assert counter(metric_values(reader), "specdec_accepted_tokens") == 5

    assert not Metrics(NoOpMeterProvider().get_meter("test")).enabled


def test_an_http_method_no_client_means_is_recorded_as_other():
    """h11 passes any token through as a method; each one a series of its
    own (unauthenticated requests too) was a label without bound."""
    from opentelemetry.sdk.metrics import MeterProvider

    from specdec.metrics import Metrics

    reader = InMemoryMetricReader()
    metrics = Metrics(MeterProvider(metric_readers=[reader]).get_meter("test"))
    for method in ("GET", "POST", "ZZQ81X", "M0", "M1"):
        metrics.record_http(method, "other", 405, 0.001)
    points = metric_values(reader)["specdec_http_request_duration_seconds"]
    assert sorted((p.attributes["http.request.method"], p.count) for p in points) == \
        [("GET", 1), ("POST", 1), ("_OTHER", 3)]


def test_a_failed_call_records_no_session_id_on_its_span():
    """A session id is its credential: error messages named it ("session
    'ID' holds only 4"), and a service span copies its error's message into
    its status and exception event, which go out over OTLP."""
    from specdec.v1 import target_pb2
    from tests.harness import running_target

    exporter = InMemorySpanExporter()
    telemetry = T.setup_telemetry(T.SERVICE_TARGET, T.TelemetrySettings(), span_exporters=[exporter])
    try:
        with running_target(tiny_engine(), telemetry=telemetry) as (_, stub, _):
            sid = stub.OpenSession(common_pb2.OpenSessionRequest(prompt_token_ids=[5, 6, 7, 8], max_new_tokens=8),
                                   timeout=30).session_id
            with pytest.raises(grpc.RpcError) as failed:
                stub.Rollback(common_pb2.RollbackRequest(session_id=sid, length=1000), timeout=30)
            assert failed.value.code() is grpc.StatusCode.OUT_OF_RANGE
            item = target_pb2.VerifyItem(session_id=sid, draft_token_ids=[1])
            reply = stub.Verify(target_pb2.VerifyRequest(items=[item, item]), timeout=30)
            assert reply.results[1].HasField("error")
            stub.CloseSession(common_pb2.CloseSessionRequest(session_id=sid), timeout=30)
        telemetry.force_flush()
        spans = exporter.get_finished_spans()
        assert any(s.status.description for s in spans)  # the errors were recorded, without the id
        for span in spans:
            texts = [span.status.description or "", str(dict(span.attributes or {}))]
            texts += [str(dict(event.attributes or {})) for event in span.events]
            assert not any(sid in text for text in texts), (span.name, texts)
    finally:
        telemetry.shutdown()


def test_sdk_disabled_builds_no_span_processor(tmp_path, monkeypatch):
    """OTEL_SDK_DISABLED=true turns tracing off before any span processor is
    made: a BatchSpanProcessor starts its worker thread as it is built, and
    one built only to be dropped is never shut down (a thread per setup)."""
    import threading

    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    before = set(threading.enumerate())
    trace_file = tmp_path / "traces" / "t.jsonl"
    t = T.setup_telemetry("x", T.TelemetrySettings(trace_file=str(trace_file), traces_exporter=("console",)))
    assert not t.tracing
    t.shutdown()
    assert [thread.name for thread in set(threading.enumerate()) - before] == []
    assert not trace_file.parent.exists(), "no exporter made: the trace file's folder is not created"
