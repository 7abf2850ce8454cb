"""The orchestrator's health: its health loop (orchestrator/recovery.py,
`report_health`), what it reports at both front doors (gRPC readiness, HTTP
/health) and to liveness, how replicas are marked down (targets and drafts),
and where a target recovery re-opens a session.

Readiness (the specdec.v1.OrchestratorService status, HTTP /health) follows
the targets; liveness (the "" status) stays SERVING while the process is
healthy, so a target outage takes the orchestrator out of rotation without
getting it restarted, which would kill the requests waiting in recovery."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from orchestrator.downstream import CallCost, open_request, open_to_its_end
from orchestrator.recovery import RecoverySettings, TargetLease, report_health
from orchestrator.replicas import Replica, ReplicaPool
from orchestrator.server import SERVICE_NAME
from specdec.errors import DeadlineExceeded
from specdec.rpc.serving import start_server
from tests.conftest import tiny_engine
from tests.harness import BackgroundLoop, local_config, running_draft, running_system, running_target, wait_until

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
Status = health_pb2.HealthCheckResponse


# ---------------------------------------------------------------- helpers

class _SlowHealth(health_pb2_grpc.HealthServicer):
    """A replica whose health Check hangs (a frozen process)."""

    async def Check(self, request, context):
        await asyncio.sleep(30)
        return health_pb2.HealthCheckResponse(status=Status.SERVING)


async def _health_server(servicer) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _replica(name: str, port: int) -> Replica:
    """A replica whose client is just a channel (all the health loop uses)."""
    return Replica(name, types.SimpleNamespace(channel=grpc.aio.insecure_channel(f"127.0.0.1:{port}")))


def _free_port() -> int:
    """A port nothing listens on (a dead replica's)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pool(*replicas: Replica) -> ReplicaPool:
    """A pool of `replicas` that counts its `refresh_soon` calls (`refreshes`)
    instead of resolving its name."""
    pool = ReplicaPool("target:1", make_replica=None, close_replica=None, refresh_s=3600)
    pool._resolved_at = time.monotonic()
    pool.replicas = {r.address: r for r in replicas}
    pool.refreshes = 0

    def refresh_soon():
        pool.refreshes += 1

    pool.refresh_soon = refresh_soon
    return pool


async def _until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return condition()


@contextlib.asynccontextmanager
async def _health_loop(targets: ReplicaPool, interval_s: float, drafts: ReplicaPool | None = None,
                       set_serving=None, servers=()):
    """The health loop over the pools, yielding (its task, what it reported);
    then stopped as the orchestrator stops it (it must end cancelled), and
    the replicas' channels and `servers` closed."""
    reported = []

    async def record(serving):
        reported.append(serving)

    task = asyncio.ensure_future(report_health(targets, set_serving or record, interval_s, drafts))
    try:
        yield task, reported
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        assert task.cancelled()
        for pool in filter(None, (targets, drafts)):
            for replica in pool.replicas.values():
                if replica.client.channel is not None:
                    await replica.client.channel.close()
        for server in servers:
            await server.stop(0)


# ------------------------------------------------------ the health loop (bug 1)

def test_the_health_loop_survives_an_unexpected_failure_of_a_check():
    """A check that fails otherwise than with an RPC error (here the
    client has no channel; on a closed one, a UsageError) counts the replica
    down, and the loop goes on: it used to end, quietly, for good. While no
    target serves, it has the pool re-resolve the name at once."""
    async def run():
        good = health.aio.HealthServicer()
        server, port = await _health_server(good)
        broken, live = Replica("broken", types.SimpleNamespace(channel=None)), _replica("live", port)
        pool = _pool(broken, live)
        async with _health_loop(pool, 0.2, servers=[server]) as (task, reported):
            assert await _until(lambda: broken.failures >= 2)
            assert not task.done() and reported == []  # live answers SERVING
            await good.set("", Status.NOT_SERVING)
            assert await _until(lambda: reported == [False]) and pool.refreshes >= 1
            await good.set("", Status.SERVING)
            assert await _until(lambda: reported == [False, True])
            assert live.failures == 0 and not task.done()

    asyncio.run(run())


def test_the_health_loop_survives_a_replica_retired_and_closed_mid_check():
    """A replica removed from the name while its Check is in flight has its
    channel closed under the call (CancelledError): not marked down (it is
    retired), and the loop goes on to report the targets' outage."""
    async def run():
        slow_server, slow_port = await _health_server(_SlowHealth())
        good = health.aio.HealthServicer()
        server, port = await _health_server(good)
        slow, live = _replica("slow", slow_port), _replica("live", port)
        async with _health_loop(_pool(slow, live), 1.0, servers=[server, slow_server]) as (task, reported):
            await asyncio.sleep(1.3)  # the first check is in flight: the slow one hangs
            slow.retired = True  # as ReplicaPool's refresh does when the name no longer lists it
            await slow.client.channel.close()
            await asyncio.sleep(0.3)
            assert not task.done(), "the health loop ended"
            assert slow.failures == 0
            await good.set("", Status.NOT_SERVING)
            assert await _until(lambda: reported == [False])

    asyncio.run(run())


def test_the_health_loop_survives_a_failure_to_report_and_reports_again():
    async def run():
        good = health.aio.HealthServicer()
        await good.set("", Status.NOT_SERVING)
        server, port = await _health_server(good)
        calls = []

        async def set_serving(serving):
            calls.append(serving)
            if len(calls) == 1:
                raise RuntimeError("the health servicer is gone")

        async with _health_loop(_pool(_replica("live", port)), 0.2, set_serving=set_serving,
                                servers=[server]) as (task, _):
            assert await _until(lambda: len(calls) >= 2)  # tried again at the next interval
            assert calls[:2] == [False, False] and not task.done()

    asyncio.run(run())


# ------------------------------- readiness, liveness and HTTP /health (bugs 11, b)

def _grpc_status(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=5).status


def _http_health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_target_outage_turns_readiness_and_http_health_off_but_not_liveness():
    from orchestrator.openai_api.config import HttpConfig

    with running_system(tiny_engine(seed=0), http=HttpConfig(http_port=0), health_interval_s=0.2) as s:
        orch = s.orchestrator
        assert _http_health(orch.http.port) == 200
        s.target_loop.run(s.target.stop(0))
        wait_until(lambda: _grpc_status(orch.port, SERVICE_NAME) == Status.NOT_SERVING, 15)
        assert _http_health(orch.http.port) == 503
        assert _grpc_status(orch.port, "") == Status.SERVING  # liveness: the process is fine


def test_readiness_follows_the_targets_until_a_drain_turns_everything_off():
    async def run():
        running = await start_server(local_config(), lambda server: None, [SERVICE_NAME])
        status = running.health._server_status
        await running.set_serving()
        await running.set_readiness(False)
        assert (status[""], status[SERVICE_NAME]) == (Status.SERVING, Status.NOT_SERVING)
        await running.set_readiness(True)
        assert (status[""], status[SERVICE_NAME]) == (Status.SERVING, Status.SERVING)
        await running.drain(0)
        await running.set_readiness(True)  # a late report must not undo the drain
        assert (status[""], status[SERVICE_NAME]) == (Status.NOT_SERVING, Status.NOT_SERVING)

    asyncio.run(run())


def _probes(path: Path) -> dict:
    """The orchestrator container's probes in a manifest (or a patch of one)."""
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc.get("metadata", {}).get("name") == "specdec-orchestrator" and doc["kind"] == "Deployment":
            container = next(c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == "specd")
            return {kind: container[kind]["grpc"].get("service", "") for kind in
                    ("readinessProbe", "livenessProbe") if kind in container}
    raise AssertionError(f"no orchestrator Deployment in {path}")


def test_the_manifests_probe_readiness_by_service_name_and_liveness_by_the_empty_name():
    """What the statuses above mean only holds if the probes read the right
    names: readiness the service's (off during a target outage), liveness
    "" (on until a drain)."""
    for path in (DEPLOY / "base" / "orchestrator.yaml", DEPLOY / "components" / "mtls" / "mount-certificates.yaml"):
        assert _probes(path) == {"readinessProbe": SERVICE_NAME, "livenessProbe": ""}, path


# ---------------------------------------------------- draft replicas (bug 9)

def test_new_requests_avoid_a_dead_draft_replica():
    """--draft a,b with a dead and b busier: the first request, pinned to a,
    finds it dead; its failed call marks a down (the health loop, made slow
    here, would only later), so the next requests are pinned to b and
    speculate. They all decoded with the target alone before."""
    from orchestrator.client import Client
    from orchestrator.config import OrchestratorConfig
    from orchestrator.server import start_orchestrator

    with running_target(tiny_engine(seed=0)) as (target, _, _), \
            running_draft(tiny_engine(seed=1)) as (dead, _, dead_loop), \
            running_draft(tiny_engine(seed=1)) as (live, _, _):
        loop = BackgroundLoop()
        orch = None
        try:
            orch = loop.run(start_orchestrator(local_config(), OrchestratorConfig(
                target=f"127.0.0.1:{target.port}", draft=f"127.0.0.1:{dead.port},127.0.0.1:{live.port}",
                connect_timeout_s=10, draft_min_confidence=0.0, speculation_gate=False, health_interval_s=60)))
            drafts = orch.backends.drafts
            wait_until(lambda: len(drafts.replicas) == 2, 10)
            busy = drafts.replicas[f"127.0.0.1:{live.port}"]
            loop.run(_add_load(busy, 5))  # as if other requests held it: a is the least loaded
            dead_loop.run(dead.stop(0))
            with Client(f"127.0.0.1:{orch.port}", timeout_s=60) as client:
                proposed = [client.complete([3 + i, 4, 5], max_tokens=16, temperature=0).stats.proposed_tokens
                            for i in range(4)]
            assert proposed[0] == 0 and all(proposed[1:]), proposed
            assert drafts.replicas[f"127.0.0.1:{dead.port}"].failures >= 1
            loop.run(_add_load(busy, -5))
        finally:
            if orch is not None:
                loop.run(orch.stop(0))
            loop.close()


async def _add_load(replica: Replica, n: int) -> None:
    """On the orchestrator's loop, which owns the pool."""
    replica.active += n


def test_a_draft_replica_is_marked_down_by_a_failed_open_and_up_by_one_that_succeeds():
    from orchestrator.request_stats import RequestSpec, RequestStats
    from orchestrator.sessions import RequestSessions
    from specdec.telemetry import NOOP

    class Draft:
        name, info, dead = "draft", None, True

        async def open(self, request, timeout):
            if self.dead:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "connection refused")
            return "d1", CallCost(0.0, 1)

    async def run():
        draft = Replica("draft", Draft())
        pool = _pool(draft)
        spec = RequestSpec(prompt=[1, 2, 3], max_tokens=8, temperature=0, top_k=0, top_p=1.0, seed=1,
                           eos_ids=frozenset(), speculate=True)
        sessions = RequestSessions(spec, [1, 2, 3], None, None, draft.client, RequestStats(), NOOP, None,
                                   rpc_timeout_s=5.0, draft_retry_s=0.0)
        sessions.pin_draft(pool, draft)
        await sessions.open_draft()
        assert sessions.draft_id is None and draft.is_down(time.monotonic())
        draft.client.dead = False
        await sessions.open_draft()
        assert sessions.draft_id == "d1" and draft.failures == 0 and not draft.is_down(time.monotonic())

    asyncio.run(run())


