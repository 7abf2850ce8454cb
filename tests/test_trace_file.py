"""specdec/trace_file.py: the exporter's lines, formatted directly, are the
lines the span's dict encodes to, byte for byte, and `read_spans` reads
them back."""
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
