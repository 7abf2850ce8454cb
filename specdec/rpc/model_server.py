"""Start a model service (draft or target): bind, load, warm up, serve, drain.

The server binds first and answers health checks with NOT_SERVING while the
model loads on the engine thread; it turns SERVING only once the model is
loaded and warmed up, so a Kubernetes startup probe sees the truth.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import grpc

from specdec.rpc.auth import caller_guard
from specdec.rpc.lane_server import LaneServer, LaneTls
from specdec.rpc.model_service import SessionServicer
from specdec.rpc.session_limits import SessionLimits
from specdec.rpc.serving import EngineWorker, RunningServer, ServerConfig, install_drain_on_signals, start_server
from specdec.security.tls import TlsConfig

log = logging.getLogger(__name__)


@dataclass
class ModelService:
    running: RunningServer
    servicer: SessionServicer
    worker: EngineWorker
    lane: LaneServer | None = None  # the round call's lane (specdec/rpc/lane.py), when it listens

    @property
    def port(self) -> int:
        return self.running.port

    async def stop(self, grace_s: float = 0.0) -> None:
        self.servicer.stop_reaper()
        await self.running.drain(grace_s)
        self.worker.shutdown()


async def start_model_service(
    server_cfg: ServerConfig,
    limits: SessionLimits,
    build_backend: Callable[[], object],
    make_servicer: Callable[[EngineWorker, SessionLimits], SessionServicer],
    add_to_server: Callable[[object, grpc.aio.Server], None],
    service_name: str,
    interceptors=(),
    tls: TlsConfig | None = None,
) -> ModelService:
    """Bind, then build the backend (load + warm-up) on the engine thread, then
    mark SERVING. Raises whatever loading raises (after stopping the server).

    With `tls` serving certificates, the port speaks mutual TLS and serves
    only callers whose certificate names one of `tls.allowed_callers`;
    without, plaintext, which only a loopback address or `tls.insecure` allows."""
    role = service_name.rsplit(".", 1)[-1].removesuffix("Service").lower() + " service"
    tls = (tls or TlsConfig()).validate(server_cfg.host, role, require_client_certs=True)
    if tls.mutual:
        interceptors = (caller_guard(tls.callers()), *interceptors)
    worker = EngineWorker(inline_max_s=server_cfg.inline_max_ms / 1e3)
    servicer = make_servicer(worker, limits)
    running = await start_server(server_cfg, lambda server: add_to_server(servicer, server),
                                 [service_name], interceptors=interceptors, credentials=tls.server_credentials())
    servicer.call_streams.max_message_bytes = server_cfg.max_message_bytes
    running.drain_hooks.append(servicer.call_streams.close)
    lane = None
    try:
        if server_cfg.lane_port >= 0:
            lane = await start_lane(servicer, server_cfg, tls)
            running.drain_hooks.append(lane.close)
            running.drain_waits.append(lane.wait_closed)
        backend = await worker.run(build_backend)
    except BaseException:
        await running.drain(0)
        worker.shutdown()
        raise
    async def device_failed(why: str) -> None:
        running.failure = why  # the role exits non-zero once drained (`specd serve`)
        await running.drain(0)  # every status NOT_SERVING, liveness's too: its calls fail anyway

    servicer.on_device_failure = device_failed
    servicer.attach(backend)
    await running.set_serving()
    return ModelService(running=running, servicer=servicer, worker=worker, lane=lane)


async def start_lane(servicer: SessionServicer, server_cfg: ServerConfig, tls: TlsConfig) -> LaneServer:
    """The service's lane (specdec/rpc/lane.py) on the gRPC port's host,
    advertised in ModelInfo; under TLS it speaks mutual TLS with the same
    certificates and serves the same callers."""
    call = servicer.lane_call()
    lane_tls = LaneTls(tls.tls_cert, tls.tls_key, tls.tls_ca, tls.callers()) if tls.enabled else None
    lane = LaneServer(call.method.path, call.handle, call.method.call_type, call.method.reply_type,
                      call.handler_name, server_cfg.max_message_bytes, lane_tls)
    servicer.lane_port = await lane.start(server_cfg.host, server_cfg.lane_port)
    return lane


async def serve_until_drained(service: ModelService, grace_s: float) -> None:
    install_drain_on_signals(service.running, grace_s)
    await service.running.wait()
    service.servicer.stop_reaper()
    service.worker.shutdown()
