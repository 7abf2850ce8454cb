"""gRPC server plumbing shared by the three roles: bind, health, reflection,
graceful drain, and the one thread that runs model forward passes."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import signal
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec.config import check_port, opt
from specdec.errors import Unavailable
from specdec.rpc.malformed import MalformedRequests

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# The longest job EngineWorker.run_short runs on the event loop, seconds
# (--inline-max-ms). Past it the job's two thread hand-offs are paid: ~0.2 ms
# each on the dev VM, where a T = 0.7 Verify of the tiny pair took 4-6 ms and
# flipped between the two ways at 5 ms (specd overhead --hops: the target's
# handler 0.26 against 0.6 ms a round). Holding the loop 10 ms delays its
# other work (health, model info, another request's call being read) by at
# most that.
INLINE_MAX_S = 0.010

# grpc binds its ports with SO_REUSEPORT unless told not to: a second
# server on a port in use (a `specd serve` started twice) bound it too, and
# the kernel split the connections between two processes, silently. Without
# it, the second bind fails ("cannot bind").
NO_REUSEPORT = ("grpc.so_reuseport", 0)

# Bounds on what callers may hold open (docs/security.md, "Bounded calls").
# --max-concurrent-rpcs: calls one gRPC port serves at once, each stream
# counting until it ends; the (N+1)th gets RESOURCE_EXHAUSTED from grpc itself
# at once. The dataclass default is the orchestrator's: its Generate streams
# are bounded by the targets' sessions (replicas x --max-sessions, 64 each by
# default), so 4096 is 64 full replicas. `specd serve draft|target` default to
# SERVICE_MAX_CONCURRENT_RPCS: each orchestrator holds one call stream to a
# service plus, per request, at most a few unary calls (open, close; Propose
# and Verify when call streams and lanes are off), so 1024 leaves room for
# --max-sessions in the hundreds.
MAX_CONCURRENT_RPCS = 4096
SERVICE_MAX_CONCURRENT_RPCS = 1024
# The plaintext health-only port (--health-port): a probe needs one call at a
# time; anyone on the network can reach it.
HEALTH_PORT_MAX_CONCURRENT_RPCS = 64
# grpc.health.v1.Health/Watch streams are long-lived: on every port they may
# hold at most this share of its concurrent calls, so Watches alone never
# refuse a Check (the probes) or the port's real calls.
WATCH_SHARE = 4  # at most 1/4
HEALTH_PORT_MAX_WATCHES = HEALTH_PORT_MAX_CONCURRENT_RPCS // WATCH_SHARE
# The health-only port closes each connection after this long (plus this
# grace for its calls to end), so a call that never completes (a stalled
# request, a Watch) gives its place back; probes open a connection per probe.
HEALTH_PORT_MAX_CONNECTION_AGE_MS = 60_000
HEALTH_PORT_MAX_CONNECTION_AGE_GRACE_MS = 10_000


@dataclass
class ServerConfig:
    """Network settings common to every role."""

    host: str = opt("127.0.0.1", "bind address (0.0.0.0 to listen on every interface)")
    port: int = opt(0, "gRPC port (0: pick a free one); the role's default is set by the CLI")
    max_message_bytes: int = opt(16 << 20, "largest gRPC message accepted or sent, bytes")
    max_concurrent_rpcs: int = opt(MAX_CONCURRENT_RPCS, "calls the gRPC port serves at once (at least 1), each "
                                   "stream (Generate, a call stream, Health/Watch) counting until it ends; the next "
                                   "gets RESOURCE_EXHAUSTED at once. Keep it well above the load: a service sees one "
                                   "call stream per orchestrator and a few calls per open session, the orchestrator "
                                   "one Generate per request. Health/Watch streams may hold a quarter of it. The "
                                   "--health-port has its own bound: "
                                   f"{HEALTH_PORT_MAX_CONCURRENT_RPCS} calls, "
                                   f"{HEALTH_PORT_MAX_WATCHES} of them Watch streams")
    drain_grace_s: float = opt(20.0, "on SIGTERM once serving: seconds in-flight calls get to finish (the "
                                     "orchestrator's HTTP requests still running then get 503); while still "
                                     "starting, SIGTERM exits at once")
    reflection: bool = opt(False, "enable gRPC server reflection")
    metrics_port: int = opt(0, "Prometheus metrics port, served at /metrics on the same host (0: off)")
    health_port: int = opt(-1, "a plaintext port on the same host serving grpc.health.v1 only, for probes that "
                               "cannot present a client certificate; at most "
                               f"{HEALTH_PORT_MAX_CONCURRENT_RPCS} calls at once "
                               f"({HEALTH_PORT_MAX_WATCHES} Watch streams), each connection "
                               f"closed after {HEALTH_PORT_MAX_CONNECTION_AGE_MS // 1000} s "
                               "(-1: off; 0: pick a free one)")
    cpu_wake_latency_us: int = opt(-1, "hold every CPU's wake-up latency at most this many microseconds while "
                                       "serving (0: idle CPUs poll; costs power; needs write access to "
                                       "/dev/cpu_dma_latency; specdec/cpu_latency.py); -1: leave the machine's")
    busy_poll_us: int = opt(-1, "poll the event loop instead of sleeping while a reply is due: the orchestrator "
                                "while it waits for a service's reply, up to this many microseconds a wait; a "
                                "service for this long after each reply it sends; costs up to a CPU each while "
                                "serving (specdec/busy_poll.py); 0: off; -1 (auto): 50000 where the models run "
                                "on a GPU and the process may use 4 CPUs or more, else off")
    lane_port: int = opt(0, "draft, target: the port of the service's lane, the round's one call to it as "
                            "frames on a TCP connection (TLS under --tls-cert), cheaper than over gRPC; "
                            "advertised in ModelInfo (-1: off; 0: pick a free one)")
    inline_max_ms: float = opt(INLINE_MAX_S * 1e3, "draft, target: a round's model work whose last run took at "
                                                   "most this many ms runs on the event loop, without the two "
                                                   "thread hand-offs (0: always on the engine thread); the loop "
                                                   "answers nothing else for that long")

    def __post_init__(self) -> None:
        check_port(self.port, "--port")
        check_port(self.metrics_port, "--metrics-port", meaning="0 (off)")
        check_port(self.health_port, "--health-port", lowest=-1, meaning="-1 (off), 0 (any free port)")
        check_port(self.lane_port, "--lane-port", lowest=-1, meaning="-1 (off), 0 (any free port)")
        if not self.max_concurrent_rpcs >= 1:
            raise ValueError(f"--max-concurrent-rpcs must be at least 1, got {self.max_concurrent_rpcs}")

    def channel_options(self) -> list[tuple[str, int]]:
        """The server's options: its message limits, and no SO_REUSEPORT."""
        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            NO_REUSEPORT,
        ]


