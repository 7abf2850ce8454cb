"""Re-wrapping a gRPC method handler's behavior, whichever of the four kinds
(unary_unary, unary_stream, stream_unary, stream_stream) it is: the one
place the server interceptors (`auth`, `malformed`) pick the behavior out of
an `grpc.RpcMethodHandler` and put their wrapper in its place."""
from __future__ import annotations

from typing import Callable

import grpc

# wrap(behavior, response_streaming) -> the behavior to serve instead
Wrap = Callable[[Callable, bool], Callable]


def behavior_kind(handler: grpc.RpcMethodHandler) -> str:
    """The name of the handler's behavior field, from its streaming flags."""
    return f"{'stream' if handler.request_streaming else 'unary'}_{'stream' if handler.response_streaming else 'unary'}"


def wrap_behavior(handler: grpc.RpcMethodHandler, wrap: Wrap, **fields) -> grpc.RpcMethodHandler:
    """The same handler with its behavior replaced by `wrap(behavior,
    handler.response_streaming)` and any other `fields` (e.g.
    request_deserializer) replaced as given."""
    kind = behavior_kind(handler)
    return handler._replace(**{kind: wrap(getattr(handler, kind), handler.response_streaming)}, **fields)
