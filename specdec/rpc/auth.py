"""Who may call: gRPC server interceptors that refuse a call before its
servicer runs, and the caller's identity as the servicers see it.

    api_key_guard      the orchestrator's front door: `authorization: Bearer
                       KEY` metadata, else UNAUTHENTICATED
    caller_guard       draft, target: the client certificate (verified by the
                       TLS handshake against --tls-ca) must NAME an allowed
                       caller (CN or DNS SAN), else PERMISSION_DENIED; being
                       signed by our CA is not enough

Health checks (grpc.health.v1) and reflection stay open to everyone who gets
through the handshake. The interceptors exist only when security is on, so a
plaintext deployment pays nothing per call.
"""
from __future__ import annotations

import inspect
from typing import Callable, Optional

import grpc

from specdec.rpc.method_handlers import wrap_behavior
from specdec.security.api_keys import ApiKeyChecker

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

# A check looks at the call's context and returns (status, message) to refuse it, or None.
Check = Callable[[grpc.aio.ServicerContext], Optional[tuple[grpc.StatusCode, str]]]


def certificate_names(context) -> list[str]:
    """The verified client certificate's common name and subject alternative
    names (empty without mutual TLS)."""
    auth = context.auth_context() or {}
    values = [*auth.get("x509_common_name", ()), *auth.get("x509_subject_alternative_name", ())]
    return list(dict.fromkeys(v.decode() if isinstance(v, bytes) else v for v in values))


def caller_identity(context) -> str:
    """Whom a quota counts a call against: the client certificate's common
    name (first name) under mutual TLS, else the peer's address without its
    port (plaintext: one identity per calling host)."""
    names = certificate_names(context)
    if names:
        return "cert:" + names[0]
    peer = context.peer() or "unknown"
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


def api_key_check(checker: ApiKeyChecker) -> Check:
    def check(context):
        metadata = {k: v for k, v in (context.invocation_metadata() or ())}
        problem = checker.problem(metadata.get("authorization"))
        return None if problem is None else (grpc.StatusCode.UNAUTHENTICATED, problem)

    return check


def caller_refusal(names: list[str], allowed: frozenset[str]) -> str:
    """Why a caller whose certificate carries `names` is refused ('' when
    one of them is allowed): for the gRPC port and the lanes alike."""
    if any(name in allowed for name in names):
        return ""
    shown = ", ".join(names) if names else "no name"
    return f"the caller's certificate names {shown}; this service serves only {', '.join(sorted(allowed))}"


def caller_check(allowed: frozenset[str]) -> Check:
    def check(context):
        refusal = caller_refusal(certificate_names(context), allowed)
        return (grpc.StatusCode.PERMISSION_DENIED, refusal) if refusal else None

    return check


class Guard(grpc.aio.ServerInterceptor):
    """Runs `check` before every call except health and reflection."""

    def __init__(self, check: Check):
        self.check = check
        self._guarded: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        guarded = self._guarded.get(method)
        if guarded is None:
            guarded = self._guarded[method] = _guard(handler, self.check)
        return guarded


def api_key_guard(checker: ApiKeyChecker) -> Guard:
    return Guard(api_key_check(checker))


def caller_guard(allowed: frozenset[str]) -> Guard:
    return Guard(caller_check(allowed))


async def _enforce(check: Check, context) -> None:
    refusal = check(context)
    if refusal is not None:
        await context.abort(*refusal)


async def _stream_of(result):
    """A streaming behaviour's result as an async iterator (an async
    generator, or a coroutine that writes with context.write)."""
    if inspect.isawaitable(result):
        await result
        return
    async for item in result:
        yield item


def _guard(handler: grpc.RpcMethodHandler, check: Check) -> grpc.RpcMethodHandler:
    """The same handler, with `check` first."""

    def wrap(inner, response_streaming: bool):
        if response_streaming:
            async def streaming(request, context):
                await _enforce(check, context)
                async for item in _stream_of(inner(request, context)):
                    yield item

            return streaming

        async def unary(request, context):
            await _enforce(check, context)
            return await inner(request, context)

        return unary

    return wrap_behavior(handler, wrap)