def test_the_health_loop_marks_draft_replicas_without_touching_readiness():
    async def run():
        server, port = await _health_server(health.aio.HealthServicer())
        dead_draft = _replica("draft", _free_port())
        async with _health_loop(_pool(_replica("target", port)), 0.2, drafts=_pool(dead_draft),
                                servers=[server]) as (_, reported):
            assert await _until(lambda: dead_draft.failures >= 2)
            assert dead_draft.is_down(time.monotonic()) and reported == []

    asyncio.run(run())


# ------------------------------------------- where a recovery re-opens (bug 10, a)

class _Target:
    """A target replica's client: "dead" answers UNAVAILABLE at once, "hang"
    never answers, "ok" opens a session."""

    name = "target"

    def __init__(self, mode: str):
        self.mode = mode

    async def open(self, request, timeout):
        if self.mode == "dead":
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "connection refused")
        if self.mode == "hang":
            await asyncio.sleep(timeout)
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, None, None, "deadline")
        return "s1", CallCost(0.0, 1)

    async def fetch_info(self, timeout):
        return None


class _Batcher:
    def request_started(self):
        pass

    def request_finished(self):
        pass


def _lease(failed: Replica, *others: Replica, **settings) -> TargetLease:
    """A lease on `failed` (its request's replica) among `others`."""
    pool = _pool(failed, *others)
    pool.refresh = _no_refresh
    failed.active = 1
    lease = TargetLease.__new__(TargetLease)  # pinned by hand: acquire would pick the least loaded
    lease.pool, lease.settings = pool, RecoverySettings(**settings)
    lease.replica, lease._moved_from, lease._give_up = failed, None, 0.0
    return lease