class EngineWorker:
    """Runs blocking model work on one dedicated thread, off the event loop,
    so health checks and other calls are answered during a forward pass. One
    thread also serializes access to the (not thread-safe) engine.

    A hand-off to the thread and back costs two thread wake-ups (a futex,
    then the loop's self-pipe): on a busy host that is a large part of a
    cheap call. So short jobs run right on the event loop when the engine is
    idle (`run_short`, `run_quick`): the loop is then blocked for at most
    about `inline_max_s` (INLINE_MAX_S, or the services' --inline-max-ms).
    """

    def __init__(self, name: str = "engine", inline_max_s: float = INLINE_MAX_S):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        # Jobs handed to the thread, jobs the thread has finished, and jobs
        # cancelled before they started: each written by one thread only (the
        # loop, the engine thread, the loop), so `idle` needs no lock; a job
        # whose caller was cancelled while it ran counts until it ends.
        self._submitted = 0
        self._finished = 0
        self._cancelled = 0
        self.inline_max_s = inline_max_s
        self._last_s: dict[object, float] = {}  # the last duration of each kind of short job
        self._shut_down = False

    @property
    def pending(self) -> int:
        """Jobs queued or running on the engine thread."""
        return self._submitted - self._finished - self._cancelled

    @property
    def idle(self) -> bool:
        """No job is queued or running on the engine thread."""
        return self.pending == 0

    def _job(self, fn: Callable, args, kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            self._finished += 1

    async def run(self, fn: Callable, *args, **kwargs):
        self._submitted += 1
        try:
            future = self._pool.submit(self._job, fn, args, kwargs)
        except BaseException as exc:
            self._cancelled += 1
            if isinstance(exc, RuntimeError) and self._shut_down:
                # A job after the drain stopped the engine thread (an open's next
                # pass, say): the service is going away, not broken.
                raise Unavailable("the service is shutting down") from None
            raise
        future.add_done_callback(self._count_cancelled)
        return await asyncio.wrap_future(future)

    def _count_cancelled(self, future: concurrent.futures.Future) -> None:
        if future.cancelled():  # then this runs in the thread that cancelled it: the loop's
            self._cancelled += 1

    async def run_quick(self, fn: Callable, *args, **kwargs):
        """For O(1) bookkeeping (a rollback, a close): run it right here on
        the event loop when no job is queued or running, which saves the two
        thread hand-offs of `run` (most of a no-op call's cost); otherwise
        queue it behind the others like `run`, so calls keep their order."""
        if self.idle:
            return fn(*args, **kwargs)
        return await self.run(fn, *args, **kwargs)

    def note(self, kind: object, seconds: float) -> None:
        """Record what a job of `kind` took when it ran inside a larger job."""
        self._last_s[kind] = seconds

    def is_short(self, kind: object) -> bool:
        """Whether a job of `kind` would run right here on the event loop
        now (`run_short`): the engine is idle and the last one took at most
        `inline_max_s`."""
        return self.idle and self._last_s.get(kind, math.inf) <= self.inline_max_s

    async def run_short(self, kind: object, fn: Callable, *args, **kwargs):
        """A job that is often short (one round's verify, one round's k draft
        steps on a small model or a fast GPU): run on the event loop when the
        engine is idle and the last job of this `kind` took at most
        `inline_max_s`; on the thread otherwise (and the first time, to learn
        what it costs). Order is kept: an idle engine has nothing queued."""
        if not self.is_short(kind):
            return await self.run(self._timed, kind, fn, *args, **kwargs)
        return self._timed(kind, fn, *args, **kwargs)

    def _timed(self, kind: object, fn: Callable, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._last_s[kind] = time.perf_counter() - start

    def shutdown(self) -> None:
        self._shut_down = True
        self._pool.shutdown(wait=False, cancel_futures=True)


class RunningServer:
    """A started grpc.aio server with its health service."""

    def __init__(self, server: grpc.aio.Server, port: int, health_servicer, service_names: Sequence[str],
                 health_server: grpc.aio.Server | None = None, health_port: int = -1):
        self.server = server
        self.port = port
        self.health_server = health_server  # the plaintext health-only port's server, if any
        self.health_port = health_port
        self.health = health_servicer
        self.service_names = ("", *service_names)
        self._stopped = asyncio.Event()
        self.failure: str | None = None  # why it was drained by itself (a device that failed), if it was
        self.draining = False  # once set, nothing may report SERVING again
        # Run when a drain stops accepting calls: what must end for the grace
        # period to be able to end (the servicers' long-lived call streams).
        self.drain_hooks: list[Callable[[], None]] = []
        # Awaited with the grace period during a drain: what answers calls
        # outside the gRPC server (the services' lanes) and must finish too.
        self.drain_waits: list[Callable[[float], Awaitable[None]]] = []

    async def set_status(self, status) -> None:
        for name in self.service_names:
            await self.health.set(name, status)

    async def set_serving(self) -> None:
        await self.set_status(SERVING)

    async def set_readiness(self, serving: bool) -> None:
        """The services' own statuses only (what readiness probes check):
        SERVING or NOT_SERVING while the process stays healthy. The overall
        "" status (what liveness probes check) is left SERVING, so that an
        outage downstream takes the server out of rotation without getting
        it restarted. Does nothing once draining: then all is NOT_SERVING."""
        for name in self.service_names:
            if name and not self.draining:
                await self.health.set(name, SERVING if serving else NOT_SERVING)

    async def drain(self, grace_s: float) -> None:
        """NOT_SERVING first (so balancers stop routing), then stop accepting
        and let in-flight calls finish within the grace period."""
        if self._stopped.is_set():
            return
        self.draining = True
        await self.set_status(NOT_SERVING)
        stopping = asyncio.ensure_future(self.server.stop(grace_s))
        for hook in self.drain_hooks:
            hook()
        await asyncio.gather(stopping, *(wait(grace_s) for wait in self.drain_waits))
        if self.health_server is not None:
            await self.health_server.stop(0)
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()


class BoundedHealth(health_pb2_grpc.HealthServicer):
    """One port's view of the shared health servicer: Check as it is, and at
    most `max_watches` Watch streams at once on this port, the next refused
    RESOURCE_EXHAUSTED (a Watch lasts until its caller leaves; the statuses a
    probe needs are one Check away). Other methods (List) are the base
    class's, as the shared servicer does not implement them either."""

    def __init__(self, health_servicer, max_watches: int):
        self._health = health_servicer
        self.max_watches = max_watches
        self.watches = 0

    async def Check(self, request, context):
        return await self._health.Check(request, context)

    async def Watch(self, request, context):
        if self.watches >= self.max_watches:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many Health/Watch streams on this port (at most {self.max_watches} at once); "
                                "use Health/Check")
        self.watches += 1
        try:
            await self._health.Watch(request, context)
        finally:
            self.watches -= 1


def watch_limit(max_concurrent_rpcs: int) -> int:
    """Watch streams one port serves at once: its WATCH_SHARE, at least one."""
    return max(1, max_concurrent_rpcs // WATCH_SHARE)


def bind_address(host: str, port: int) -> str:
    """grpc's address for host and port: an IPv6 literal in brackets (`--host ::`,
    as an IPv6-only cluster needs, is `[::]:PORT`; the other listeners, the lane,
    metrics and HTTP, take the bare host)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def start_server(
    cfg: ServerConfig,
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    interceptors: Sequence = (),
    credentials: grpc.ServerCredentials | None = None,
) -> RunningServer:
    """Bind and start a server that reports NOT_SERVING until `set_serving()`;
    over TLS when `credentials` are given (plaintext otherwise), plus the
    plaintext health-only port when `cfg.health_port` asks for one."""
    # Innermost: undecodable request bytes get INVALID_ARGUMENT, not UNKNOWN.
    server = grpc.aio.server(options=cfg.channel_options(), interceptors=[*interceptors, MalformedRequests()],
                             maximum_concurrent_rpcs=cfg.max_concurrent_rpcs)
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(
        BoundedHealth(health_servicer, watch_limit(cfg.max_concurrent_rpcs)), server)
    if cfg.reflection:
        from grpc_reflection.v1alpha import reflection

        names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, server)
    address = bind_address(cfg.host, cfg.port)
    port = _bind(lambda: server.add_secure_port(address, credentials) if credentials
                 else server.add_insecure_port(address), f"{cfg.host}:{cfg.port}")
    health_server, health_port = (await _start_health_only(cfg, health_servicer)) if cfg.health_port >= 0 else (None, -1)
    running = RunningServer(server, port, health_servicer, service_names, health_server, health_port)
    await running.set_status(NOT_SERVING)
    await server.start()
    log.info("listening on %s%s", bind_address(cfg.host, port), " (TLS)" if credentials else "")
    return running


def _bind(add_port: Callable[[], int], what: str) -> int:
    """The port grpc bound, or OSError saying which could not be (grpc
    answers 0 or raises RuntimeError, by version)."""
    try:
        port = add_port()
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"cannot bind {what}: another process may be using it")
    return port


async def _start_health_only(cfg: ServerConfig, health_servicer) -> tuple[grpc.aio.Server, int]:
    """Kubernetes' native gRPC probes speak plaintext and present no client
    certificate, so under mutual TLS they get this port: grpc.health.v1 and
    nothing else (it reveals only SERVING / NOT_SERVING), sharing the main
    server's health statuses.

    Anyone on the network may call it, so it is bounded: at most
    HEALTH_PORT_MAX_CONCURRENT_RPCS calls at once (the next gets
    RESOURCE_EXHAUSTED from grpc), a quarter of them Watch streams, so that
    Watches alone never refuse a probe's Check; and each connection closes
    after HEALTH_PORT_MAX_CONNECTION_AGE_MS, so calls that never end give
    their places back."""
    server = grpc.aio.server(
        options=[NO_REUSEPORT, ("grpc.max_connection_age_ms", HEALTH_PORT_MAX_CONNECTION_AGE_MS),
                 ("grpc.max_connection_age_grace_ms", HEALTH_PORT_MAX_CONNECTION_AGE_GRACE_MS)],
        maximum_concurrent_rpcs=HEALTH_PORT_MAX_CONCURRENT_RPCS)
    health_pb2_grpc.add_HealthServicer_to_server(
        BoundedHealth(health_servicer, HEALTH_PORT_MAX_WATCHES), server)
    port = _bind(lambda: server.add_insecure_port(bind_address(cfg.host, cfg.health_port)),
                 f"the health port {cfg.host}:{cfg.health_port}")
    await server.start()
    log.info("health checks (plaintext, grpc.health.v1 only) on %s:%d", cfg.host, port)
    return server, port


def install_drain_on_signals(running: RunningServer, grace_s: float) -> None:
    """SIGTERM / SIGINT start a graceful drain (in the running loop)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(running.drain(grace_s)))
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-main thread / Windows
            pass
