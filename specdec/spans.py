"""Our spans, made without the OpenTelemetry SDK's Span objects.

Tracing is on by default, and a round's spans were the largest cost outside
the models: `specd overhead`'s CPU split read 720-870 µs of CPU a round with
tracing on against tracing off, most of it the SDK's per-span machinery
(a Span with locked, bounded attribute and event containers, its start and
end hooks, then a second, read-only copy of it for the processors), run
with cold caches between the models' steps. A span here is a small object
that collects what the span says; when it ends it becomes the SDK's
`ReadableSpan` once and goes straight to the provider's span processors
(batching, exporters), so what is exported is what the SDK would export:
the same ids, parents, sampling decisions (the provider's sampler), kinds,
attributes, links, events and statuses.

`SpanSink` starts spans for a provider; `CurrentSpan` makes one current
inside a `with`; `LeafSpan` builds a span that has no children only after it
ended, off the caller's path. `NO_SPAN` is what every one of them is when
tracing is off.
"""
from __future__ import annotations

import asyncio
import time
import traceback
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Mapping, Sequence

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, StaticSampler
from opentelemetry.trace import INVALID_SPAN, Link, NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from specdec import trace_context

# One reusable "span" for disabled tracing: entering it costs a method call.
NO_SPAN = nullcontext(INVALID_SPAN)
_UNSET = Status(StatusCode.UNSET)


def _is_parent_based_always_on(sampler) -> bool:
    """Whether `sampler` is the SDK's default: parent-based, its root and
    sampled parents always on, unsampled parents always off (the SDK's own
    static samplers, not merely ones that describe themselves alike)."""
    if type(sampler) is not ParentBased:
        return False
    parts = [getattr(sampler, f"_{name}", None) for name in
             ("root", "remote_parent_sampled", "local_parent_sampled", "remote_parent_not_sampled",
              "local_parent_not_sampled")]
    return all(type(part) is StaticSampler for part in parts) and [p._decision for p in parts] == \
        [Decision.RECORD_AND_SAMPLE] * 3 + [Decision.DROP] * 2


class SpanSink:
    """Starts spans as the provider's tracer would (its sampler, its ids),
    and hands each ended one to the provider's span processors."""

    def __init__(self, provider, processors: Sequence, scope):
        self.resource = provider.resource
        self.sampler = provider.sampler
        # The SDK's default sampler (parent-based, always on), decided here
        # without its calls: a child is sampled as its parent is, a root always.
        self.parent_based_always_on = _is_parent_based_always_on(self.sampler)
        self.ids = provider.id_generator
        self.processors = tuple(processors)
        self.scope = scope

    def start(self, name: str, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
              attributes: Mapping | None = None, links: Sequence[Link] = (),
              start_time: int | None = None) -> trace.Span:
        """A started span, child of the span current in `parent` (default:
        the current context), or the root of a new trace."""
        parent_context = _parent_span_context(parent)
        valid = parent_context.is_valid
        trace_id = parent_context.trace_id if valid else self.ids.generate_trace_id()
        # as the SDK: an invalid link is dropped
        links = [link for link in links if link.context.is_valid] if links else []
        parent_flags = parent_context.trace_flags
        if self.parent_based_always_on:  # records what it samples: a child as its parent, a root always
            recording = is_sampled = parent_flags.sampled if valid else True
            trace_state, extra = (parent_context.trace_state if valid else None), None
        else:
            sampled = self.sampler.should_sample(parent, trace_id, name, kind, attributes, links)
            recording, is_sampled = sampled.decision.is_recording(), sampled.decision.is_sampled()
            trace_state, extra = sampled.trace_state, sampled.attributes
        # W3C's random-trace-id flag, as the SDK sets it: a root's from the id
        # generator, a child's from its parent.
        random_id = parent_flags.random_trace_id if valid else self.ids.is_trace_id_random()
        context = SpanContext(trace_id, self.ids.generate_span_id(), is_remote=False,
                              trace_flags=_FLAGS[bool(is_sampled), bool(random_id)], trace_state=trace_state)
        if not recording:
            return NonRecordingSpan(context)  # its context still propagates, as the SDK's does
        if extra:
            attributes = {**(attributes or {}), **extra}
        values = {k: v if type(v) in _PLAIN else _clean(v) for k, v in attributes.items() if v is not None} \
            if attributes else {}
        return _Span(self, name, context, parent_context if valid else None, kind, values, links,
                     start_time or time.time_ns())

    def finish(self, span: "_Span") -> None:
        readable = ReadableSpan(name=span.name, context=span.context, parent=span.parent, resource=self.resource,
                                attributes=span.attributes, events=span.events, links=span.links, kind=span.kind,
                                status=span.status, start_time=span.start_time, end_time=span.end_time,
                                instrumentation_scope=self.scope)
        for processor in self.processors:
            processor.on_end(readable)


