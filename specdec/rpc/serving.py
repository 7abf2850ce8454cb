"""gRPC server plumbing shared by the three roles: bind, health, reflection,
graceful drain, and the one thread that runs model forward passes."""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import signal
from dataclasses import dataclass
from typing import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec.config import opt
from specdec.rpc.malformed import MalformedRequests

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class ServerConfig:
    """Network settings common to every role."""

    host: str = opt("127.0.0.1", "bind address (0.0.0.0 to listen on every interface)")
    port: int = opt(0, "gRPC port (0: pick a free one); the role's default is set by the CLI")
    max_message_bytes: int = opt(16 << 20, "largest gRPC message accepted or sent, bytes")
    drain_grace_s: float = opt(20.0, "on SIGTERM: seconds in-flight calls get to finish")
    reflection: bool = opt(False, "enable gRPC server reflection")
    metrics_port: int = opt(0, "Prometheus metrics port, served at /metrics on the same host (0: off)")

    def channel_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
        ]


class EngineWorker:
    """Runs blocking model work on one dedicated thread, off the event loop,
    so health checks and other calls are answered during a forward pass. One
    thread also serializes access to the (not thread-safe) engine."""

    def __init__(self, name: str = "engine"):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending = 0  # jobs submitted and not yet awaited back; touched on the event loop only

    async def run(self, fn: Callable, *args, **kwargs):
        loop = asyncio.get_running_loop()
        self._pending += 1
        try:
            return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        finally:
            self._pending -= 1

    async def run_quick(self, fn: Callable, *args, **kwargs):
        """For O(1) bookkeeping (a rollback, a close): run it right here on
        the event loop when no job is queued or running, which saves the two
        thread hand-offs of `run` (most of a no-op call's cost); otherwise
        queue it behind the others like `run`, so calls keep their order."""
        if self._pending == 0:
            return fn(*args, **kwargs)
        return await self.run(fn, *args, **kwargs)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RunningServer:
    """A started grpc.aio server with its health service."""

    def __init__(self, server: grpc.aio.Server, port: int, health_servicer, service_names: Sequence[str]):
        self.server = server
        self.port = port
        self.health = health_servicer
        self.service_names = ("", *service_names)
        self._stopped = asyncio.Event()
        self.draining = False  # once set, nothing may report SERVING again

    async def set_status(self, status) -> None:
        for name in self.service_names:
            await self.health.set(name, status)

    async def set_serving(self) -> None:
        await self.set_status(SERVING)

    async def drain(self, grace_s: float) -> None:
        """NOT_SERVING first (so balancers stop routing), then stop accepting
        and let in-flight calls finish within the grace period."""
        if self._stopped.is_set():
            return
        self.draining = True
        await self.set_status(NOT_SERVING)
        await self.server.stop(grace_s)
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()


async def start_server(
    cfg: ServerConfig,
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    interceptors: Sequence = (),
) -> RunningServer:
    """Bind and start a server that reports NOT_SERVING until `set_serving()`."""
    # Innermost: undecodable request bytes get INVALID_ARGUMENT, not UNKNOWN.
    server = grpc.aio.server(options=cfg.channel_options(), interceptors=[*interceptors, MalformedRequests()])
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if cfg.reflection:
        from grpc_reflection.v1alpha import reflection

        names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    if port == 0:
        raise OSError(f"cannot bind {cfg.host}:{cfg.port}")
    running = RunningServer(server, port, health_servicer, service_names)
    await running.set_status(NOT_SERVING)
    await server.start()
    log.info("listening on %s:%d", cfg.host, port)
    return running


def install_drain_on_signals(running: RunningServer, grace_s: float) -> None:
    """SIGTERM / SIGINT start a graceful drain (in the running loop)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(running.drain(grace_s)))
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-main thread / Windows
            pass
