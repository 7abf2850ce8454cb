"""specdec/trace_file.py: the exporter's lines, formatted directly, are the
lines the span's dict encodes to, byte for byte, and `read_spans` reads
them back; `specd trace` lists and shows the requests in such a file, one
per `generate` span even when several share a trace."""
from __future__ import annotations

import json

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.status import Status, StatusCode

from specdec.cli.main import main as specd
from specdec.spans import SpanSink
from specdec.trace_file import JsonLinesSpanExporter, read_spans, span_line


def span_to_dict(span) -> dict:
    """The reference: a span's line as a dict, for json.dumps."""
    ctx = span.context
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "name": span.name,
        "service": span.resource.attributes.get("service.name", ""),
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
        "links": [{"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
                  for link in span.links],
    }


def _spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": 'specdec-"orchestrator"'}))
    processor = SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    sink = SpanSink(provider, [processor], InstrumentationScope("specdec"))
    root = sink.start("round", None, SpanKind.INTERNAL, {"specdec.k": 4, "share": 0.25, "ok": True,
                                                         "text": 'a "quoted"\\ line\nwith ünïcode', "ids": (1, 2)})
    call = sink.start("draft.propose ✓", trace.set_span_in_context(root), SpanKind.CLIENT, None,
                      [Link(root.get_span_context())])
    call.set_status(Status(StatusCode.ERROR, "gone"))
    call.end()
    root.end()
    return exporter.get_finished_spans()


def test_a_line_is_what_the_dict_encodes_to():
    for span in _spans():
        assert span_line(span) == json.dumps(span_to_dict(span), separators=(",", ":"), default=str) + "\n"
        assert json.loads(span_line(span)) == json.loads(json.dumps(span_to_dict(span), default=str))


def test_the_exporter_appends_lines_that_read_back(tmp_path):
    spans = _spans()
    path = tmp_path / "t.jsonl"
    exporter = JsonLinesSpanExporter(path)
    exporter.export(spans)
    exporter.export(spans[:1])
    read = read_spans(path)
    assert [s["name"] for s in read] == ["draft.propose ✓", "round", "draft.propose ✓"]
    assert read[0]["parent_id"] == read[1]["span_id"] and read[1]["parent_id"] is None
    assert read[0]["links"] == [{"trace_id": read[1]["trace_id"], "span_id": read[1]["span_id"]}]
    assert read[1]["attributes"]["text"] == 'a "quoted"\\ line\nwith ünïcode' and read[0]["status"] == "ERROR"


# ------------------------------------------------------------ specd trace

CALLER = "00f067aa0ba902b7"  # a client's span, not in the file, parent of its Generate calls
SHARED = "4bf92f3577b34da6a3ce929d0e0e4736"  # that client's trace
LONE = "c3d673bad120978476d66d6d1c048218"  # a request with a trace of its own
T0 = 1_700_000_000_000_000_000
MS = 1_000_000


def _span(trace_id, span_id, parent_id, name, start_ms, dur_ms, service="orchestrator", **attributes):
    return {"trace_id": trace_id, "span_id": span_id, "parent_id": parent_id, "name": name,
            "service": f"specdec-{service}", "kind": "INTERNAL", "start_ns": T0 + start_ms * MS,
            "end_ns": T0 + (start_ms + dur_ms) * MS, "attributes": attributes, "status": "UNSET", "links": []}


def _generate(trace_id, span_id, parent_id, start_ms, tokens, rounds, acceptance):
    """A request's spans: its `generate`, one round with the draft's
    `propose` under the orchestrator's client span, and the session close
    that ends after the `generate`."""
    ids = [f"{span_id[:12]}{i:04x}" for i in range(4)]
    return [_span(trace_id, span_id, parent_id, "generate", start_ms, 100, **{
                "gen_ai.usage.output_tokens": tokens, "specdec.rounds": rounds,
                "specdec.acceptance_rate": acceptance}),
            _span(trace_id, ids[0], span_id, "round", start_ms + 10, 50, **{"specdec.k": 3}),
            _span(trace_id, ids[1], ids[0], "draft.propose", start_ms + 11, 20),
            _span(trace_id, ids[2], ids[1], "propose", start_ms + 12, 18, service="draft"),
            _span(trace_id, ids[3], span_id, "session.close", start_ms + 100, 20)]


def _write(path, spans):
    path.write_text("".join(json.dumps(s) + "\n" for s in sorted(spans, key=lambda s: s["end_ns"])))
    return path


def _two_requests_in_one_trace(tmp_path):
    """One client span made two Generate calls (5 s apart), so both are in
    its trace; another request, in between, has a trace of its own."""
    first = _generate(SHARED, "a" * 16, CALLER, 0, 10, 4, 0.5)
    second = _generate(SHARED, "b" * 16, CALLER, 5000, 99, 30, 0.9)
    lone = _generate(LONE, "c" * 16, None, 2000, 7, 2, 0.25)
    return _write(tmp_path / "t.jsonl", first + second + lone)


