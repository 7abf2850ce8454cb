"""specdec/trace_context.py: the W3C trace context every call carries,
written and read directly when the default propagator is in use, always
with the result OpenTelemetry's global propagator gives."""
from __future__ import annotations

import pytest
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as context_api
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from specdec import trace_context

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
HEADERS = [
    f"00-{TRACE}-{SPAN}-01",  # the common case: read directly
    f"00-{TRACE}-{SPAN}-00",  # not sampled
    f"00-{TRACE}-{SPAN}-03",  # sampled, random trace id
    f"00-{'0' * 32}-{SPAN}-01",  # invalid: a zero trace id
    f"00-{TRACE}-{'0' * 16}-01",  # invalid: a zero span id
    f"00-{TRACE.upper()}-{SPAN}-01",  # invalid: upper-case hex
    f"  00-{TRACE}-{SPAN}-01 ",  # spaces around: the propagator accepts them
    f"00-{TRACE}-{SPAN}-01-extra",  # version 00 has exactly four fields
    f"01-{TRACE}-{SPAN}-01-later-fields",  # a later version may have more
    f"ff-{TRACE}-{SPAN}-01",  # version ff is invalid
    f"00-{TRACE}-{SPAN}",  # truncated
    "",
    "garbage",
]


def _read(context) -> tuple:
    span_context = trace.get_current_span(context).get_span_context()
    return (span_context, span_context.is_remote, span_context.trace_state.to_header(), dict(baggage.get_all(context)))


@pytest.mark.parametrize("header", HEADERS)
@pytest.mark.parametrize("others", [{}, {"tracestate": "vendor=opaque,other=x"}, {"baggage": "user=alice"},
                                    {"user-agent": "grpc-python"}])
def test_extract_reads_what_the_global_propagator_reads(header, others):
    carrier = {"traceparent": header, **others}
    assert _read(trace_context.extract(carrier)) == _read(propagate.extract(carrier))


def test_extract_without_a_traceparent_is_an_empty_context():
    assert trace_context.extract({}) == propagate.extract({}) == context_api.Context()
    assert _read(trace_context.extract({"baggage": "a=b"})) == _read(propagate.extract({"baggage": "a=b"}))


def _contexts():
    state = TraceState([("vendor", "opaque")])
    for flags in (TraceFlags.SAMPLED, TraceFlags.DEFAULT, TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID)):
        for trace_state in (None, state):
            span = NonRecordingSpan(SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0xF067AA0BA902B7, is_remote=False,
                                                trace_flags=flags, trace_state=trace_state))
            context = trace.set_span_in_context(span)
            yield context
            yield baggage.set_baggage("user", "alice", context)
    yield context_api.Context()  # no span: nothing is written
    yield baggage.set_baggage("user", "alice", context_api.Context())


@pytest.mark.parametrize("context", list(_contexts()))
def test_inject_writes_what_the_global_propagator_writes(context):
    ours, theirs = {}, {}
    trace_context.inject(ours, context)
    propagate.inject(theirs, context)
    assert ours == theirs
    token = context_api.attach(context)  # and from the current context
    try:
        current = {}
        trace_context.inject(current)
    finally:
        context_api.detach(token)
    assert current == theirs


def test_another_propagator_set_globally_is_used_as_it_is():
    """Trace context alone (no baggage): the fast path is off, and baggage
    is neither written nor read, as that propagator does."""
    previous = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator([TraceContextTextMapPropagator()]))
    try:
        context = baggage.set_baggage("user", "alice", next(_contexts()))
        ours, theirs = {}, {}
        trace_context.inject(ours, context)
        propagate.inject(theirs, context)
        assert ours == theirs and "baggage" not in ours
        carrier = {"traceparent": HEADERS[0], "baggage": "user=alice"}
        assert _read(trace_context.extract(carrier)) == _read(propagate.extract(carrier))
        assert not baggage.get_all(trace_context.extract(carrier))
    finally:
        propagate.set_global_textmap(previous)
    assert trace_context._default_propagator()


def test_specd_keeps_a_clients_malformed_baggage_out_of_its_logs(tmp_path, monkeypatch, capsys):
    """OpenTelemetry warns once per malformed member of a `baggage` header:
    one 8 KB header from any client wrote 181 lines to a role's log."""
    import logging

    from specdec.cli.main import main as specd

    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))
    assert specd(["models", "list"]) == 0
    assert not logging.getLogger("opentelemetry.baggage.propagation").isEnabledFor(logging.WARNING)
