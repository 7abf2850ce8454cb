"""Bytes that are not the method's request message get INVALID_ARGUMENT.

grpc.aio calls a method's request deserializer before any servicer code runs,
and a deserializer that raises (protobuf's DecodeError on corrupt wire bytes,
invalid UTF-8 in a string field) is answered UNKNOWN, "Unexpected <class
DecodeError>": a status that says the server failed, for bytes the client
sent. This interceptor gives every method a deserializer that cannot raise:
on bad bytes it returns a `Malformed` marker, and the method's behavior,
wrapped, answers INVALID_ARGUMENT naming the message type before the servicer
sees anything.

The patched handler is built once per handler it replaces (cached by that
handler, so it is right wherever the interceptor sits in a chain), and a
well-formed call pays one isinstance check.
"""
from __future__ import annotations

import inspect
from typing import Callable

import grpc

from specdec.rpc.method_handlers import wrap_behavior

_MAX_CACHED = 256


class Malformed:
    """What a request deserializer returns for bytes it cannot parse."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def _safe(deserialize: Callable[[bytes], object], method: str) -> Callable[[bytes], object]:
    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - whatever the parser says, the bytes were the client's
            return Malformed(f"{method}: the request is not a valid protobuf message: {exc}")

    return parse


async def _refuse(context, malformed: Malformed):
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed.message)


def _guard_unary(behavior):
    async def guarded(request, context):
        if isinstance(request, Malformed):
            await _refuse(context, request)
        return await behavior(request, context)

    return guarded


def _guard_stream(behavior):
    # grpc.aio tells the two kinds of unary-stream behavior apart by their
    # function (an async generator, or a coroutine that writes to the
    # context), so the guard must be of the same kind.
    if not inspect.isasyncgenfunction(behavior):
        return _guard_unary(behavior)

    async def guarded(request, context):
        if isinstance(request, Malformed):
            await _refuse(context, request)
            return
        async for reply in behavior(request, context):
            yield reply

    return guarded


def _guard(behavior, response_streaming: bool):
    return _guard_stream(behavior) if response_streaming else _guard_unary(behavior)


class MalformedRequests(grpc.aio.ServerInterceptor):
    """Answer undecodable requests of unary-request methods with INVALID_ARGUMENT.
    On a bidirectional stream (the call streams) a message that cannot be
    parsed reaches the servicer as a `Malformed` marker, which ends the
    stream with INVALID_ARGUMENT (`specdec.rpc.call_stream`)."""

    def __init__(self):
        self._patched: dict[grpc.RpcMethodHandler, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        patched = self._patched.get(handler)
        if patched is None:
            patched = self._patch(handler, handler_call_details.method)
            if len(self._patched) < _MAX_CACHED:  # an interceptor that makes a handler per call must not grow it
                self._patched[handler] = patched
        return patched

    @staticmethod
    def _patch(handler, method: str):
        if handler.request_deserializer is None:
            return handler
        deserializer = _safe(handler.request_deserializer, method)
        if handler.request_streaming:
            # Only our own call streams know the marker (not, say, reflection's stream).
            return handler._replace(request_deserializer=deserializer) if method.startswith("/specdec.") else handler
        return wrap_behavior(handler, _guard, request_deserializer=deserializer)
