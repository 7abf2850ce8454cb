"""How the orchestrator finds, admits and lets go of the replicas a service
name stands for (`orchestrator/replicas.py`, `orchestrator/server.py`'s
start-up): refreshes that run without traffic, one at a time, never wait for
a new replica nor retire anything on a failed lookup; replicas that do not
fit are refused; start-up needs one replica, not all; no channel is leaked.
The first tests use fake replicas (no models); the others real services."""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator import downstream, replicas as R, server as S
from orchestrator.client import Client
from orchestrator.config import OrchestratorConfig
from orchestrator.downstream import open_request, open_to_its_end
from orchestrator.recovery import RecoverySettings, TargetLease
from specdec.errors import FailedPrecondition, SpecdecError, Unavailable
from specdec.security.tls import TlsConfig
from tests.conftest import tiny_engine, tiny_model
from tests.harness import BackgroundLoop, REPLICAS_NAME, local_config, running_target, wait_until

A, B = "10.0.0.1:1", "10.0.0.2:1"


def _pool(make_delay: float = 0.0):
    """A pool of fake replicas whose connect takes `make_delay`; (pool, made, closed)."""
    made, closed = [], []

    async def make(address):
        await asyncio.sleep(make_delay)  # the real one awaits GetModelInfo
        replica = R.Replica(address, client=object())
        made.append(replica)
        return replica

    async def close(replica):
        closed.append(replica)

    return R.ReplicaPool("target.svc:1", make, close, refresh_s=3600), made, closed


async def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_concurrent_refreshes_make_one_replica_per_address_and_close_it(monkeypatch):
    """Refreshes from several callers at once (requests recovering, the
    periodic one) share one: a new address is connected once, and every
    replica made is closed with the pool."""
    addresses = [A]
    monkeypatch.setattr(R, "resolve", lambda name: list(addresses))

    async def run():
        pool, made, closed = _pool(make_delay=0.05)
        await pool.refresh()
        addresses.append(B)
        await asyncio.gather(pool.refresh(), pool.refresh(), pool.refresh())
        await pool.refresh()  # while B may still be connecting
        await _until(lambda: B in pool.replicas)
        await asyncio.sleep(0.2)  # time for a second connect to B to end, if one was started
        await pool.close()
        assert [r.address for r in made].count(B) == 1, [r.address for r in made]
        assert all(r in closed for r in made)

    asyncio.run(run())


def test_a_failed_lookup_keeps_the_replicas_known(monkeypatch):
    """A DNS hiccup (or a Service with no ready pod) retires nothing; only a
    pool that knows no replica yet dials the name itself."""
    real = socket.getaddrinfo
    failing = {"on": True}

    def fake(host, *args, **kwargs):
        if host == "target.svc":
            if failing["on"]:
                raise socket.gaierror(-3, "Temporary failure in name resolution")
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, 1)) for ip in ("10.0.0.1", "10.0.0.2")]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake)

    async def run():
        pool, made, closed = _pool()
        await pool.refresh()  # nothing known yet: the name itself
        await _until(lambda: "target.svc:1" in pool.replicas)
        failing["on"] = False
        await pool.refresh()
        await _until(lambda: A in pool.replicas and B in pool.replicas)
        failing["on"] = True
        await pool.refresh()
        live = sorted(a for a, r in pool.replicas.items() if not r.retired)
        await pool.close()
        assert live == [A, B], live

    asyncio.run(run())


def test_a_replica_listed_again_takes_requests_again(monkeypatch):
    """A pod that failed one readiness probe (out of the name for one
    refresh) is un-retired when it is listed again, even while requests
    it had before still run on it."""
    addresses = [A, B]
    monkeypatch.setattr(R, "resolve", lambda name: list(addresses))

    async def run():
        pool, _, _ = _pool()
        await pool.refresh()
        await _until(lambda: len(pool.replicas) == 2)
        a = pool.replicas[A]
        a.active = 1
        addresses.remove(A)
        await pool.refresh()
        assert a.retired
        addresses.insert(0, A)
        await pool.refresh()
        assert not a.retired and pool.replicas[A] is a
        await pool.close()

    asyncio.run(run())


def test_close_stops_a_refresh_in_progress(monkeypatch):
    """A refresh a request started, still connecting to a new replica when
    the pool closes, adds nothing after the close and leaks nothing."""
    addresses = [A]
    monkeypatch.setattr(R, "resolve", lambda name: list(addresses))

    async def run():
        pool, made, closed = _pool(make_delay=0.2)
        await pool.refresh()
        await _until(lambda: A in pool.replicas)
        addresses.append(B)
        pool._resolved_at = 0.0  # stale: the next acquire refreshes in the background
        await pool.release(pool.acquire())
        await asyncio.sleep(0.05)
        await pool.close()
        await asyncio.sleep(0.4)
        assert pool.replicas == {} and all(r in closed for r in made), (pool.replicas, made, closed)

    asyncio.run(run())


