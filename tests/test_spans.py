"""specdec/spans.py: our spans skip the SDK's Span objects but export what
the SDK would: the same parents, kinds, attributes, links, events, statuses
and sampling decisions, through the provider's processors."""
from __future__ import annotations

import asyncio

import pytest
from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.status import Status, StatusCode

from specdec.spans import CurrentSpan, LeafSpan, SpanSink


def _pair(sampler=None):
    """Our sink and an SDK tracer on twin providers, each into its own exporter."""
    made = []
    for _ in range(2):
        exporter = InMemorySpanExporter()
        kwargs = {"sampler": sampler} if sampler is not None else {}
        provider = TracerProvider(resource=Resource.create({"service.name": "t"}), **kwargs)
        processor = SimpleSpanProcessor(exporter)
        provider.add_span_processor(processor)
        made.append((provider, processor, exporter))
    (ours, processor, ours_out), (sdk, _, sdk_out) = made
    return SpanSink(ours, [processor], InstrumentationScope("specdec")), ours_out, sdk.get_tracer("specdec"), sdk_out


def _shape(spans):
    by_id = {s.context.span_id: s.name for s in spans}
    return sorted((s.name, by_id.get(s.parent.span_id) if s.parent else None, s.kind, dict(s.attributes),
                   s.status.status_code, s.status.description, [e.name for e in s.events],
                   [by_id.get(link.context.span_id) for link in s.links], s.resource.attributes["service.name"])
                  for s in spans)


def test_a_tree_with_an_error_a_link_and_attributes_exports_as_the_sdks_does():
    sink, ours, tracer, sdk = _pair()

    def build(start):
        root = start("round", None, SpanKind.INTERNAL, {"k": 4, "none": None})
        root_context = trace.set_span_in_context(root)
        call = start("draft.propose", root_context, SpanKind.CLIENT, {"peer": "draft"})
        call.set_attribute("returned", 3)
        call.set_status(Status(StatusCode.ERROR, "UNAVAILABLE: gone"))
        call.record_exception(RuntimeError("gone"))
        call.end()
        other = start("verify_batch", root_context, SpanKind.CLIENT, None, [Link(call.get_span_context())])
        root.add_link(other.get_span_context())
        other.set_status(Status(StatusCode.OK))
        other.set_status(Status(StatusCode.ERROR, "after OK: ignored"))
        other.end()
        root.set_attributes({"accepted": 2})
        root.end()
        root.set_attribute("after the end", 1)  # ignored, as by the SDK

    build(sink.start)
    build(lambda name, parent, kind, attributes, links=(): tracer.start_span(
        name, context=parent, kind=kind, attributes={k: v for k, v in (attributes or {}).items() if v is not None},
        links=links))
    assert _shape(ours.get_finished_spans()) == _shape(sdk.get_finished_spans())
    spans = {s.name: s for s in ours.get_finished_spans()}
    assert spans["draft.propose"].parent.span_id == spans["round"].context.span_id
    assert spans["draft.propose"].context.trace_id == spans["round"].context.trace_id
    assert spans["draft.propose"].events[0].attributes["exception.type"] == "RuntimeError"
    assert spans["round"].instrumentation_scope.name == "specdec"


def test_a_sampler_that_drops_gives_a_span_that_records_nothing_but_still_propagates():
    sink, ours, _, _ = _pair(sampler=ParentBased(ALWAYS_OFF))
    span = sink.start("round")
    assert not span.is_recording() and span.get_span_context().is_valid
    assert not span.get_span_context().trace_flags.sampled
    span.end()
    assert ours.get_finished_spans() == ()


def test_current_and_leaf_spans_nest_record_errors_and_end_on_the_next_turn():
    sink, ours, _, _ = _pair()

    async def main():
        with pytest.raises(ValueError):
            with CurrentSpan(sink.start("round")) as root:
                assert trace.get_current_span() is root
                with LeafSpan(sink, "accept", context_api.get_current(), None, SpanKind.INTERNAL, {"n": 1}) as leaf:
                    leaf.set_attribute("accepted", 2)
                raise ValueError("bad round")
        assert ours.get_finished_spans() == ()  # built and ended on the loop's next turn
        await asyncio.sleep(0)
        return root

    root = asyncio.run(main())
    spans = {s.name: s for s in ours.get_finished_spans()}
    assert spans["accept"].parent.span_id == root.get_span_context().span_id
    assert dict(spans["accept"].attributes) == {"n": 1, "accepted": 2}
    assert spans["round"].status.status_code is StatusCode.ERROR and "bad round" in spans["round"].status.description
    assert [e.name for e in spans["round"].events] == ["exception"]
    # A leaf whose caller sent no trace context is the root of a trace of its own.
    LeafSpan(sink, "propose", None, {}, SpanKind.SERVER, None).__enter__().__exit__(None, None, None)
    alone = [s for s in ours.get_finished_spans() if s.name == "propose"][0]
    assert alone.parent is None and alone.context.trace_id != root.get_span_context().trace_id