def test_requests_that_share_a_trace_are_listed_one_row_each(tmp_path, capsys):
    path = _two_requests_in_one_trace(tmp_path)
    assert specd(["trace", "list", "--file", str(path)]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert [(row.split()[0], row.split()[4]) for row in rows] == [(SHARED, "99"), (LONE, "7"), (SHARED, "10")]
    assert header.split() == ["trace", "id", "start", "ms", "tokens", "rounds", "accept", "spans", "span", "id"]
    # trace id, date, time, ms, tokens, rounds, accept, spans, span id: newest first, each its own subtree
    assert [row.split()[:1] + row.split()[3:] for row in rows] == [
        [SHARED, "120.0", "99", "30", "0.90", "5", "b" * 16],
        [LONE, "120.0", "7", "2", "0.25", "5", "c" * 16],
        [SHARED, "120.0", "10", "4", "0.50", "5", "a" * 16],
    ]


def _shown(capsys) -> list[list[str]]:
    """`show`'s output as one list of lines per request."""
    return [block.splitlines() for block in capsys.readouterr().out.split("\n\n")]


def test_show_takes_a_requests_span_id_or_shows_each_request_of_a_trace(tmp_path, capsys):
    path = _two_requests_in_one_trace(tmp_path)
    assert specd(["trace", "show", "bbbb", "--file", str(path)]) == 0
    [second] = _shown(capsys)
    assert second[0].startswith(f"trace {SHARED}  span {'b' * 16}  ") and "tokens 99  rounds 30" in second[0]
    assert [line.split()[0] for line in second[2:]] == ["generate", "round", "draft.propose", "propose",
                                                         "session.close"]
    assert second[5].startswith("      propose ") and " draft " in second[5], "the draft's span, by its parent"

    assert specd(["trace", "show", SHARED[:8], "--file", str(path)]) == 0
    first, second = _shown(capsys)  # each request of the trace, oldest first
    assert f"span {'a' * 16}" in first[0] and "tokens 10 " in first[0] and len(first) == 2 + 5
    assert f"span {'b' * 16}" in second[0] and "tokens 99 " in second[0] and len(second) == 2 + 5

    assert specd(["trace", "show", "--file", str(path)]) == 0  # the latest request, not the latest trace
    [latest] = _shown(capsys)
    assert f"span {'b' * 16}" in latest[0] and len(latest) == 2 + 5

    assert specd(["trace", "show", "ffff", "--file", str(path)]) == 1
    assert "no trace or request with id 'ffff'" in capsys.readouterr().err
    _write(path, _generate(SHARED, "4bf9" + "0" * 12, CALLER, 0, 1, 1, 1.0))
    assert specd(["trace", "show", "4bf9", "--file", str(path)]) == 1  # a trace id and a span id
    assert "id '4bf9' is ambiguous: it begins 1 trace id and 1 span id" in capsys.readouterr().err


def test_spans_under_no_generate_are_one_request_per_span_they_hang_from(tmp_path, capsys):
    """A request still running has its rounds in the file but not yet its
    `generate` (written when it ends): one row, not one per round, under
    the id its `generate` will have. A root with no parent is its own."""
    running = [s for s in _generate(SHARED, "d" * 16, CALLER, 0, 0, 0, 0.0) if s["name"] != "generate"]
    roots = [_span(LONE, "e" * 16, None, "prefill", 500, 5, service="target"),
             _span(LONE, "f" * 16, None, "prefill", 600, 5, service="target")]
    path = _write(tmp_path / "t.jsonl", running + roots)
    assert specd(["trace", "list", "--file", str(path)]) == 0
    rows = [row.split() for row in capsys.readouterr().out.splitlines()[1:]]
    assert [row[-3:] for row in rows] == [["1", "f" * 16, "(prefill)"], ["1", "e" * 16, "(prefill)"],
                                          ["4", "d" * 16, "(round)"]]


def test_span_tree_roots_the_spans_whose_parent_is_missing_and_takes_a_span_once():
    """`show`'s tree: depth first, siblings by start; a span whose parent is
    not in the request starts a root of its own; a span listed twice (one
    copy its own parent) is shown once rather than looping."""
    from specdec.cli.trace_cmd import span_tree

    spans = [_span(SHARED, "b" * 16, "a" * 16, "round", 20, 5),
             _span(SHARED, "a" * 16, None, "generate", 0, 100),
             _span(SHARED, "c" * 16, "a" * 16, "round", 10, 5),
             _span(SHARED, "d" * 16, "c" * 16, "propose", 11, 2, service="draft"),
             _span(SHARED, "e" * 16, "f" * 16, "orphan", 5, 1)]
    assert [(depth, s["span_id"][0]) for depth, s in span_tree(spans)] == [
        (0, "a"), (1, "c"), (2, "d"), (1, "b"), (0, "e")]
    twice = [_span(SHARED, "a" * 16, None, "generate", 0, 100), _span(SHARED, "a" * 16, "a" * 16, "generate", 0, 100)]
    assert [(depth, s["parent_id"]) for depth, s in span_tree(twice)] == [(0, None)]