def test_a_refresh_does_not_wait_for_a_replica_that_does_not_answer(monkeypatch):
    """A new address that does not answer joins in the background: the
    refresh (a recovering request's too) returns at once, and the connect is
    stopped when the address leaves the name."""
    addresses = [A]
    monkeypatch.setattr(R, "resolve", lambda name: list(addresses))
    cancelled = []

    async def run():
        pool, made, closed = _pool()
        await pool.refresh()
        await _until(lambda: A in pool.replicas)
        make = pool._make

        async def silent(address):
            if address == A:
                return await make(address)
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(address)  # the real make closes its channel here
                raise

        pool._make = silent
        addresses.append(B)
        await asyncio.wait_for(pool.refresh(), 1.0)
        assert list(pool.replicas) == [A] and pool.acquire().address == A
        addresses.remove(B)
        await asyncio.wait_for(pool.refresh(), 1.0)
        await _until(lambda: cancelled == [B])
        await pool.close()

    asyncio.run(run())


def test_the_pool_refreshes_on_its_own_and_refuses_what_admit_refuses(monkeypatch, caplog):
    """`start_refreshing`: re-resolved without any request; a replica `admit`
    refuses is closed, with a WARNING that says why."""
    addresses = [A]
    monkeypatch.setattr(R, "resolve", lambda name: list(addresses))

    def admit(replica):
        if replica.address == B:
            raise FailedPrecondition("its max_context is below the orchestrator's")

    async def run():
        pool, made, closed = _pool()
        pool.refresh_s = 0.05
        await pool.start(timeout_s=5)
        pool.admit = admit
        pool.start_refreshing()
        addresses[:] = [B, "10.0.0.3:1"]
        await _until(lambda: "10.0.0.3:1" in pool.replicas and A not in pool.replicas)
        await _until(lambda: any(r.address == B for r in closed))
        assert B not in pool.replicas
        await pool.close()
        assert all(r in closed for r in made)

    with caplog.at_level(logging.WARNING, logger="orchestrator.replicas"):
        asyncio.run(run())
    assert any("10.0.0.2:1 refused: its max_context" in r.getMessage() for r in caplog.records)


# --- real services ------------------------------------------------------------------------------


@pytest.fixture
def clients(monkeypatch):
    """Every downstream client the orchestrator makes, and those it closed."""
    made, closed = [], []
    for name in ("TargetClient", "DraftClient"):
        real = getattr(S, name)

        def recording(channel, _real=real, **kwargs):
            made.append(_real(channel, **kwargs))
            return made[-1]

        monkeypatch.setattr(S, name, recording)
    aclose = downstream.ModelClient.aclose

    async def recording_close(self):
        closed.append(self)
        await aclose(self)

    monkeypatch.setattr(downstream.ModelClient, "aclose", recording_close)
    return made, closed


@contextmanager
def _dns(monkeypatch, port: int, *ips: str):
    """REPLICAS_NAME resolves to `ips` (a list the test changes), on `port`."""
    listed = list(ips)
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: (
        [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in listed] if host == REPLICAS_NAME
        else real(host, *a, **k)))
    yield listed


@contextmanager
def _orchestrator(port_or_target, **cfg):
    """An orchestrator on its own loop (stopped on leaving); yields (orchestrator, loop)."""
    target = port_or_target if isinstance(port_or_target, str) else f"{REPLICAS_NAME}:{port_or_target}"
    cfg.setdefault("connect_timeout_s", 10)
    loop = BackgroundLoop()
    try:
        orch = loop.run(S.start_orchestrator(local_config(), OrchestratorConfig(target=target, draft="", **cfg),
                                             tls=TlsConfig(insecure=True)))
        try:
            yield orch, loop
        finally:
            loop.run(orch.stop(0))
    finally:
        loop.close()


def _second_target(engine, port: int, host: str = "127.0.0.2"):
    cfg = local_config()
    cfg.host, cfg.port = host, port
    return running_target(engine, server_cfg=cfg)


