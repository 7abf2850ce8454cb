"""Trace context in gRPC metadata, client side: the current span's W3C
`traceparent` rides on every call (passed by the caller as the call's
metadata, or in a lane or call-stream call's own map), so the services'
spans join the caller's trace. The server side is `Telemetry.server_span(name, context.invocation_metadata())`
in each traced handler; health checks have no handler span, so they are
never traced.

Why not opentelemetry-instrumentation-grpc: it does support grpc.aio, but it
opens one more span per RPC on each side (our named spans already cover each
call), wraps every servicer context in a proxy, and pins its beta release to
the SDK's. Propagation alone is these few lines.
"""
from __future__ import annotations

from opentelemetry import context as context_api

from specdec.telemetry import Telemetry


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
