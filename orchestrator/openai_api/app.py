"""The routes of the OpenAI-compatible API (FastAPI).

    POST /v1/completions        prompt (text or token ids) -> text
    POST /v1/chat/completions   messages (the target tokenizer's chat template) -> message
    GET  /v1/models             the served model
    GET  /health                200 while serving; 503 while connecting, draining, or while no
                                target replica answers (as the gRPC readiness status)

With API keys configured, every route but /health needs `Authorization:
Bearer KEY` (what `openai` clients send); a missing or wrong key is a 401 in
the same error JSON, before the body is even read.

A generation request is translated into a GenerateRequest (`translate`) and
run on the gRPC path (`runner`). Errors are one JSON shape (`errors`); a
stream that has begun reports a later error as an SSE event carrying the same
JSON, then `[DONE]`. A client that disconnects ends its request: a plain
request is watched for the disconnect while it runs, a stream by Starlette
(which cancels the sending task, and so the request).
"""
from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.errors import SpecdecError
from specdec.security.api_keys import ApiKeyChecker
from specdec.telemetry import (CLIENT_ADDRESS, HTTP_REQUEST_METHOD, HTTP_ROUTE, NETWORK_PROTOCOL_VERSION,
                               SERVER_ADDRESS, SERVER_PORT, URL_PATH, URL_SCHEME, USER_AGENT, Telemetry)

from . import responses, translate
from .body_limit import BodyLimit
from .concurrency import ConcurrencyLimit
from .config import HttpConfig
from .errors import ApiError, api_error
from .runner import ClientGone, RequestRun, unless_gone
from .schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class FrontDoorState:
    """What the routes read; the orchestrator fills in the servicer once its
    services are connected, sets `draining` on shutdown, and its health loop
    sets `targets_serving` (whether some target replica answers)."""

    cfg: HttpConfig
    telemetry: Telemetry
    servicer: object | None = None  # OrchestratorServicer; None while connecting
    model: str = ""  # the served model name
    max_model_len: int = 0
    draining: bool = False
    targets_serving: bool = True  # False: /health is 503, as gRPC readiness is NOT_SERVING
    api_keys: ApiKeyChecker | None = None  # None or no keys: no key required
    created: int = field(default_factory=lambda: int(time.time()))

    def ready(self):
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="unavailable")
        if self.servicer is None:
            raise ApiError(503, "the orchestrator is still connecting to its services", code="unavailable")
        return self.servicer


