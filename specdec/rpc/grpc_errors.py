"""Map the core's errors to gRPC statuses, at the edge of each servicer.

A user-caused error (`specdec.errors`) becomes its status with the same clear
message; anything else is our bug: it is logged with its traceback here and
the caller sees INTERNAL without one.
"""
from __future__ import annotations

import functools
import logging

import grpc

from specdec import errors

log = logging.getLogger(__name__)

_CODES: dict[type, grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Aborted: grpc.StatusCode.ABORTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    for kind, code in _CODES.items():
        if isinstance(exc, kind):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"


def report(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    """The status of a call that raised `exc`, logging our bugs."""
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=exc)
    return code, message


def unary(method):
    """Decorate an async unary servicer method."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - the edge: everything becomes a status
            if isinstance(exc, grpc.aio.AbortError):
                raise
            code, message = report(exc, method.__qualname__)
        await context.abort(code, message)

    return wrapper


def stream(method):
    """Decorate an async-generator (server-streaming) servicer method."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            async for item in method(self, request, context):
                yield item
            return
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, grpc.aio.AbortError):
                raise
            code, message = report(exc, method.__qualname__)
        await context.abort(code, message)

    return wrapper


def status_from_number(number: int) -> grpc.StatusCode:
    """The status of a google.rpc.Code number sent in a message (an item's
    or a call's error); UNKNOWN for a number that is none."""
    return _BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def code_number(exc: BaseException) -> int:
    """The google.rpc.Code number for a per-item error inside a batch reply."""
    code, _ = status_for(exc)
    return code.value[0]


_FROM_CODES: dict[grpc.StatusCode, type] = {code: kind for kind, code in _CODES.items()}


def from_rpc_error(exc: grpc.aio.AioRpcError, service: str) -> errors.SpecdecError:
    """A downstream service's status as the core's error, keeping what the
    caller can fix (bad argument, limits) and calling the rest UNAVAILABLE."""
    kind = _FROM_CODES.get(exc.code())
    if kind is None or kind is errors.NotFound:
        return errors.Unavailable(f"the {service} service failed: {exc.code().name}: {exc.details()}")
    return kind(f"{service} service: {exc.details()}")


def error_kind(code: grpc.StatusCode) -> type | None:
    """The core's error for a status (None for one no core error stands
    for: INTERNAL, UNKNOWN, ...)."""
    return _FROM_CODES.get(code)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a call with this status raises on the client's side."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def deadline_exceeded() -> grpc.aio.AioRpcError:
    """What a call past its deadline raises, as grpc's own client says it."""
    return rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


def too_large_reply(reply_type, call_id: int, message: str):
    """The reply to a call whose call or reply was over a side's message
    limit: RESOURCE_EXHAUSTED for that call alone, as grpc fails a unary call
    over the limit."""
    reply = reply_type(call_id=call_id)
    reply.error.code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    reply.error.message = message
    return reply


def reply_over_limit(size: int, limit: int) -> str:
    """What a reply over the service's own limit fails with."""
    return f"the reply ({size} bytes) is larger than the service's --max-message-bytes ({limit})"


async def answer_call(call, handle, reply_type, method: str):
    """The reply to one call: `handle`'s response, or the status its
    exception maps to in the reply's `error` (logged when it is our bug)."""
    reply = reply_type(call_id=call.call_id)
    try:
        reply.response.CopyFrom(await handle(call.request, call.trace_context.items()))
    except Exception as exc:  # noqa: BLE001 - the edge: everything becomes a status
        code, message = report(exc, method)
        reply.error.code = code.value[0]
        reply.error.message = message
    return reply
