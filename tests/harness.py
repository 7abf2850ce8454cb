"""Run in-process services on 127.0.0.1:0 in a background event loop, and talk
to them with ordinary (sync) gRPC clients, as a user's program would."""
from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
import time
from contextlib import contextmanager

import grpc

from draft_service.drafters import ModelDrafter
from draft_service.ngram_drafter import NgramDrafter
from draft_service.server import start_draft_service
from specdec.rpc.session_limits import SessionLimits
from specdec.rpc.serving import ServerConfig
from specdec.eventloop import BackgroundLoop as _BackgroundLoop
from specdec.latency_proxy import LatencyProxy
from specdec.telemetry import NOOP
from specdec.v1 import draft_pb2_grpc, target_pb2_grpc
from target_service.server import start_target_service
from target_service.verifier import Verifier

DEADLINE_S = 30.0


def wait_until(predicate, timeout_s: float = 20.0) -> None:
    """Poll `predicate` every 50 ms until it holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def BackgroundLoop() -> _BackgroundLoop:
    """The tests' servers run on asyncio's own loop, on a daemon thread."""
    return _BackgroundLoop(asyncio.new_event_loop)


def local_config(**kwargs) -> ServerConfig:
    return ServerConfig(host="127.0.0.1", port=0, **kwargs)


@contextmanager
def running_target(engine, limits: SessionLimits | None = None, server_cfg: ServerConfig | None = None,
                   telemetry=NOOP):
    """A target service over `engine`; yields (service, stub, loop)."""
    limits = limits or SessionLimits()
    loop = BackgroundLoop()
    service = loop.run(start_target_service(
        server_cfg or local_config(), limits,
        lambda: Verifier(engine, limits.max_draft_tokens, limits.max_verify_batch), telemetry=telemetry))
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    try:
        yield service, target_pb2_grpc.TargetServiceStub(channel), loop
    finally:
        channel.close()
        loop.run(service.stop(0))
        loop.close()


REPLICAS_NAME = "target.specdec.svc"


@contextmanager
def target_replicas_behind_one_name(monkeypatch, engine_a, engine_b):
    """Two target services on one port at 127.0.0.1 and 127.0.0.2, and the
    name REPLICAS_NAME resolving to both, like pods behind a Kubernetes
    headless Service; yields (port, (service_a, loop_a), (service_b, loop_b))."""
    with running_target(engine_a) as (svc_a, _, loop_a):
        port = svc_a.port
        cfg = local_config()
        cfg.host, cfg.port = "127.0.0.2", port
        with running_target(engine_b, server_cfg=cfg) as (svc_b, _, loop_b):
            real = socket.getaddrinfo

            def fake(host, *args, **kwargs):
                if host == REPLICAS_NAME:
                    return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ("127.0.0.1", "127.0.0.2")]
                return real(host, *args, **kwargs)

            monkeypatch.setattr(socket, "getaddrinfo", fake)
            yield port, (svc_a, loop_a), (svc_b, loop_b)


def start_orchestrator_on_replicas(loop, port: int, **cfg):
    """An orchestrator on `loop` whose target is REPLICAS_NAME:`port`, no
    draft; a cluster name, so plaintext must be asked for (docs/security.md)."""
    from orchestrator.config import OrchestratorConfig
    from orchestrator.server import start_orchestrator
    from specdec.security.tls import TlsConfig

    return loop.run(start_orchestrator(local_config(), OrchestratorConfig(
        target=f"{REPLICAS_NAME}:{port}", draft="", connect_timeout_s=10, **cfg), tls=TlsConfig(insecure=True)))


@contextmanager
def running_draft(engine=None, limits: SessionLimits | None = None, ngram_vocab: int = 0,
                  server_cfg: ServerConfig | None = None, max_q_tokens: int = 32, telemetry=NOOP,
                  run_ahead: str = "auto"):
    """A draft service over `engine` (or an n-gram drafter when ngram_vocab > 0)."""
    limits = limits or SessionLimits()
    loop = BackgroundLoop()
    if ngram_vocab:
        build, kind = (lambda: NgramDrafter(ngram_vocab, max_draft_tokens=limits.max_draft_tokens)), "ngram"
    else:
        build, kind = (lambda: ModelDrafter(engine, limits.max_draft_tokens, max_q_tokens, run_ahead)), "model"
    service = loop.run(start_draft_service(server_cfg or local_config(), limits, build, backend_kind=kind,
                                           telemetry=telemetry))
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    try:
        yield service, draft_pb2_grpc.DraftServiceStub(channel), loop
    finally:
        channel.close()
        loop.run(service.stop(0))
        loop.close()


@contextmanager
def running_system(target_engine, draft_engine=None, ngram: bool = False, tokenizer=None,
                   limits: SessionLimits | None = None, telemetry: dict | None = None, http=None,
                   draft_run_ahead: str = "auto", draft_grpc_delay_ms: float = 0.0, **orch_kwargs):
    """Target + draft (model, ngram, or none) + orchestrator, all on port 0.
    `telemetry` maps a role (draft, target, orchestrator) to its Telemetry;
    `http` (an HttpConfig) adds the orchestrator's HTTP front door
    (.orchestrator.http.port). `draft_grpc_delay_ms`: the orchestrator dials
    the draft's gRPC port through a LatencyProxy of that one-way delay; its
    lane (the round's ProposeAll) stays direct.
    Yields a namespace with .client (orchestrator.client.Client), .target, .draft,
    .orchestrator, .loop."""
    import types

    from orchestrator.client import Client
    from orchestrator.config import OrchestratorConfig
    from orchestrator.server import start_orchestrator

    tel = {"draft": NOOP, "target": NOOP, "orchestrator": NOOP, **(telemetry or {})}
    # Rounds draft exactly their k unless a test asks for the early stop: a
    # tiny random draft is unsure of nearly every token, so the server's
    # default would cut almost every round to one draft.
    orch_kwargs.setdefault("draft_min_confidence", 0.0)
    with running_target(target_engine, limits, telemetry=tel["target"]) as (target, _, _tl):
        draft_cm = (running_draft(limits=limits, ngram_vocab=target_engine.vocab_size, telemetry=tel["draft"])
                    if ngram else running_draft(draft_engine, limits, telemetry=tel["draft"], run_ahead=draft_run_ahead)
                    if draft_engine is not None else None)
        draft = draft_cm.__enter__() if draft_cm else None
        proxy = LatencyProxy(f"127.0.0.1:{draft[0].port}", delay_ms=draft_grpc_delay_ms) \
            if draft and draft_grpc_delay_ms else None
        loop = BackgroundLoop()
        try:
            if proxy is not None:
                proxy.start()
            cfg = OrchestratorConfig(target=f"127.0.0.1:{target.port}",
                                     draft=(proxy.address if proxy else f"127.0.0.1:{draft[0].port}") if draft else "",
                                     connect_timeout_s=10, **orch_kwargs)
            orch = loop.run(start_orchestrator(local_config(), cfg, tokenizer=tokenizer,
                                               telemetry=tel["orchestrator"], http=http))
            client = Client(f"127.0.0.1:{orch.port}", timeout_s=120)
            try:
                yield types.SimpleNamespace(client=client, target=target, draft=draft[0] if draft else None,
                                            orchestrator=orch, loop=loop, draft_loop=draft[2] if draft else None,
                                            target_loop=_tl)
            finally:
                client.close()
                loop.run(orch.stop(0))
        finally:
            loop.close()
            if proxy is not None:
                proxy.stop()
            if draft_cm:
                draft_cm.__exit__(None, None, None)


def complete_seeds(system, prompt, seeds, workers: int = 32, **kwargs) -> list:
    """`system.client.complete(prompt, seed=seed, **kwargs)` for each seed, in
    order, `workers` requests at a time, each worker with a client of its own
    (a Client keeps per-call state). A seeded request's draws are keyed by
    (seed, position), not by what it is batched with, so this gives the same
    results as one request at a time, while the services batch the requests
    (fewer forward passes, the statistical tests' main cost). 32 at a time
    rather than 8 took a quarter off such a test on the 2-core dev VM
    (2026-11-28: pipelining's poor-draft case 45.7 -> 35.2 s, the draft
    failure case 32.0 -> 23.2 s)."""
    from orchestrator.client import Client

    local, clients, lock = threading.local(), [], threading.Lock()

    def complete(seed):
        if not hasattr(local, "client"):
            local.client = Client(f"127.0.0.1:{system.orchestrator.port}", timeout_s=120)
            with lock:
                clients.append(local.client)
        return local.client.complete(prompt, seed=seed, **kwargs)

    try:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            return list(pool.map(complete, seeds))
    finally:
        for client in clients:
            client.close()
