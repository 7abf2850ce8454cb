"""The metric instruments of the three roles, and the Prometheus endpoint.

Names follow Prometheus conventions, so they read the same in a scrape and in
an OTLP backend: a `specdec_` prefix, base units (seconds, bytes) in the name,
no ':'; the Prometheus exporter appends `_total` to counters. The counters
mirror vLLM's speculative-decoding metrics (drafts, draft tokens, accepted
tokens, accepted tokens per position). docs/observability.md lists them all.

Every role creates every instrument: an instrument nothing records into
exports nothing, and one list is easier to keep in step with the docs.
"""
from __future__ import annotations

from typing import Callable

from opentelemetry.metrics import CallbackOptions, Meter, NoOpMeter, Observation

from specdec.config import check_port
from specdec.spans import on_next_turn

# Histogram buckets (upper bounds, inclusive), chosen for CPU and GPU alike.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)
PER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0, 600.0)
RPC_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
K_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

# Attribute sets are built once: a fresh dict per data point costs more than
# the recording itself on the per-round path.
_POSITIONS = [{"position": i} for i in range(64)]


def _position(i: int) -> dict:
    return _POSITIONS[i] if i < len(_POSITIONS) else {"position": i}


# The HTTP methods recorded by name (RFC 9110 and PATCH); any other is "_OTHER".
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})

