"""Trace context in gRPC metadata, client side: the current span's W3C
`traceparent` rides on every call, so the services' spans join the caller's
trace. The server side is `Telemetry.server_span(name, context.invocation_metadata())`
in each traced handler; health checks have no handler span, so they are
never traced.

Why not opentelemetry-instrumentation-grpc: it does support grpc.aio, but it
opens one more span per RPC on each side (our named spans already cover each
call), wraps every servicer context in a proxy, and pins its beta release to
the SDK's. Propagation alone is these few lines.
"""
from __future__ import annotations

import grpc
from opentelemetry import context as context_api

from specdec.telemetry import Telemetry


def _with_trace_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    carrier: dict[str, str] = {}
    Telemetry.inject(carrier)
    if not carrier:  # no span is current: nothing to propagate
        return details
    return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), *carrier.items()))


class UnaryTraceContext(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_trace_context(client_call_details), request)


class StreamTraceContext(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_trace_context(client_call_details), request)


def trace_metadata() -> tuple[tuple[str, str], ...] | None:
    """The current span's trace context as a call's metadata (None when no
    span is current). The orchestrator's clients pass it on each call rather
    than through interceptors: an intercepted grpc.aio call costs about as
    much again as a plain one on loopback (`specd overhead`)."""
    if not context_api.get_current():  # nothing current (tracing off): nothing to carry, at no cost
        return None
    carrier: dict[str, str] = {}
    Telemetry.inject(carrier)
    return tuple(carrier.items()) or None


def carry_trace_context(message):
    """A lane or call-stream call `message` with the current span's trace
    context in its map, when there is one (an empty map argument to the
    message's constructor costs a call a microsecond: protobuf fills it in
    Python)."""
    carried = trace_metadata()
    if carried:
        message.trace_context.update(carried)
    return message


def client_interceptors(telemetry: Telemetry) -> list:
    """The interceptors of a channel: none when tracing is off, since
    intercepted grpc.aio calls cost more than plain ones. Two classes, not one:
    a grpc.aio channel files each interceptor under the FIRST call type it
    implements, so one class implementing both would never see a stream."""
    return [UnaryTraceContext(), StreamTraceContext()] if telemetry.tracing else []
