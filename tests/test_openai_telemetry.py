"""Requests through the HTTP front door are traced and measured like gRPC
ones: the same `generate` span tree, joined to the caller's trace by a
`traceparent` header, with HTTP semantic-convention attributes; the request
metrics count them, and an HTTP duration histogram counts every response by
route and status. Plus `specd generate --prompt-ids` and stop strings on a
server without a tokenizer."""
from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from contextlib import redirect_stderr, redirect_stdout

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from orchestrator.openai_api.config import HttpConfig
from specdec import telemetry as T
from specdec.cli.main import main as specd
from tests.conftest import tiny_engine, tiny_model
from tests.harness import running_system
from tests.test_orchestrator import GREEDY_PROMPTS, _wait_until, perturbed
from tests.test_telemetry import PARENT, hist_count, in_memory_telemetry, metric_values, wait_for_spans

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(scope="module")
def traced_http():
    """Token-id prompts only: the system has no tokenizer."""
    exporter = InMemorySpanExporter()
    telemetry = in_memory_telemetry(exporter)
    target = tiny_model(seed=0, init_range=0.3)
    with running_system(tiny_engine(model=target), tiny_engine(model=perturbed(target, 0.15, seed=1)),
                        telemetry=telemetry, http=HttpConfig(http_port=0)) as system:
        system.exporter, system.telemetry = exporter, telemetry
        system.url = f"http://127.0.0.1:{system.orchestrator.http.port}"
        yield system
    for t in telemetry.values():
        t.shutdown()


def post(url: str, body: dict, headers: dict | None = None):
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_an_http_request_is_one_trace_with_http_attributes(traced_http):
    s = traced_http
    s.exporter.clear()
    parent_span_id = "00f067aa0ba902b7"
    status, _ = post(f"{s.url}/v1/completions", {"prompt": GREEDY_PROMPTS[0], "max_tokens": 12, "temperature": 0},
                     {"traceparent": f"00-{TRACE_ID}-{parent_span_id}-01", "User-Agent": "pytest-agent"})
    assert status == 200
    spans = [sp for sp in wait_for_spans(s.exporter, T.SPAN_SESSION_CLOSE, 2) if f"{sp.context.trace_id:032x}" == TRACE_ID]
    (generate,) = [sp for sp in spans if sp.name == T.SPAN_GENERATE]
    assert f"{generate.parent.span_id:016x}" == parent_span_id  # a child of the caller's span
    attrs = generate.attributes
    assert attrs[T.HTTP_REQUEST_METHOD] == "POST" and attrs[T.HTTP_ROUTE] == "/v1/completions"
    assert attrs[T.URL_PATH] == "/v1/completions" and attrs[T.HTTP_RESPONSE_STATUS_CODE] == 200
    assert attrs[T.USER_AGENT] == "pytest-agent" and attrs[T.SERVER_PORT] == s.orchestrator.http.port
    assert attrs[T.GEN_AI_OUTPUT_TOKENS] == 12 and attrs[T.GEN_AI_OPERATION] == "text_completion"
    by_id = {sp.context.span_id: sp for sp in spans}
    names = {sp.name for sp in spans}
    assert {T.SPAN_ROUND, T.SPAN_DRAFT_PROPOSE, T.SPAN_PROPOSE, T.SPAN_VERIFY, T.SPAN_PREFILL} <= names
    for span in spans:  # the same tree as a gRPC Generate
        if span.name in PARENT and span.parent.span_id in by_id:
            assert by_id[span.parent.span_id].name == PARENT[span.name], span.name


def test_a_failed_http_request_records_its_status_on_the_span(traced_http):
    s = traced_http
    s.exporter.clear()
    status, body = post(f"{s.url}/v1/completions", {"prompt": [3, 5], "max_tokens": 4, "top_p": 7})
    assert status == 400 and "top_p" in body
    (generate,) = [sp for sp in s.exporter.get_finished_spans() if sp.name == T.SPAN_GENERATE]
    assert generate.attributes[T.HTTP_RESPONSE_STATUS_CODE] == 400
    assert generate.attributes[T.ERROR_TYPE] == "invalid_argument"
    assert not generate.status.is_ok


def test_http_requests_are_counted_by_route_and_status(traced_http):
    s = traced_http
    reader = s.telemetry["orchestrator"].reader
    before = metric_values(reader)
    assert post(f"{s.url}/v1/completions", {"prompt": [3, 4, 5], "max_tokens": 6})[0] == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 3}
    assert post(f"{s.url}/v1/chat/completions", chat)[0] == 400
    with urllib.request.urlopen(f"{s.url}/v1/models", timeout=10) as response:
        assert response.status == 200

    def delta(name, **attrs):
        return hist_count(metric_values(reader), name, **attrs) - hist_count(before, name, **attrs)

    # The histogram records once a response's last byte is sent (the client may
    # read it first), so each route here is one no other test of this module uses.
    http = "specdec_http_request_duration_seconds"
    assert _wait_until(lambda: delta(http, **{"http.route": "/v1/chat/completions",
                                              "http.response.status_code": 400}) == 1)
    assert _wait_until(lambda: delta(http, **{"http.request.method": "GET", "http.route": "/v1/models",
                                              "http.response.status_code": 200}) == 1)
    assert delta("specdec_request_duration_seconds") == 1  # the generation's own metrics, as for gRPC


# ------------------------------------------------------ specd generate

def run_specd(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = specd(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_specd_generate_sends_token_ids(traced_http):
    s = traced_http
    server = f"127.0.0.1:{s.orchestrator.port}"
    code, out, _ = run_specd("generate", "--server", server, "--prompt-ids", "3, 7,9", "--max-tokens", "8",
                             "--temperature", "0", "--json")
    assert code == 0
    expected = s.client.complete([3, 7, 9], max_tokens=8, temperature=0)
    result = json.loads(out)
    assert result["token_ids"] == expected.token_ids and result["stats"]["prompt_tokens"] == 3


@pytest.mark.parametrize("argv, message", [
    ((), "give a prompt, or --prompt-ids"),
    (("hello", "--prompt-ids", "1,2"), "not both"),
    (("--prompt-ids", "1,2", "--chat"), "--chat needs a text prompt"),
])
def test_specd_generate_refuses_ambiguous_prompts(argv, message):
    code, _, err = run_specd("generate", "--server", "127.0.0.1:1", *argv)
    assert code == 2 and message in err


def test_specd_generate_stop_strings_without_a_tokenizer_are_refused(traced_http):
    server = f"127.0.0.1:{traced_http.orchestrator.port}"
    code, _, err = run_specd("generate", "--server", server, "--prompt-ids", "3,4", "--stop", "x")
    assert code == 1 and "INVALID_ARGUMENT" in err and "no tokenizer" in err
