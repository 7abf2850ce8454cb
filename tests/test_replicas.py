"""Requests are pinned to one replica each, and spread over the replicas a
service name resolves to (a Kubernetes headless Service)."""
from __future__ import annotations

import concurrent.futures

import pytest

from orchestrator.client import Client
from orchestrator.replicas import resolve, split_address
from tests.conftest import tiny_engine
from tests.harness import BackgroundLoop, start_orchestrator_on_replicas, target_replicas_behind_one_name, wait_until


def test_resolve_literals_and_names():
    assert resolve("127.0.0.1:5") == ["127.0.0.1:5"]
    assert resolve("localhost:7") == ["127.0.0.1:7"]
    assert split_address("[::1]:9") == ("::1", 9)
    # A list: the union, in order, without repeats (replicas on one machine).
    assert resolve("127.0.0.1:5, localhost:6,127.0.0.1:5") == ["127.0.0.1:5", "127.0.0.1:6"]
    with pytest.raises(ValueError):
        resolve(" , ")
    with pytest.raises(ValueError):
        split_address("no-port")


def test_requests_spread_over_replicas_and_stay_pinned(monkeypatch):
    # Two target replicas on the same port at two loopback addresses, behind
    # one name, like pods behind a headless Service.
    engine_a, engine_b = tiny_engine(seed=0), tiny_engine(seed=0)
    with target_replicas_behind_one_name(monkeypatch, engine_a, engine_b) as (port, _, _):
        loop = BackgroundLoop()
        try:
            orch = start_orchestrator_on_replicas(loop, port)
            assert len(orch.backends.targets.replicas) == 2
            seen = {"a": 0, "b": 0}

            def run(i):
                with Client(f"127.0.0.1:{orch.port}", timeout_s=60) as client:
                    stream = client.generate([3 + i, 4, 5], max_tokens=200, temperature=0)
                    next(stream)
                    seen["a"] = max(seen["a"], engine_a.num_sessions)
                    seen["b"] = max(seen["b"], engine_b.num_sessions)
                    return list(stream)

            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                list(pool.map(run, range(4)))
            assert seen["a"] >= 1 and seen["b"] >= 1, seen
            loop.run(orch.stop(0))
        finally:
            loop.close()


def test_a_replica_marked_down_gets_no_new_request_until_it_answers_or_its_window_ends(monkeypatch):
    """`ReplicaPool`: new requests avoid a replica that failed (least loaded
    among the rest), every replica is tried when all are down, a failure in
    a row doubles its window up to 30 s, and an answer clears it."""
    import asyncio
    import time

    from orchestrator import replicas as R

    async def run():
        pool = R.ReplicaPool("target:1", make_replica=None, close_replica=None, refresh_s=3600)
        pool._resolved_at = time.monotonic()
        a, b = R.Replica("10.0.0.1:1", client=None), R.Replica("10.0.0.2:1", client=None)
        pool.replicas = {a.address: a, b.address: b}
        a.active = 5  # the busier one: without a mark, b would be chosen
        pool.mark_down(b, "UNAVAILABLE")
        picked = [pool.acquire() for _ in range(3)]
        assert picked == [a, a, a]
        pool.mark_down(a, "UNAVAILABLE")  # all down: the least loaded of all, as before
        assert pool.acquire() is b
        now = time.monotonic()
        for expected in (2.0, 4.0, 8.0, 16.0, 30.0, 30.0):
            # The window starts at the mark: bracket that moment (a fixed slack
            # around one earlier `now` fails when a loaded CI VM stalls the loop).
            before = time.monotonic()
            pool.mark_down(b, "UNAVAILABLE")
            after = time.monotonic()
            assert before + expected <= b.down_until <= after + expected, (expected, b.down_until - before)
        pool.mark_up(b)
        assert not b.is_down(time.monotonic()) and b.failures == 0
        pool.mark_up(a)
        assert pool.acquire() is b  # the less loaded again, once both are up
        # A window that ended gives the replica another try.
        pool.mark_down(a, "UNAVAILABLE")
        a.active = 0
        monkeypatch.setattr(R.time, "monotonic", lambda: now + 3600)
        assert pool.acquire() is a

    asyncio.run(run())


