"""Serve the HTTP front door with uvicorn inside the orchestrator's event loop.

The socket is bound here, before the services are connected (like the gRPC
port), so a port of 0 is known at once and `/health` answers 503 until the
orchestrator is ready. uvicorn's own signal handling is left out: the process
already drains on SIGTERM, and `stop()` drains this server the same way (new
connections refused, `/health` 503, requests in flight given the grace period,
then cancelled, which frees their sessions).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

from specdec.security.api_keys import ApiKeyChecker
from specdec.security.tls import ReloadingServerContext, TlsConfig
from specdec.telemetry import Telemetry

from .app import FrontDoorState, create_app
from .config import HttpConfig

log = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    def capture_signals(self):  # the orchestrator owns SIGTERM/SIGINT
        return contextlib.nullcontext()


class HttpFrontDoor:
    """A started HTTP server; `state` is what its routes read."""

    def __init__(self, state: FrontDoorState, server: _EmbeddedServer, sock: socket.socket, task: asyncio.Task):
        self.state = state
        self._server = server
        self.socket = sock  # the listening socket (IPPROTO_TCP, so asyncio sets TCP_NODELAY: see _bind)
        self._task = task
        self.host, self.port = sock.getsockname()[:2]

    def set_ready(self, servicer, model: str, max_model_len: int) -> None:
        self.state.model = self.state.cfg.served_model_name or model
        self.state.max_model_len = max_model_len
        self.state.servicer = servicer

    async def stop(self, grace_s: float = 0.0) -> None:
        """Refuse new requests, give those in flight `grace_s`, then cancel them."""
        if self._task.done():
            return
        self.state.draining = True
        self._server.config.timeout_graceful_shutdown = max(grace_s, 0.01)
        self._server.should_exit = True
        await asyncio.wait({self._task})
        if not self._task.cancelled() and self._task.exception() is not None:
            log.error("the HTTP server failed", exc_info=self._task.exception())


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets that
    # say so, and without it each response waits out a delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind the HTTP port {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _tls_settings(tls: TlsConfig | None) -> dict:
    """uvicorn's TLS settings: HTTPS with the orchestrator's certificate, and
    client certificates required when --tls-ca is set (as on gRPC)."""
    if tls is None or not tls.enabled:
        return {}
    import ssl

    settings = {"ssl_certfile": tls.tls_cert, "ssl_keyfile": tls.tls_key}
    if tls.tls_ca:
        settings.update(ssl_ca_certs=tls.tls_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return settings


async def start_http(cfg: HttpConfig, host: str, telemetry: Telemetry, tls: TlsConfig | None = None,
                     api_keys: ApiKeyChecker | None = None) -> HttpFrontDoor:
    """Bind and start serving (HTTPS when `tls` has a certificate; API keys
    required when `api_keys` holds any); routes answer 503 until `set_ready()`."""
    state = FrontDoorState(cfg=cfg, telemetry=telemetry, api_keys=api_keys)
    sock = _bind(cfg.http_host or host, cfg.http_port)
    config = uvicorn.Config(create_app(state), log_config=None, access_log=cfg.http_access_log, lifespan="off",
                            timeout_graceful_shutdown=None, server_header=False, **_tls_settings(tls))
    server = _EmbeddedServer(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not task.done():  # startup is quick; a failure ends the task
        await asyncio.sleep(0.005)
    if task.done():
        sock.close()
        task.result()
        raise OSError("the HTTP server did not start")
    if server.config.ssl:
        # Renewed files are served from the next connection on, as on the gRPC port.
        ReloadingServerContext(tls.tls_cert, tls.tls_key, tls.tls_ca).listening_context(server.config.ssl)
    front = HttpFrontDoor(state, server, sock, task)
    scheme = "https" if tls is not None and tls.enabled else "http"
    log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", scheme, front.host, front.port)
    return front
