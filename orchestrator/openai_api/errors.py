"""Errors of the HTTP front door: HTTP statuses and the OpenAI error JSON.

One chain for both front doors: the core's error becomes its gRPC status in
`specdec.rpc.grpc_errors` (one table), and that status becomes an HTTP status
here, following the mapping google.rpc.Code documents (INVALID_ARGUMENT 400,
UNAUTHENTICATED 401, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED
504, ...). The body is OpenAI's:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": "invalid_argument"}}

`code` is the gRPC status name in lower case (`model_not_found` for an
unknown model), so a client sees the same error whichever door it used.
"""
from __future__ import annotations

import logging

import grpc

from specdec.rpc import grpc_errors

log = logging.getLogger(__name__)

_S = grpc.StatusCode
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    _S.INVALID_ARGUMENT: 400, _S.FAILED_PRECONDITION: 400, _S.OUT_OF_RANGE: 400,
    _S.UNAUTHENTICATED: 401, _S.PERMISSION_DENIED: 403, _S.NOT_FOUND: 404,
    _S.ALREADY_EXISTS: 409, _S.ABORTED: 409, _S.RESOURCE_EXHAUSTED: 429,
    _S.CANCELLED: 499, _S.UNIMPLEMENTED: 501, _S.UNAVAILABLE: 503, _S.DEADLINE_EXCEEDED: 504,
    _S.INTERNAL: 500, _S.UNKNOWN: 500, _S.DATA_LOSS: 500,
}
ERROR_TYPE: dict[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
    429: "rate_limit_error", 499: "cancelled", 501: "not_implemented_error",
    503: "service_unavailable_error", 504: "timeout_error",
}


class ApiError(Exception):
    """An error response: HTTP status, message, and OpenAI's `param`/`code`."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    @property
    def type(self) -> str:
        return ERROR_TYPE.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def api_error(exc: BaseException) -> ApiError:
    """Any exception of the request path as an ApiError. Errors a caller can
    cause keep their message; anything else is our bug, logged here with its
    traceback, and the caller sees a 500 without one."""
    if isinstance(exc, ApiError):
        return exc
    code, message = grpc_errors.status_for(exc)
    if code is _S.INTERNAL:
        log.error("HTTP request failed", exc_info=exc)
    return ApiError(HTTP_STATUS.get(code, 500), message, code=code.name.lower(), param=getattr(exc, "param", None))