def test_a_dead_target_replica_still_listed_gets_no_new_requests(monkeypatch):
    """Two target replicas behind one name; one stops while its name still
    resolves. The orchestrator's health loop marks it down, and the requests
    after that all go to the live one: none is first pinned to the dead one
    (before, each new request's first OpenSession failed there and moved)."""
    import time

    from orchestrator.replicas import ReplicaPool

    engine_a, engine_b = tiny_engine(seed=0), tiny_engine(seed=0)
    with target_replicas_behind_one_name(monkeypatch, engine_a, engine_b) as (port, _, (svc_b, loop_b)):
        loop = BackgroundLoop()
        try:
            orch = start_orchestrator_on_replicas(loop, port, health_interval_s=0.1)
            pool = orch.backends.targets
            dead = pool.replicas[f"127.0.0.2:{port}"]
            loop_b.run(svc_b.stop(0))  # the process is gone; its name still resolves
            # Its health checks (every 0.1 s) fail: wait until they have marked it down, twice in a row.
            wait_until(lambda: dead.is_down(time.monotonic()) and dead.failures >= 2, 30.0)
            live = pool.replicas[f"127.0.0.1:{port}"]
            live.active += 3  # the busier one: by load alone, every new request would go to the dead one
            chosen = []
            acquire = ReplicaPool.acquire

            def recording(self):
                replica = acquire(self)
                chosen.append(replica.address)
                return replica

            monkeypatch.setattr(ReplicaPool, "acquire", recording)
            with Client(f"127.0.0.1:{orch.port}", timeout_s=60) as client:
                for i in range(4):
                    assert client.complete([3 + i, 4, 5], max_tokens=8, temperature=0).token_ids
            live.active -= 3
            assert chosen == [f"127.0.0.1:{port}"] * 4, chosen
            assert dead.is_down(time.monotonic()) and dead.failures >= 2
            loop.run(orch.stop(0))
        finally:
            loop.close()


class _SlowTarget:
    """A target client whose OpenSession takes `prefill_s`, or fails
    UNAVAILABLE (`dead`); it records the sessions it opened and closed."""

    name = "target"

    def __init__(self, prefill_s: float = 0.0, dead: bool = False):
        self.prefill_s, self.dead = prefill_s, dead
        self.opened: list[str] = []
        self.closed: list[str] = []

    async def open(self, request, timeout):
        import asyncio

        import grpc

        from orchestrator.downstream import CallCost

        if self.dead:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "connection refused")
        await asyncio.sleep(self.prefill_s)
        self.opened.append(f"s{len(self.opened)}")
        return self.opened[-1], CallCost(self.prefill_s, 10)

    async def fetch_info(self, timeout):
        return None


def _lease(*clients):
    import time

    from orchestrator.recovery import RecoverySettings, TargetLease
    from orchestrator.replicas import Replica, ReplicaPool

    class Batcher:
        def request_started(self):
            pass

        def request_finished(self):
            pass

    pool = ReplicaPool("target:1", make_replica=None, close_replica=None, refresh_s=3600)
    pool._resolved_at = time.monotonic()
    pool.replicas = {f"10.0.0.{i}:1": Replica(f"10.0.0.{i}:1", client=c, batcher=Batcher())
                     for i, c in enumerate(clients)}
    return pool, TargetLease(pool, RecoverySettings(window_s=5.0, retry_initial_s=0.01, retry_max_s=0.01))


def test_a_session_reopened_after_the_request_gave_up_is_closed_not_left_to_expire():
    """Recovery's re-open runs to its end under the calls' own timeout while
    the request waits at most until its deadline (`open_to_its_end`, as
    every first open does): a prefill that finishes after the deadline has
    its session closed at once, instead of held until the 300 s idle expiry
    (docs/reliability.md, leak 3: before, the re-open was bound by the
    request's deadline, and a reply in flight at that moment was lost)."""
    import asyncio
    import time

    from orchestrator.downstream import open_to_its_end
    from specdec.errors import DeadlineExceeded

    async def run():
        failed, slow = _SlowTarget(dead=True), _SlowTarget(prefill_s=0.3)
        pool, lease = _lease(failed, slow)
        closed = []

        def open_on(client, request, wait_s):
            return open_to_its_end(client, request, 60.0, wait_s, lambda c, sid: closed.append((c, sid)))

        deadline = time.monotonic() + 0.1
        with pytest.raises(DeadlineExceeded):
            await lease.reopen(open_request([3, 4, 5]), deadline, RuntimeError("UNAVAILABLE"), open_on)
        assert slow.opened == [] and closed == []  # still prefilling when the request gave up
        await asyncio.sleep(0.5)
        assert slow.opened == ["s0"] and closed == [(slow, "s0")]
        assert pool.replicas["10.0.0.0:1"].is_down(time.monotonic())  # the failed one, marked

        # Without a deadline, a re-open that outlasts the recovery window is Unavailable, and closed too.
        pool, lease = _lease(_SlowTarget(dead=True), _SlowTarget(prefill_s=0.3))
        lease.settings = type(lease.settings)(window_s=0.1, retry_initial_s=0.01, retry_max_s=0.01)
        closed.clear()
        from specdec.errors import Unavailable
        with pytest.raises(Unavailable, match="still prefilling when the recovery window ended"):
            await lease.reopen(open_request([3, 4, 5]), None, RuntimeError("UNAVAILABLE"), open_on)
        await asyncio.sleep(0.5)
        assert [sid for _, sid in closed] == ["s0"]

        # A re-open in time moves the lease to the replica that answered.
        fast = _SlowTarget()
        pool, lease = _lease(_SlowTarget(dead=True), fast)
        session, _ = await lease.reopen(open_request([3, 4, 5]), time.monotonic() + 5, RuntimeError("x"), open_on)
        assert session == "s0" and lease.client is fast

    def open_request(tokens):
        from specdec.v1 import common_pb2

        return common_pb2.OpenSessionRequest(prompt_token_ids=tokens)

    asyncio.run(run())
