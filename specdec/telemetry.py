"""OpenTelemetry for the three roles: one `Telemetry` per role, holding its
tracer and its metric instruments, handed explicitly to the servicers.

Nothing here sets OpenTelemetry's global providers and nothing starts a
server: `setup_telemetry()` builds providers from settings (the standard
OTEL_* environment plus SPECD_TRACING and SPECD_TRACE_FILE), and tests pass
their in-memory exporters and readers instead. Code that is given no
Telemetry uses `NOOP`, which traces and measures nothing.

Span and attribute names are defined once, below; docs/observability.md
carries the same table. Session ids are never recorded: they are bearer
tokens (whoever knows one can drive the session).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Sequence

from opentelemetry import context as context_api
from opentelemetry.context import Context
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.trace import Link, SpanKind

from specdec import trace_context
from specdec.metrics import Metrics
from specdec.spans import NO_OWNED_SPAN, NO_SPAN, CurrentSpan, LeafSpan, OwnedSpan, SpanSink
from specdec.trace_file import DEFAULT_KEEP, DEFAULT_MAX_BYTES, keep_from_env, max_bytes_from_env

# --------------------------------------------------------------- services

SERVICE_DRAFT = "specdec-draft"
SERVICE_TARGET = "specdec-target"
SERVICE_ORCHESTRATOR = "specdec-orchestrator"

# ------------------------------------------------------------------ spans

# orchestrator
SPAN_GENERATE = "generate"  # one per Generate: the root of a request's trace
SPAN_SESSION_OPEN = "session.open"  # client side of OpenSession (attribute specdec.peer)
SPAN_SESSION_CLOSE = "session.close"  # client side of CloseSession
SPAN_ROUND = "round"  # one speculative round
SPAN_DRAFT_PROPOSE = "draft.propose"  # client side of Propose
SPAN_TARGET_VERIFY = "target.verify"  # this request's verify, batching wait included
SPAN_VERIFY_BATCH = "verify.batch"  # client side of one batched Verify RPC
SPAN_ACCEPT = "accept"  # the accept/reject decisions of a round
SPAN_TARGET_RECOVER = "target.recover"  # re-opening a failed target session on a live replica
# draft and target services (server side)
SPAN_PREFILL = "prefill"  # OpenSession: create the session, prefill the prompt
SPAN_PROPOSE = "propose"
SPAN_VERIFY = "verify"
SPAN_DECODE = "decode"
SPAN_ROLLBACK = "rollback"
SPAN_CLOSE = "close"

# ------------------------------------------------------------- attributes

# OpenTelemetry GenAI semantic conventions (on `generate`)
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_TOP_P = "gen_ai.request.top_p"
GEN_AI_TOP_K = "gen_ai.request.top_k"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
# OpenTelemetry HTTP semantic conventions (on `generate`, for requests through the HTTP front door)
HTTP_REQUEST_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
URL_PATH = "url.path"
URL_SCHEME = "url.scheme"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
CLIENT_ADDRESS = "client.address"
USER_AGENT = "user_agent.original"
NETWORK_PROTOCOL_VERSION = "network.protocol.version"
ERROR_TYPE = "error.type"
# ours
A_REQUEST_ID = "specdec.request_id"
A_SEED = "specdec.seed"
A_POLICY = "specdec.policy"
A_DRAFT_MODEL = "specdec.draft.model"
A_ROUNDS = "specdec.rounds"
A_PROPOSED = "specdec.proposed_tokens"
A_ACCEPTED_TOKENS = "specdec.accepted_tokens"
A_ACCEPTANCE_RATE = "specdec.acceptance_rate"
A_FALLBACK_ROUNDS = "specdec.fallback_rounds"
A_TTFT = "specdec.time_to_first_token_s"
A_PEER = "specdec.peer"  # draft | target: the service a client span calls
A_CARRIER = "specdec.carrier"  # lane | stream | unary: how a round's call went (specdec/rpc/lane.py, call_stream.py)
A_ROUND = "specdec.round"  # 0-based index of the round in its request
A_K = "specdec.k"  # k = num_draft_tokens asked for (the policy's choice after caps)
A_RETURNED = "specdec.draft.returned"  # draft tokens actually proposed
A_MIN_CONFIDENCE = "specdec.draft.min_confidence"  # the early stop asked of the draft (0: none)
A_ACCEPTED = "specdec.accepted"  # draft tokens accepted in the round
A_EMITTED = "specdec.emitted"  # tokens the round emitted (accepted + 1)
A_RECOVERED_ON = "specdec.recovered_on"  # target.recover: the replica the session was re-opened on
A_FAILED_REPLICA = "specdec.failed_replica"  # target.recover: the replica that failed
A_FALLBACK = "specdec.fallback"  # the round ran without the draft (it failed)
A_PLAIN = "specdec.plain"  # the speculation gate had the round decode plainly (orchestrator/speculation_gate.py)
A_BATCH_ITEMS = "specdec.batch.items"  # verify items (requests) in one Verify RPC
A_BATCH_SESSIONS = "specdec.batch.sessions"  # sessions in the target's forward pass; prefill: opened in its job
A_FORWARD_S = "specdec.forward_s"  # target: compute time of the call, seconds
A_PROMPT_TOKENS = "specdec.prompt_tokens"
A_KV_BYTES = "specdec.kv_bytes"
A_KEEP_LENGTH = "specdec.keep_length"
A_APPENDED = "specdec.appended_tokens"
A_TOKENS = "specdec.tokens"  # tokens a propose/decode call produced
A_LENGTH = "specdec.length"  # session length after the call

# ---------------------------------------------------------------- settings

def _exporter_names(var: str, signal: str, env: Mapping[str, str]) -> tuple[str, ...]:
    """OTEL_<SIGNAL>_EXPORTER as a tuple of names. Unset means OTLP only when
    an OTLP endpoint is configured: a local `specd serve` with no collector
    should not log export failures."""
    value = env.get(var)
    if value is None:
        endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
        return ("otlp",) if any(env.get(e) for e in endpoints) else ()
    names = tuple(n.strip().lower() for n in value.split(",") if n.strip())
    return tuple(n for n in names if n != "none")


def _off(value: str) -> bool:
    return value.strip().lower() in ("off", "0", "false", "no")


def _on(value: str) -> bool:
    return value.strip().lower() in ("on", "1", "true", "yes")


@dataclass(frozen=True)
class TelemetrySettings:
    """What to trace and where to send it (see `from_env`)."""

    tracing: bool = True  # SPECD_TRACING=off: a no-op tracer, no spans at all
    trace_file: str = ""  # SPECD_TRACE_FILE: append spans as JSON lines here
    trace_file_max_bytes: int = DEFAULT_MAX_BYTES  # SPECD_TRACE_FILE_MAX_BYTES: rotate it past this (0: never)
    trace_file_keep: int = DEFAULT_KEEP  # SPECD_TRACE_FILE_KEEP: rotated files kept, <file>.1 ...
    traces_exporter: tuple[str, ...] = ()  # otlp, console
    metrics_exporter: tuple[str, ...] = ()  # otlp, console (Prometheus: --metrics-port)
    traces_protocol: str = "grpc"  # grpc | http/protobuf
    metrics_protocol: str = "grpc"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "TelemetrySettings":
        env = os.environ if env is None else env
        proto = env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        return cls(
            tracing=not _off(env.get("SPECD_TRACING", "on")),
            trace_file=env.get("SPECD_TRACE_FILE", ""),
            trace_file_max_bytes=max_bytes_from_env(env),
            trace_file_keep=keep_from_env(env),
            traces_exporter=_exporter_names("OTEL_TRACES_EXPORTER", "TRACES", env),
            metrics_exporter=_exporter_names("OTEL_METRICS_EXPORTER", "METRICS", env),
            traces_protocol=env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", proto),
            metrics_protocol=env.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", proto),
        )


# --------------------------------------------------------------- telemetry

class Telemetry:
    """A role's tracer and instruments. Without a tracer provider it traces
    nothing; without a meter provider its instruments are no-ops."""

    def __init__(self, service: str, tracer_provider=None, meter_provider=None, span_processors: Sequence = ()):
        self.service = service
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.tracing = tracer_provider is not None
        self._sink = None
        if self.tracing:
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope

            # Spans go straight to the provider's processors (specdec/spans.py);
            # without a list of them, to the provider's own fan-out.
            processors = span_processors or (tracer_provider._active_span_processor,)
            self._sink = SpanSink(tracer_provider, processors, InstrumentationScope("specdec"))
        meter = (meter_provider or NoOpMeterProvider()).get_meter("specdec")
        self.metrics = Metrics(meter)

    def span(self, name: str, attributes: Mapping | None = None, *, parent: Context | None = None,
             kind: SpanKind = SpanKind.INTERNAL, links: Sequence[Link] = ()):
        """A context manager yielding a span that is current inside it;
        `parent` (a Context) overrides the current one."""
        if not self.tracing:
            return NO_SPAN
        return CurrentSpan(self._sink.start(name, parent, kind, attributes, links))

    def server_span(self, name: str, metadata, attributes: Mapping | None = None):
        """The span of an RPC handler, child of the caller's span when the
        call's metadata (iterable of (key, value)) carries a trace context."""
        if not self.tracing:
            return NO_SPAN
        parent = trace_context.extract({key: value for key, value in metadata or ()})
        return CurrentSpan(self._sink.start(name, parent, SpanKind.SERVER, attributes))

    def owned_server_span(self, name: str, metadata, attributes: Mapping | None = None):
        """`server_span` that is not made current (`OwnedSpan`): for a
        streaming handler that runs its work in a task of its own, under the
        span's `context`."""
        if not self.tracing:
            return NO_OWNED_SPAN
        parent = trace_context.extract({key: value for key, value in metadata or ()})
        return OwnedSpan(self._sink.start(name, parent, SpanKind.SERVER, attributes))

    def leaf_server_span(self, name: str, metadata, attributes: Mapping | None = None):
        """`server_span` for a handler that traces nothing inside it: the
        span is built after the handler, off the reply's path (`LeafSpan`)."""
        if not self.tracing:
            return NO_SPAN
        return LeafSpan(self._sink, name, None, {key: value for key, value in metadata or ()}, SpanKind.SERVER,
                        attributes)

    def leaf_span(self, name: str, attributes: Mapping | None = None):
        """`span` for work that traces nothing inside it, a child of the
        current span, built once it has ended (`LeafSpan`)."""
        if not self.tracing:
            return NO_SPAN
        return LeafSpan(self._sink, name, context_api.get_current(), None, SpanKind.INTERNAL, attributes)

    @staticmethod
    def inject(carrier: dict) -> None:
        """Write the current trace context into `carrier` (W3C traceparent)."""
        trace_context.inject(carrier)

    def force_flush(self, timeout_s: float = 10.0) -> None:
        for provider in (self.tracer_provider, self.meter_provider):
            if provider is not None:
                provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Flush and stop the exporters (spans still queued are written)."""
        for provider in (self.tracer_provider, self.meter_provider):
            if provider is not None:
                provider.shutdown()


NOOP = Telemetry("specdec")


def setup_telemetry(service_name: str, settings: TelemetrySettings | None = None, *,
                    span_exporters: Sequence = (), metric_readers: Sequence = ()) -> Telemetry:
    """A role's Telemetry from settings (default: the environment).

    `span_exporters` are added with a SimpleSpanProcessor (synchronous: what
    tests want); `metric_readers` (an InMemoryMetricReader, the Prometheus
    reader) are added to the meter provider. OTEL_SERVICE_NAME, when set,
    overrides `service_name`.
    """
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    settings = settings or TelemetrySettings.from_env()
    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or service_name})
    tracer_provider, span_processors = (_tracer_provider(resource, settings, span_exporters)
                                        if _tracing_on(settings) else (None, ()))
    meter_provider = _meter_provider(resource, settings, metric_readers)
    return Telemetry(service_name, tracer_provider, meter_provider, span_processors)


def _tracing_on(settings: TelemetrySettings) -> bool:
    """SPECD_TRACING and the SDK's own switch, OTEL_SDK_DISABLED: asked
    before any span processor is built, since a BatchSpanProcessor starts its
    worker thread (and an OTLP exporter its channel) as it is made, and one
    made only to be dropped is never shut down."""
    return settings.tracing and not _on(os.environ.get("OTEL_SDK_DISABLED", ""))


def _tracer_provider(resource, settings: TelemetrySettings, span_exporters: Sequence):
    """The provider and its span processors; (None, ()) when no exporter is
    configured: spans nobody reads cost the same as exported ones, so
    tracing is then off. Only called with tracing on (`_tracing_on`)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    processors = [SimpleSpanProcessor(e) for e in span_exporters]
    for name in settings.traces_exporter:
        processors.append(BatchSpanProcessor(_span_exporter(name, settings.traces_protocol)))
    if settings.trace_file:
        from specdec.trace_file import JsonLinesSpanExporter

        # A short delay so `specd trace show` sees a request soon after it ends.
        processors.append(BatchSpanProcessor(JsonLinesSpanExporter(settings.trace_file, settings.trace_file_max_bytes,
                                                                     settings.trace_file_keep),
                                               schedule_delay_millis=500))
    if not processors:
        return None, ()
    provider = TracerProvider(resource=resource)  # sampler: OTEL_TRACES_SAMPLER, default parent-based always-on
    for processor in processors:
        provider.add_span_processor(processor)  # for the provider's flush and shutdown
    return provider, tuple(processors)


def _span_exporter(name: str, protocol: str):
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter {name!r} (use otlp, console or none)")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"OTLP protocol {protocol!r} is not supported (use grpc or http/protobuf)")
    return OTLPSpanExporter()  # endpoint, headers, TLS: from OTEL_EXPORTER_OTLP_*


def _meter_provider(resource, settings: TelemetrySettings, metric_readers: Sequence):
    readers = list(metric_readers)
    for name in settings.metrics_exporter:
        readers.append(_periodic_reader(name, settings.metrics_protocol))
    if not readers:
        return None
    from opentelemetry.sdk.metrics import MeterProvider

    return MeterProvider(metric_readers=readers, resource=resource)


def _periodic_reader(name: str, protocol: str):
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    if name == "console":
        return PeriodicExportingMetricReader(ConsoleMetricExporter())
    if name != "otlp":
        raise ValueError(f"OTEL_METRICS_EXPORTER: unsupported exporter {name!r} (use otlp, console or none; "
                         "Prometheus is --metrics-port)")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    else:
        raise ValueError(f"OTLP protocol {protocol!r} is not supported (use grpc or http/protobuf)")
    return PeriodicExportingMetricReader(OTLPMetricExporter())