def create_app(state: FrontDoorState) -> FastAPI:
    app = FastAPI(title="specdec: OpenAI-compatible API",
                  description="Speculative decoding over gRPC services; output distributed as the target model's.")
    app.state.front_door = state
    _install_error_handlers(app)
    # Outermost last: the metrics, then the key (a 401 reads no body), then the
    # bound on requests in flight (a 503 reads no body), then the body's size.
    app.add_middleware(BodyLimit, max_bytes=state.cfg.http_max_body_bytes, refuse=_error_response)
    app.add_middleware(ConcurrencyLimit, max_requests=lambda: state.cfg.http_max_concurrent_requests,
                       refuse=_error_response)
    if state.api_keys is not None and state.api_keys.required:
        app.add_middleware(_ApiKeyGate, checker=state.api_keys)
    app.add_middleware(_HttpMetrics, telemetry=state.telemetry)

    @app.api_route("/health", methods=["GET", "HEAD"])  # some load balancers probe with HEAD
    async def health():
        """Readiness, for HTTP load balancers: 503 also while no target
        replica is reachable. Requests are still taken then (they wait for a
        replica, as on gRPC); /health only steers new traffic elsewhere."""
        state.ready()
        if not state.targets_serving:
            raise ApiError(503, "no target replica is reachable", code="unavailable")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        state.ready()
        return {"object": "list", "data": [{"id": state.model, "object": "model", "created": state.created,
                                            "owned_by": "specdec", "max_model_len": state.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _generate(state, request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _generate(state, request, body, chat=True)

    return app


async def _generate(state: FrontDoorState, request: Request, body, chat: bool) -> Response:
    servicer = state.ready()
    if body.model is not None and body.model != state.model:
        raise ApiError(404, f"the model {body.model!r} does not exist: this server serves {state.model!r}",
                       code="model_not_found", param="model")
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
    request_id = request.headers.get("x-request-id") or response_id
    gen_request = translate.chat_request(body, request_id) if chat else translate.completion_request(body, request_id)
    stream = bool(body.stream)
    include_usage = bool(stream and body.stream_options and body.stream_options.include_usage)
    head = responses.Head(id=response_id, created=int(time.time()), model=state.model, chat=chat,
                          include_usage=include_usage)
    route = request.scope["route"].path
    run = RequestRun(servicer, gen_request, state.telemetry, request.headers, _http_attributes(request, route),
                     state.cfg.http_request_timeout_s or None, stream)
    headers = {"X-Request-Id": request_id}
    try:
        if not stream:
            text, stats = await unless_gone(run.collect(), request.receive, run)
            return JSONResponse(responses.body(head, text, stats), headers=headers)
        # The status line waits for the first reply, so an error before any
        # token (bad input, over capacity, target down) gets its own status.
        first = await unless_gone(run.next(), request.receive, run)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the request has been ended
    except asyncio.CancelledError:
        if not state.draining:
            raise
        # The drain's grace is over and uvicorn cancels what is left: it would
        # answer with its own plain-text 500 and log a traceback. The request
        # has been ended (unless_gone); a 503 tells the client to retry it.
        task = asyncio.current_task()
        if hasattr(task, "uncancel"):  # Python 3.11+: this cancellation is handled
            task.uncancel()
        return _error_response(ApiError(503, "the server shut down before this request finished "
                                             "(its --drain-grace-s ran out): retry it", code="unavailable"))
    return StreamingResponse(_events(run, head, first), media_type="text/event-stream",
                             headers={**headers, **STREAM_HEADERS})


async def _events(run: RequestRun, head: responses.Head, reply):
    """The SSE body: text chunks as tokens are accepted, the final chunks, [DONE]."""
    try:
        if head.chat:
            yield responses.sse(responses.role_chunk(head))
        stats = None
        while reply is not None:
            if reply.HasField("chunk"):
                if reply.chunk.text:
                    yield responses.sse(responses.text_chunk(head, reply.chunk.text))
            else:
                stats = reply.stats
            reply = await run.next()
        for chunk in responses.final_chunks(head, stats):
            yield responses.sse(chunk)
        yield responses.DONE
    except ApiError as error:
        yield responses.sse(error.body())
        yield responses.DONE
    finally:
        run.cancel()  # a no-op when the request has ended; frees the sessions when the client left


def _http_attributes(request: Request, route: str) -> dict:
    """OpenTelemetry HTTP semantic-convention attributes of the `generate` span."""
    attrs = {HTTP_REQUEST_METHOD: request.method, HTTP_ROUTE: route, URL_PATH: request.url.path,
             URL_SCHEME: request.url.scheme, NETWORK_PROTOCOL_VERSION: request.scope.get("http_version", "1.1")}
    server = request.scope.get("server")
    if server:
        attrs[SERVER_ADDRESS], attrs[SERVER_PORT] = server[0], server[1]
    if request.client:
        attrs[CLIENT_ADDRESS] = request.client.host
    if "user-agent" in request.headers:
        attrs[USER_AGENT] = request.headers["user-agent"]
    return attrs


# ------------------------------------------------------------------ errors

def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def on_api_error(_request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(SpecdecError)
    async def on_core_error(_request, exc: SpecdecError):
        return _error_response(api_error(exc))

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_request, exc: RequestValidationError):
        return _error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_request, exc: StarletteHTTPException):
        return _error_response(ApiError(exc.status_code, str(exc.detail), code=None))

    @app.exception_handler(Exception)
    async def on_bug(_request, exc: Exception):
        return _error_response(api_error(exc))


def validation_error(errors: list[dict]) -> ApiError:
    """pydantic's errors as one 400 naming the first bad field."""
    union = _union_error(errors)
    if union is not None:
        return union
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        message = f"unknown field {param!r}"
    elif kind == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        param = None
    elif kind in ("model_attributes_type", "dict_type") and not loc:
        message = "the request body must be a JSON object (Content-Type: application/json)"
    elif kind == "missing" and not loc:  # no body at all (FastAPI's loc is ("body",))
        message = "the request body is empty: send a JSON object (Content-Type: application/json)"
    elif kind == "missing":
        message = f"{param} is required"
    else:
        message = f"{param}: {first['msg']}" if param else first["msg"]
    more = len(errors) - 1
    if more > 0:
        message += f" (and {more} more error{'s' if more > 1 else ''})"
    return ApiError(400, message, code="invalid_argument", param=param)


def _union_error(errors: list[dict]) -> ApiError | None:
    """A field of several accepted forms (`prompt`: a string, token ids,
    ...) that matched none: pydantic reports one error per form, each under
    the form's tag ("prompt.str: Input should be a valid string (and 3 more
    errors)"). One message naming the field and the forms instead; None for
    any other errors."""
    locs = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in errors]
    if len(errors) < 2 or any(len(loc) < 2 for loc in locs) or len({loc[0] for loc in locs}) != 1:
        return None
    field, forms = locs[0][0], list(dict.fromkeys(loc[1] for loc in locs))
    if len(forms) < 2 or not all(_FORM.fullmatch(tag) for tag in forms):
        return None
    named = [_form_words(tag) for tag in forms]
    return ApiError(400, f"{field} must be {', '.join(named[:-1])} or {named[-1]}", code="invalid_argument",
                    param=field)


_FORM = re.compile(r"(list\[)*(str|int|float|bool|constrained-int|constrained-float|constrained-str)\]*")
_FORM_NOUNS = {"str": ("a string", "strings"), "int": ("an integer", "integers"),
               "constrained-int": ("a token id", "token ids"), "float": ("a number", "numbers"),
               "constrained-float": ("a number", "numbers"), "bool": ("true or false", "booleans"),
               "constrained-str": ("a string", "strings")}


def _form_words(tag: str) -> str:
    """"list[list[constrained-int]]" -> "a list of lists of token ids"."""
    depth, base = tag.count("list["), tag.replace("list[", "").rstrip("]")
    one, many = _FORM_NOUNS[base]
    if depth == 0:
        return one
    return "a list of " + "lists of " * (depth - 1) + many


class _HttpMetrics:
    """ASGI middleware: each HTTP request's duration, to the last byte of its
    response, by method, route and status (`specdec_http_request_duration_seconds`)."""

    def __init__(self, app, telemetry: Telemetry):
        self.app = app
        self.metrics = telemetry.metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = scope.get("route")
            self.metrics.record_http(scope["method"], route.path if route is not None else "other", status[0],
                                     time.perf_counter() - start)


class _ApiKeyGate:
    """ASGI middleware: every route but /health needs a valid API key
    (`Authorization: Bearer KEY`); otherwise a 401 in OpenAI's error JSON,
    answered before routing or reading the body."""

    OPEN_PATHS = ("/health",)

    def __init__(self, app, checker: ApiKeyChecker):
        self.app = app
        self.checker = checker

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS:
            headers = dict(scope["headers"])
            raw = headers.get(b"authorization")
            problem = self.checker.problem(raw.decode("latin-1") if raw is not None else None)
            if problem is not None:
                response = _error_response(ApiError(401, problem, code="invalid_api_key"))
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
