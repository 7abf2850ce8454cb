"""Settings of the orchestrator's HTTP front door (flags / SPECD_* environment)."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.config import check_port, opt

OFF = -1
UP_DEFAULT_PORT = 8000  # `specd up` serves HTTP here unless told otherwise
# As the gRPC port's --max-concurrent-rpcs: far above what the targets'
# sessions admit (replicas x --max-sessions), so only a pile-up is refused.
HTTP_MAX_CONCURRENT_REQUESTS = 4096


@dataclass
class HttpConfig:
    http_port: int = opt(OFF, "OpenAI-compatible HTTP API port (-1: off; 0: pick a free one)")
    http_host: str = opt("", "HTTP bind address (empty: the same as --host)")
    served_model_name: str = opt("", "the model name /v1/models lists and requests may name "
                                     "(default: the target's model name)")
    http_request_timeout_s: float = opt(600.0, "deadline of each HTTP generation request, seconds (0: none)")
    http_access_log: bool = opt(False, "log one line per HTTP request")
    http_max_body_bytes: int = opt(16 << 20, "largest HTTP request body accepted, bytes (larger: 413)")
    http_max_concurrent_requests: int = opt(HTTP_MAX_CONCURRENT_REQUESTS,
                                            "HTTP requests served at once (at least 1), a stream counting until "
                                            "it ends; the next gets 503 with Retry-After at once (/health is "
                                            "not counted)")

    @property
    def enabled(self) -> bool:
        return self.http_port != OFF

    def validate(self) -> "HttpConfig":
        check_port(self.http_port, "--http-port", lowest=OFF, meaning="-1 (off), 0 (any free port)")
        if self.http_max_body_bytes < 1:
            raise ValueError(f"--http-max-body-bytes must be >= 1, got {self.http_max_body_bytes}")
        if self.http_max_concurrent_requests < 1:
            raise ValueError(f"--http-max-concurrent-requests must be >= 1, got {self.http_max_concurrent_requests}")
        if self.http_request_timeout_s < 0:
            raise ValueError("--http-request-timeout-s must be >= 0")
        return self