def test_our_spans_encode_for_an_otlp_collector_and_the_console():
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    sink, ours, _, _ = _pair()
    root = sink.start("round", None, SpanKind.INTERNAL, {"k": 4, "share": 0.5, "peer": "draft", "fallback": False})
    call = sink.start("x", trace.set_span_in_context(root), SpanKind.CLIENT, None, [Link(root.get_span_context())])
    call.record_exception(ValueError("v"))
    call.end()
    root.end()
    encoded = encode_spans(ours.get_finished_spans())
    spans = encoded.resource_spans[0].scope_spans[0]
    assert spans.scope.name == "specdec" and [s.name for s in spans.spans] == ["x", "round"]
    assert spans.spans[0].parent_span_id == root.get_span_context().span_id.to_bytes(8, "big")
    assert len(spans.spans[0].links) == 1 and spans.spans[0].events[0].name == "exception"
    assert '"name": "round"' in ours.get_finished_spans()[1].to_json()


def test_flags_cleaned_attributes_and_invalid_links_are_the_sdks():
    sink, ours, tracer, sdk = _pair()
    numpy = pytest.importorskip("numpy")
    values = {"ids": [1, 2], "mixed": [1, "a"], "n": numpy.int64(3), "m": {"x": 1}}
    invalid = Link(trace.INVALID_SPAN_CONTEXT)
    mine = sink.start("s", None, SpanKind.INTERNAL, values, [invalid])
    theirs = tracer.start_span("s", attributes=values, links=[invalid])
    assert mine.get_span_context().trace_flags == theirs.get_span_context().trace_flags  # W3C's random-id bit too
    for span in (mine, theirs):  # set later, one at a time and several at once: cleaned alike
        span.set_attribute("later", numpy.float32(0.5))
        span.set_attributes({"more": (numpy.int64(1), 2), "plain": 3})
    mine.end()
    theirs.end()
    (a,), (b,) = ours.get_finished_spans(), sdk.get_finished_spans()
    assert dict(a.attributes) == dict(b.attributes) and len(a.links) == len(b.links) == 0


def test_the_sdks_own_off_switch_turns_tracing_off(monkeypatch, tmp_path):
    from specdec.telemetry import TelemetrySettings, setup_telemetry

    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    telemetry = setup_telemetry("t", TelemetrySettings(tracing=True, trace_file=str(tmp_path / "t.jsonl")))
    assert not telemetry.tracing


@pytest.mark.parametrize("sampler", [None, ParentBased(ALWAYS_OFF)], ids=["default sampler", "another sampler"])
def test_sampling_decisions_and_trace_state_under_every_kind_of_parent_are_the_sdks(sampler):
    """The default parent-based always-on sampler is decided without the
    SDK's calls (SpanSink.parent_based_always_on); any other goes through
    the sampler. Either way a span's context (sampled or not, trace state)
    and whether it records are what the SDK's tracer gives."""
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    sink, _, tracer, _ = _pair(sampler)
    assert sink.parent_based_always_on is (sampler is None)
    state = TraceState([("vendor", "opaque")])
    parents = [None]
    for remote in (True, False):
        for flags in (TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID, TraceFlags.DEFAULT):
            for trace_state in (None, state):
                context = SpanContext(0xABC, 0xDEF, is_remote=remote, trace_flags=TraceFlags(flags),
                                      trace_state=trace_state)
                parents.append(trace.set_span_in_context(NonRecordingSpan(context)))
    for parent in parents:
        ours = sink.start("s", parent if parent is not None else context_api.Context())
        theirs = tracer.start_span("s", parent if parent is not None else context_api.Context())
        a, b = ours.get_span_context(), theirs.get_span_context()
        assert (ours.is_recording(), a.trace_flags, a.trace_state, a.is_remote) == \
            (theirs.is_recording(), b.trace_flags, b.trace_state, b.is_remote)
        if parent is not None:
            assert a.trace_id == b.trace_id == 0xABC
        ours.end()
        theirs.end()


def test_a_sampler_that_only_describes_itself_as_the_default_goes_through_its_own_calls():
    """Told apart by what it is, not by its description: a root sampler that
    calls itself AlwaysOnSampler but adds attributes keeps them."""
    from opentelemetry.sdk.trace.sampling import Decision, SamplingResult, Sampler

    class Tagging(Sampler):
        def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                          trace_state=None):
            return SamplingResult(Decision.RECORD_AND_SAMPLE, {"sampler.added": 1})

        def get_description(self):
            return "AlwaysOnSampler"

    sink, _, tracer, _ = _pair(ParentBased(Tagging()))
    assert not sink.parent_based_always_on
    ours = sink.start("s", context_api.Context())
    assert dict(ours.attributes) == {"sampler.added": 1}