def _readiness(port: int) -> str:
    """The orchestrator service's own health status (what readiness probes read)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=S.SERVICE_NAME), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_replaced_pods_are_found_without_traffic(monkeypatch):
    """Every target pod replaced while no request comes: the orchestrator
    finds the new one by itself and is SERVING again."""
    with running_target(tiny_engine(seed=0)) as (svc_a, _, loop_a), \
            _second_target(tiny_engine(seed=0), svc_a.port), _dns(monkeypatch, svc_a.port, "127.0.0.1") as ips, \
            _orchestrator(svc_a.port, health_interval_s=0.2, resolve_interval_s=0.5) as (orch, _):
        loop_a.run(svc_a.stop(0))
        wait_until(lambda: _readiness(orch.port) == "NOT_SERVING", 10)
        ips[:] = ["127.0.0.2"]
        wait_until(lambda: list(orch.backends.targets.replicas) == [f"127.0.0.2:{svc_a.port}"]
                   and _readiness(orch.port) == "SERVING", 15)


def test_a_new_replica_that_does_not_answer_blocks_nothing_and_is_closed(monkeypatch, clients):
    """A listed address where nothing answers: the refresh returns at once,
    a recovering request keeps to its deadline, and its channel is closed."""
    with running_target(tiny_engine(seed=0)) as (svc, _, tloop), _dns(monkeypatch, svc.port, "127.0.0.1") as ips, \
            _orchestrator(svc.port, connect_timeout_s=30, resolve_interval_s=3600) as (orch, loop):
        pool = orch.backends.targets
        ips.append("127.0.0.3")
        t0 = time.monotonic()
        loop.run(pool.refresh())
        assert time.monotonic() - t0 < 1.0
        tloop.run(svc.stop(0))  # the only replica that answered is gone

        async def recover():
            lease = TargetLease(pool, RecoverySettings(window_s=30))
            t = time.monotonic()
            with pytest.raises(SpecdecError):
                await lease.reopen(open_request([3, 4, 5], 0.0, 0, 1.0, 1, 8, "r"), time.monotonic() + 1.0,
                                   Exception("UNAVAILABLE"),
                                   lambda c, r, w: open_to_its_end(c, r, 5.0, w, lambda *a: None))
            await lease.release()
            return time.monotonic() - t

        assert loop.run(recover()) < 1.5
    made, closed = clients
    assert len(made) == 2 and all(c in closed for c in made), (len(made), len(closed))


def test_replicas_that_disagree_on_limits_serve_by_the_smallest_and_a_smaller_one_is_refused_later(
        monkeypatch, clients, caplog):
    """At start-up the smallest max_context of all replicas is the
    orchestrator's; a replica that joins later with a smaller one is refused
    (WARNING) and its channel closed."""
    with running_target(tiny_engine(seed=0)) as (svc_a, _, _), \
            _second_target(tiny_engine(seed=0, max_context=64), svc_a.port), \
            _dns(monkeypatch, svc_a.port, "127.0.0.1", "127.0.0.2") as ips:
        with _orchestrator(svc_a.port, resolve_interval_s=3600) as (orch, _):
            assert orch.backends.settings.max_context == 64
            with Client(f"127.0.0.1:{orch.port}", timeout_s=60) as client:
                with pytest.raises(grpc.RpcError, match="context limit of 64"):
                    client.complete(list(range(3, 83)), max_tokens=8, temperature=0)
        ips[:] = ["127.0.0.1"]
        with caplog.at_level(logging.WARNING, logger="orchestrator.replicas"), \
                _orchestrator(svc_a.port, resolve_interval_s=3600) as (orch, loop):
            assert orch.backends.settings.max_context > 64
            ips.append("127.0.0.2")
            loop.run(orch.backends.targets.refresh())
            wait_until(lambda: any("127.0.0.2" in r.getMessage() and "refused" in r.getMessage()
                                   for r in caplog.records), 15)
            assert list(orch.backends.targets.replicas) == [f"127.0.0.1:{svc_a.port}"]
    made, closed = clients
    assert len(made) == 4 and all(c in closed for c in made), (len(made), len(closed))


def test_replicas_with_different_token_ids_refuse_to_start(monkeypatch, clients):
    with running_target(tiny_engine(seed=0)) as (svc_a, _, _), \
            _second_target(tiny_engine(model=tiny_model(seed=0, vocab_size=192)), svc_a.port), \
            _dns(monkeypatch, svc_a.port, "127.0.0.1", "127.0.0.2"):
        with pytest.raises(FailedPrecondition, match="target replica .* vocabulary size"):
            with _orchestrator(svc_a.port):
                pass
    made, closed = clients
    assert len(made) == 2 and all(c in closed for c in made)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_starts_on_the_live_replica_of_a_list_and_the_other_joins_when_it_answers():
    late = _free_port()
    with running_target(tiny_engine(seed=0)) as (svc, _, _):
        t0 = time.monotonic()
        with _orchestrator(f"127.0.0.1:{svc.port},127.0.0.1:{late}", connect_timeout_s=3,
                           resolve_interval_s=0.5) as (orch, _):
            assert time.monotonic() - t0 < 8
            pool = orch.backends.targets
            assert list(pool.replicas) == [f"127.0.0.1:{svc.port}"]
            with _second_target(tiny_engine(seed=0), late, host="127.0.0.1"):
                wait_until(lambda: f"127.0.0.1:{late}" in pool.replicas, 15)


def test_a_failed_start_closes_every_channel(clients):
    """The draft never answers: start-up fails, and the target's channel
    (which did answer) is closed with the draft's."""
    with running_target(tiny_engine(seed=0)) as (svc, _, _):
        loop = BackgroundLoop()
        try:
            with pytest.raises(Unavailable):
                loop.run(S.start_orchestrator(local_config(), OrchestratorConfig(
                    target=f"127.0.0.1:{svc.port}", draft="127.0.0.1:1", connect_timeout_s=1)))
        finally:
            loop.close()
    made, closed = clients
    assert len(made) == 2 and all(c in closed for c in made), (len(made), len(closed))
