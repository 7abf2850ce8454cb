"""One HTTP request on the shared request path, in a task of its own.

`RequestRun` starts `OrchestratorServicer.generate` (the path gRPC Generate
runs) in a task that owns the request's `generate` span, so the span starts
and ends in one task whichever task reads the replies (an SSE stream is read
by Starlette's sending task, a plain response by the endpoint's). The HTTP
side reads replies with `next()`; when the client leaves it calls `cancel()`,
and the loop's own cleanup closes both sessions, as for a cancelled gRPC call.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Mapping

from opentelemetry.trace import Status, StatusCode

from specdec.telemetry import ERROR_TYPE, HTTP_RESPONSE_STATUS_CODE, SPAN_GENERATE, Telemetry
from specdec.v1 import orchestrator_pb2 as pb

from .errors import ApiError, api_error

_END = object()


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


class RequestRun:
    def __init__(self, servicer, request: pb.GenerateRequest, telemetry: Telemetry, headers: Mapping[str, str],
                 attributes: dict, timeout_s: float | None, stream: bool):
        self._replies: asyncio.Queue = asyncio.Queue()  # replies, then an ApiError or _END
        self._task = asyncio.ensure_future(
            self._run(servicer, request, telemetry, headers, attributes, timeout_s, stream))

    async def _run(self, servicer, request, telemetry, headers, attributes, timeout_s, stream) -> None:
        sent_any = False
        with telemetry.server_span(SPAN_GENERATE, headers.items(), attributes) as span:
            try:
                async for reply in servicer.generate(request, span, timeout_s):
                    self._replies.put_nowait(reply)
                    sent_any = True
                span.set_attribute(HTTP_RESPONSE_STATUS_CODE, 200)
            except asyncio.CancelledError:
                span.set_attribute(ERROR_TYPE, "client_disconnected")
                raise
            except Exception as exc:  # noqa: BLE001 - the edge: every error becomes a response
                error = api_error(exc)
                # A stream that has begun was sent with status 200; its error is an event.
                span.set_attribute(HTTP_RESPONSE_STATUS_CODE, 200 if stream and sent_any else error.status)
                span.set_attribute(ERROR_TYPE, error.code or str(error.status))
                span.set_status(Status(StatusCode.ERROR, error.message))
                self._replies.put_nowait(error)
            finally:
                self._replies.put_nowait(_END)

    async def next(self) -> pb.GenerateResponse | None:
        """The next reply; None after the last. Raises the request's ApiError."""
        item = await self._replies.get()
        if item is _END:
            return None
        if isinstance(item, ApiError):
            raise item
        return item

    async def collect(self) -> tuple[str, pb.GenerateStats]:
        """Every reply: the whole text and the statistics."""
        parts, stats = [], None
        while (reply := await self.next()) is not None:
            if reply.HasField("chunk"):
                parts.append(reply.chunk.text)
            else:
                stats = reply.stats
        return "".join(parts), stats

    def cancel(self) -> None:
        """End the request (its sessions close in the background)."""
        if not self._task.done():
            self._task.cancel()

    async def ended(self) -> None:
        """Wait until the run's task has finished (tests, shutdown)."""
        await asyncio.wait({self._task})


async def until_disconnected(receive) -> None:
    """Return when the ASGI client disconnects (the request body already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(work: Awaitable, receive, run: RequestRun):
    """Await `work`; if the client disconnects first, cancel `run` and raise
    ClientGone."""
    work_task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnected(receive))
    try:
        await asyncio.wait({work_task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled (server shutdown): end the request too
        run.cancel()
        raise
    finally:
        for task in (work_task, gone):
            if not task.done():
                task.cancel()
    if work_task.done() and not work_task.cancelled():
        return work_task.result()
    run.cancel()
    raise ClientGone()