class Metrics:
    """The instruments, created from one meter (a no-op meter costs nothing).

    A round's data points (`record_round`, `record_rpc`,
    `record_verify_batch`) are recorded on the
    event loop's next turn, not in the round: the SDK's instruments cost
    ~90 µs a round warm on the dev VM (eight data points, each through the
    SDK's measurement consumer, its attribute lookup and its lock), and more
    run cold between the models' steps. Deferred, they run once the round's
    next call is on its way, as the spans are built (specdec/spans.py). A
    scrape may see a round a turn of the loop late (points scheduled as the
    loop stops for good are dropped with it). With a
    no-op meter nothing is recorded at all."""

    def __init__(self, meter: Meter):
        self._meter = meter
        self.enabled = not isinstance(meter, NoOpMeter)
        counter, histogram = meter.create_counter, meter.create_histogram
        # orchestrator: speculation counters (vLLM's names under specdec_)
        self.drafts = counter("specdec_drafts", description="speculative rounds in which the draft proposed tokens")
        self.draft_tokens = counter("specdec_draft_tokens", description="tokens proposed by the draft")
        self.accepted_tokens = counter("specdec_accepted_tokens", description="draft tokens accepted by the target")
        self.accepted_per_position = counter(
            "specdec_accepted_tokens_per_position",
            description="accepted draft tokens by their position in the round (attribute position, 0-based)")
        self.requests = counter("specdec_requests", description="Generate requests ended, by finish_reason")
        # orchestrator: latency
        self.time_to_first_token = histogram(
            "specdec_time_to_first_token_seconds", unit="s", description="Generate: time to the first token",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S)
        self.time_per_output_token = histogram(
            "specdec_time_per_output_token_seconds", unit="s",
            description="Generate: time per output token after the first",
            explicit_bucket_boundaries_advisory=PER_TOKEN_BUCKETS_S)
        self.request_duration = histogram(
            "specdec_request_duration_seconds", unit="s", description="Generate: whole request",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S)
        self.num_draft_tokens = histogram(
            "specdec_num_draft_tokens", description="num_draft_tokens (k) chosen per round (the policy's decision after caps)",
            explicit_bucket_boundaries_advisory=K_BUCKETS)
        self.rpc_round_trip = histogram(
            "specdec_rpc_round_trip_seconds", unit="s",
            description="orchestrator-side time of a downstream call (attributes service, method)",
            explicit_bucket_boundaries_advisory=RPC_BUCKETS_S)
        self.http_request_duration = histogram(
            "specdec_http_request_duration_seconds", unit="s",
            description="orchestrator: HTTP front door requests, to the last byte of the response "
                        "(attributes http.request.method, http.route, http.response.status_code)",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S)
        # target service
        self.verify_batch_size = histogram(
            "specdec_verify_batch_size", description="target: items per Verify call",
            explicit_bucket_boundaries_advisory=BATCH_BUCKETS)
        self._rpc_attrs: dict[tuple[str, str], dict] = {}
        self._reason_attrs: dict[str, dict] = {}

    # ------------------------------------------------------------ recording

    def record_round(self, k_chosen: int, proposed: int, accepted: int) -> None:
        """One speculative round: k asked of the draft, tokens it returned,
        and how many of them the target accepted (recorded on the loop's next turn)."""
        if self.enabled:
            on_next_turn(self._record_round, k_chosen, proposed, accepted)

    def _record_round(self, k_chosen: int, proposed: int, accepted: int) -> None:
        self.num_draft_tokens.record(k_chosen)
        if proposed:
            self.drafts.add(1)
            self.draft_tokens.add(proposed)
            self.accepted_tokens.add(accepted)
            for i in range(accepted):
                self.accepted_per_position.add(1, _position(i))

    def record_request(self, duration_s: float, first_token_s: float | None, completion_tokens: int,
                       finish_reason: str) -> None:
        self.request_duration.record(duration_s)
        if first_token_s is not None:
            self.time_to_first_token.record(first_token_s)
            if completion_tokens > 1:
                self.time_per_output_token.record((duration_s - first_token_s) / (completion_tokens - 1))
        attrs = self._reason_attrs.setdefault(finish_reason, {"finish_reason": finish_reason})
        self.requests.add(1, attrs)

    def record_http(self, method: str, route: str, status: int, seconds: float) -> None:
        # A method no client means (h11 passes any token through) is "_OTHER",
        # as OpenTelemetry's HTTP conventions say: one new series per made-up
        # method, from unauthenticated requests too, was a label without bound.
        method = method if method in HTTP_METHODS else "_OTHER"
        self.http_request_duration.record(seconds, {"http.request.method": method, "http.route": route,
                                                    "http.response.status_code": status})

    def record_verify_batch(self, items: int) -> None:
        """Target: the items of one Verify call (recorded on the loop's next turn)."""
        if self.enabled:
            on_next_turn(self.verify_batch_size.record, items)

    def record_rpc(self, service: str, method: str, seconds: float) -> None:
        """A downstream call's round trip (recorded on the loop's next turn)."""
        if self.enabled:
            on_next_turn(self._record_rpc, service, method, seconds)

    def _record_rpc(self, service: str, method: str, seconds: float) -> None:
        attrs = self._rpc_attrs.get((service, method))
        if attrs is None:
            attrs = self._rpc_attrs[(service, method)] = {"service": service, "method": method}
        self.rpc_round_trip.record(seconds, attrs)

    def observe_requests_in_flight(self, count: Callable[[], int]) -> None:
        """Orchestrator: a gauge of the Generate calls running now. Call once."""
        self._meter.create_observable_gauge("specdec_requests_in_flight",
                                            [lambda _: [Observation(count())]],
                                            description="Generate requests the orchestrator is running now")

    def observe_sessions(self, usage: Callable[[], tuple[int, int]]) -> None:
        """Model services: gauges of open sessions and reserved KV bytes, read
        from `usage()` (-> (sessions, kv_bytes)) at each collection. Call once."""

        def sessions(_: CallbackOptions):
            return [Observation(usage()[0])]

        def kv_bytes(_: CallbackOptions):
            return [Observation(usage()[1])]

        self._meter.create_observable_gauge("specdec_active_sessions", [sessions],
                                            description="open sessions on this model service")
        self._meter.create_observable_gauge("specdec_kv_cache_bytes", [kv_bytes], unit="By",
                                            description="KV cache bytes reserved by open sessions")


def prometheus_reader():
    """A Prometheus reader with its own registry (so several roles in one
    process never collide), and that registry for the HTTP server."""
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry
    except ImportError:
        from specdec.errors import FailedPrecondition

        raise FailedPrecondition("--metrics-port needs the opentelemetry-exporter-prometheus package") from None

    registry = CollectorRegistry(auto_describe=True)
    return PrometheusMetricReader(registry=registry), registry


def start_metrics_server(host: str, port: int, registry):
    """Serve `registry` on http://host:port/metrics in a daemon thread;
    returns the server (`.server_port`, `.shutdown()`)."""
    check_port(port, "the metrics port")
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
