"""ASGI middleware: a request body larger than the front door's limit is
refused with a 413 before any of it is parsed.

Neither uvicorn nor FastAPI bound a request's body: a 16 MB JSON prompt was
read, parsed and tokenized whole (the gRPC door refuses a message over
`--max-message-bytes`, 16 MiB by default, and this is its HTTP twin,
`--http-max-body-bytes`). A declared Content-Length over the limit is
refused at once; a chunked body is read up to the limit and refused as soon
as it passes it. A body within the limit reaches the app as one message,
then the connection's own messages follow (a disconnect is still seen).
"""
from __future__ import annotations

from typing import Callable

from .errors import ApiError


class BodyLimit:
    def __init__(self, app, max_bytes: int, refuse: Callable[[ApiError], object]):
        self.app = app
        self.max_bytes = max_bytes
        self.refuse = refuse  # an ApiError as the response the app's handlers make of it

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: the app sees it as it would
                return await self.app(scope, _replay([message], receive), send)
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay([{"type": "http.request", "body": bytes(body), "more_body": False}], receive),
                       send)

    async def _too_large(self, scope, receive, send) -> None:
        error = ApiError(413, f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                              "(--http-max-body-bytes)", code="request_too_large")
        await self.refuse(error)(scope, receive, send)


def _replay(messages: list[dict], receive):
    """`receive` that first hands out `messages`, then the connection's own."""
    pending = list(messages)

    async def replayed():
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