# A span's trace flags by (sampled, random trace id): made once, not per span.
_FLAGS = {(sampled, random_id): TraceFlags((TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
                                           | (TraceFlags.RANDOM_TRACE_ID if random_id else 0))
          for sampled in (False, True) for random_id in (False, True)}
# The key under which a Context holds its current span, read through the API
# once (the API's own lookup also checks the value's type through its ABC on
# every call: a third of a span's start).
(_SPAN_KEY,) = trace.set_span_in_context(INVALID_SPAN, Context()).keys()


def _parent_span_context(parent: Context | None) -> SpanContext:
    """`trace.get_current_span(parent).get_span_context()`, with our own spans
    and an empty context answered without the API's calls."""
    span = (parent if parent is not None else context_api.get_current()).get(_SPAN_KEY)
    if type(span) is _Span:
        return span.context
    if span is None:
        return INVALID_SPAN.get_span_context()
    return trace.get_current_span(parent).get_span_context()  # any other kind of span, as the API reads it


class _Span(trace.Span):
    """A recording span: what it is told until it ends, then `SpanSink.finish`."""

    __slots__ = ("sink", "name", "context", "parent", "kind", "attributes", "links", "events", "status",
                 "start_time", "end_time")

    def __init__(self, sink: SpanSink, name: str, context: SpanContext, parent: SpanContext | None,
                 kind: SpanKind, attributes: dict, links: list, start_time: int):
        self.sink = sink
        self.name = name
        self.context = context
        self.parent = parent
        self.kind = kind
        self.attributes = attributes
        self.links = links
        self.events: list[Event] = []
        self.status = _UNSET
        self.start_time = start_time
        self.end_time: int | None = None

    def get_span_context(self) -> SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attributes(self, attributes: Mapping) -> None:
        if self.end_time is None:
            for key, value in attributes.items():
                if value is not None:
                    self.attributes[key] = value if type(value) in _PLAIN else _clean(value)

    def set_attribute(self, key: str, value) -> None:
        if self.end_time is None and value is not None:
            self.attributes[key] = value if type(value) in _PLAIN else _clean(value)

    def add_event(self, name: str, attributes: Mapping | None = None, timestamp: int | None = None) -> None:
        if self.end_time is None:
            self.events.append(Event(name, dict(attributes or {}), timestamp or time.time_ns()))

    def add_link(self, context: SpanContext, attributes: Mapping | None = None) -> None:
        if self.end_time is None and context.is_valid:
            self.links.append(Link(context, attributes))

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def set_status(self, status, description: str | None = None) -> None:
        if self.end_time is not None:
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if self.status.status_code is StatusCode.OK:
            return  # as the SDK: OK is final
        if status.status_code is StatusCode.UNSET:
            return
        self.status = status

    def record_exception(self, exception: BaseException, attributes: Mapping | None = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        """As the SDK records one: an "exception" event with its type, message and stack."""
        module, name = type(exception).__module__, type(exception).__qualname__
        values = {"exception.type": f"{module}.{name}" if module and module != "builtins" else name,
                  "exception.message": str(exception),
                  "exception.stacktrace": "".join(traceback.format_exception(exception)),
                  "exception.escaped": str(escaped), **(attributes or {})}
        self.add_event("exception", values, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            return
        self.end_time = end_time or time.time_ns()
        self.sink.finish(self)


class CurrentSpan:
    """A span current inside a `with`: an exception is recorded and sets
    ERROR, the span ends on exit (its end time then; handing it to the
    processors on the event loop's next turn, when the work that follows,
    the next call sent, is on its way)."""

    __slots__ = ("span", "_token")

    def __init__(self, span: trace.Span):
        self.span = span

    def __enter__(self) -> trace.Span:
        self._token = context_api.attach(trace.set_span_in_context(self.span))
        return self.span

    def __exit__(self, exc_type, exc, tb) -> bool:
        context_api.detach(self._token)
        _end(self.span, exc)
        return False


def _end(span: trace.Span, exc: BaseException | None) -> None:
    """End a span a `with` held: its error recorded (like the SDK, only an
    Exception: a GeneratorExit or a cancellation is not an error), its end
    time now, handed to the processors on the loop's next turn."""
    if isinstance(exc, Exception) and span.is_recording():
        record_error(span, exc)
    on_next_turn(span.end, time.time_ns())


class OwnedSpan:
    """A span that a `with` ends but never makes current in the task that
    holds it: work that runs under it is handed `context` (a task created
    in it). For an async generator handler, whose `with CurrentSpan` would
    span its yields: grpc cancels the handler's task during a write, leaving
    the generator suspended, and whoever closes it later runs the detach in
    another context ("Failed to detach context", at ERROR)."""

    __slots__ = ("span", "context")

    def __init__(self, span: trace.Span):
        self.span = span
        self.context = trace.set_span_in_context(span)

    def __enter__(self) -> "OwnedSpan":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        _end(self.span, exc)
        return False


# `OwnedSpan` with tracing off: no span, and no context to run under.
NO_OWNED_SPAN = nullcontext(SimpleNamespace(span=INVALID_SPAN, context=None))


class LeafSpan:
    """A span that has no children, built once it has ended: inside it only
    its start time and attributes are noted, and the span itself is made on
    the event loop's next turn (or at once with no loop running). A
    service's span of a call then costs its reply almost nothing: the reply
    is on its way before the span is built. The span is never current, so
    nothing may be traced inside it; the same errors are recorded as by
    `CurrentSpan`."""

    __slots__ = ("_sink", "_name", "_parent", "_carrier", "_kind", "_attributes", "_start")

    def __init__(self, sink: SpanSink, name: str, parent: Context | None, carrier: dict | None, kind: SpanKind,
                 attributes: Mapping | None):
        self._sink = sink
        self._name = name
        self._parent = parent  # the context to parent to, when there is no carrier to extract one from
        self._carrier = carrier  # a caller's trace context (W3C), extracted when the span is built
        self._kind = kind
        self._attributes = dict(attributes or {})

    def __enter__(self):
        self._start = time.time_ns()
        return self

    def is_recording(self) -> bool:
        return True

    def set_attribute(self, key: str, value) -> None:
        self._attributes[key] = value

    def set_attributes(self, attributes: Mapping) -> None:
        self._attributes.update(attributes)

    def __exit__(self, exc_type, exc, tb) -> bool:
        error = exc if isinstance(exc, Exception) else None  # as CurrentSpan: not a cancellation
        on_next_turn(self._build, time.time_ns(), error)
        return False

    def _build(self, end: int, error: Exception | None) -> None:
        parent = trace_context.extract(self._carrier) if self._carrier is not None else self._parent
        if parent is None:
            parent = Context()  # a root, not a child of whatever is current on the next turn
        span = self._sink.start(self._name, parent, self._kind, self._attributes, start_time=self._start)
        if error is not None and span.is_recording():
            record_error(span, error, timestamp=end)
        span.end(end_time=end)


_PLAIN = (str, bool, int, float, bytes)


def _clean(value):
    """An attribute's value as the SDK keeps it: a plain value as it is, a
    sequence as a tuple, a mapping as it is, anything else (a numpy number)
    as its text, which is what the SDK falls back to."""
    kind = type(value)
    if kind in _PLAIN or isinstance(value, Mapping):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(v if type(v) in _PLAIN or v is None else str(v) for v in value)
    return str(value)


def record_error(span: trace.Span, exc: Exception, timestamp: int | None = None) -> None:
    span.record_exception(exc, timestamp=timestamp)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def on_next_turn(fn, *args) -> None:
    """`fn(*args)` on the running event loop's next turn; at once where no loop runs."""
    try:
        asyncio.get_running_loop().call_soon(fn, *args)
    except RuntimeError:  # no event loop in this thread
        fn(*args)
