"""The local trace file: one JSON object per span, one span per line.

Written by `JsonLinesSpanExporter` (SPECD_TRACE_FILE, behind a
BatchSpanProcessor), read by `specd trace`. Several processes may append to
the same file (`specd up` gives its three roles one file): each export is a
single O_APPEND write, so lines from different processes never interleave.

A line:
    {"trace_id": "<32 hex>", "span_id": "<16 hex>", "parent_id": "<16 hex>" | null,
     "name": "round", "service": "specdec-orchestrator", "kind": "INTERNAL",
     "start_ns": 1700000000000000000, "end_ns": ..., "attributes": {...},
     "status": "UNSET" | "OK" | "ERROR", "links": [{"trace_id": ..., "span_id": ...}]}

Limitation: the file only grows; delete it (or point SPECD_TRACE_FILE
elsewhere) to start afresh.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

TRACE_FILE_ENV = "SPECD_TRACE_FILE"


def default_trace_file() -> Path:
    """`$SPECD_TRACE_FILE`, else `traces.jsonl` in the per-user cache
    (`~/.cache/specdec/traces.jsonl` on Linux): where `specd up` writes."""
    override = os.environ.get(TRACE_FILE_ENV)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("specdec")) / "traces.jsonl"


_encode = json.JSONEncoder(separators=(",", ":"), default=str).encode
# A resource's id: (the resource, its service name encoded). Holding the
# resource keeps its id from being reused by another while it is here.
_services: dict[int, tuple[object, str]] = {}


def span_line(span: ReadableSpan) -> str:
    """The span's JSON line (the module's docstring), formatted directly:
    the exporter runs for every span of every round, on a thread that shares
    the GIL with the event loop (tests/test_trace_file.py checks it byte for
    byte against json.dumps of the same fields)."""
    ctx, parent, resource = span.context, span.parent, span.resource
    known = _services.get(id(resource))
    if known is None:
        known = _services[id(resource)] = (resource, _encode(resource.attributes.get("service.name", "")))
    service = known[1]
    links = ",".join('{"trace_id":"%032x","span_id":"%016x"}' % (link.context.trace_id, link.context.span_id)
                     for link in span.links)
    attributes = span.attributes
    return ('{"trace_id":"%032x","span_id":"%016x","parent_id":%s,"name":%s,"service":%s,"kind":"%s",'
            '"start_ns":%d,"end_ns":%d,"attributes":%s,"status":"%s","links":[%s]}\n') % (
        ctx.trace_id, ctx.span_id, '"%016x"' % parent.span_id if parent is not None else "null",
        _encode(span.name), service, span.kind.name, span.start_time, span.end_time,  # an ended span's: ints
        _encode(dict(attributes)) if attributes else "{}", span.status.status_code.name, links)


class JsonLinesSpanExporter(SpanExporter):
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(span_line(s) for s in spans)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                view = memoryview(data.encode())
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def read_spans(path: str | os.PathLike) -> list[dict]:
    """Every span in the file; a torn last line (a process killed mid-write)
    is skipped."""
    spans = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                span = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(span, dict) and "trace_id" in span and "span_id" in span:
                spans.append(span)
    return spans


def group_traces(spans: Iterable[dict]) -> dict[str, list[dict]]:
    """Spans by trace id, each trace's spans in start order."""
    traces: dict[str, list[dict]] = {}
    for span in spans:
        traces.setdefault(span["trace_id"], []).append(span)
    for members in traces.values():
        members.sort(key=lambda s: s.get("start_ns") or 0)
    return traces
