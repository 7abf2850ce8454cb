"""ASGI middleware: at most `--http-max-concurrent-requests` HTTP requests
in flight; the next is answered 503 at once, in OpenAI's error JSON with
`Retry-After`, before its body is read.

The gRPC door is bounded by `--max-concurrent-rpcs`; the HTTP door had no
bound (uvicorn's `limit_concurrency` is off unless set, and it answers in
plain text): every request was admitted, each holding a task and a
connection while it waits (for a target replica during an outage, for a
busy target's verify), however many came. A request counts from its first
byte to the last byte of its response (a stream until its `[DONE]`).
`/health` is not counted and never refused: a probe must see readiness,
not the load.
"""
from __future__ import annotations

from typing import Callable

from .errors import ApiError

RETRY_AFTER_S = 1


class ConcurrencyLimit:
    EXEMPT_PATHS = ("/health",)

    def __init__(self, app, max_requests: Callable[[], int], refuse: Callable[[ApiError], object]):
        self.app = app
        self.max_requests = max_requests  # read per request: the configured bound
        self.refuse = refuse  # an ApiError as the response the app's handlers make of it
        self.active = 0  # requests in flight (one event loop: no lock needed)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        limit = self.max_requests()
        if self.active >= limit:
            response = self.refuse(ApiError(
                503, f"the server is at its limit of {limit} concurrent HTTP requests "
                     "(--http-max-concurrent-requests): try again shortly", code="unavailable"))
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            await response(scope, receive, send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