async def _no_refresh():
    return None


async def _reopen(lease: TargetLease, deadline: float | None = None):
    return await lease.reopen(open_request([3, 4, 5], 0.0, 0, 1.0, 1, 8, "r"), deadline, Exception("UNAVAILABLE"),
                              lambda c, r, w: open_to_its_end(c, r, 60.0, w, lambda *a: None))


def _target(address: str, mode: str, active: int = 0) -> Replica:
    return Replica(address, _Target(mode), _Batcher(), active=active)


def test_a_replica_marked_down_is_tried_after_a_live_one():
    async def run():
        frozen, live = _target("frozen", "hang"), _target("live", "ok", active=2)  # live is busier
        lease = _lease(_target("failed", "dead"), frozen, live, window_s=2.0)
        for _ in range(3):
            lease.pool.mark_down(frozen, "health check: DEADLINE_EXCEEDED")
        start = time.monotonic()
        await _reopen(lease)
        assert lease.replica is live and time.monotonic() - start < 1.0

    asyncio.run(run())


def test_a_hung_replica_costs_one_attempt_not_the_whole_window():
    """A replica that hangs before the health loop marks it down: its open
    is given up after `attempt_s`, and the next replica opens the session."""
    async def run():
        hung, live = _target("hung", "hang"), _target("live", "ok", active=2)
        lease = _lease(_target("failed", "dead"), hung, live, window_s=5.0, attempt_s=0.3)
        start = time.monotonic()
        await _reopen(lease)
        assert lease.replica is live and time.monotonic() - start < 2.0

    asyncio.run(run())


def test_a_recovery_ended_by_the_requests_deadline_is_deadline_exceeded():
    async def run():
        lease = _lease(_target("failed", "dead"), window_s=30.0)
        try:
            await _reopen(lease, deadline=time.monotonic() + 0.5)
        except DeadlineExceeded:
            return
        raise AssertionError("not DeadlineExceeded")

    asyncio.run(run())
