"""A request pinned to a draft replica that dies moves to a live one.

A failed draft call (UNAVAILABLE) marks its replica down, so that new
requests go to another; the request itself decodes with the target alone
until its draft session is re-opened `draft_retry_s` later. That re-open
moves it to the replica a new request would get, when its own has not
answered since and another is up (`ReplicaPool.move_from`,
`RequestSessions._move_draft`): it used to retry the dead address for the
rest of the request, and lost speculation for good. The request's count in
the pool moves with it and is let go once when it ends.

The first tests use fake draft clients (no models); the last one real
services on 127.0.0.1 port 0: two draft replicas, one target, the draft the
request is on stopped mid-request."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from orchestrator.client import Client
from orchestrator.config import OrchestratorConfig
from orchestrator.downstream import CallCost
from orchestrator.replicas import Replica, ReplicaPool
from orchestrator.request_stats import RequestSpec, RequestStats
from orchestrator.server import start_orchestrator
from orchestrator.sessions import RequestSessions
from specdec.telemetry import NOOP
from tests.conftest import tiny_engine, tiny_model
from tests.harness import BackgroundLoop, local_config, running_draft, running_target
from tests.test_orchestrator import GREEDY_PROMPTS, greedy_reference, perturbed, without_eos

pytestmark = pytest.mark.timeout(180)

A, B, C = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"


# ------------------------------------------------------------- helpers

class _Draft:
    """A fake draft client: opens sessions named after it unless `dead`,
    and records the sessions closed on it."""

    info = None

    def __init__(self, name: str, dead: bool = False):
        self.name, self.dead = name, dead
        self.opened: list[str] = []
        self.closed: list[str] = []
        self.tries = 0

    async def open(self, request, timeout):
        self.tries += 1
        if self.dead:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "connection refused")
        self.opened.append(f"{self.name}{len(self.opened) + 1}")
        return self.opened[-1], CallCost(0.0, 1)

    async def close(self, session_id, timeout):
        self.closed.append(session_id)


def _pool(*replicas: Replica) -> ReplicaPool:
    """A pool of `replicas` that never resolves its name."""
    pool = ReplicaPool("draft:1", make_replica=None, close_replica=None, refresh_s=3600)
    pool._resolved_at = time.monotonic()
    pool.replicas = {r.address: r for r in replicas}
    return pool


def _unavailable() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "Socket closed")


def _sessions(pool: ReplicaPool) -> RequestSessions:
    """A request's sessions with its draft acquired in `pool` (no target: only the draft is opened)."""
    spec = RequestSpec(prompt=[3, 4, 5], max_tokens=8, temperature=0, top_k=0, top_p=1.0, seed=1,
                       eos_ids=frozenset(), speculate=True)
    replica = pool.acquire()
    sessions = RequestSessions(spec, [3, 4, 5], None, None, replica.client, RequestStats(), NOOP, None,
                               rpc_timeout_s=5.0, draft_retry_s=0.0)
    sessions.pin_draft(pool, replica)
    return sessions


# ------------------------------------------------- the decision (ReplicaPool.move_from)

def test_move_from_picks_what_acquire_would_and_counts_it():
    """Only a replica that failed is left; for the least loaded of the
    others that are up and not retired, counted as the request's; none up:
    the request stays (nothing counted)."""
    a, b, c = Replica(A, None), Replica(B, None, active=3), Replica(C, None, active=1)
    pool = _pool(a, b, c)
    assert pool.move_from(a) is None  # a has not failed
    pool.mark_down(a, "UNAVAILABLE")
    assert pool.move_from(a) is c and c.active == 2 and b.active == 3
    c.active = 1
    pool.mark_down(c, "health check: UNAVAILABLE")
    assert pool.move_from(a) is b and b.active == 4  # c is down: b, busier, is the one up
    b.active = 3
    b.retired = True
    assert pool.move_from(a) is None and (b.active, c.active) == (3, 1)  # b retired, c down: stay


def test_move_from_leaves_a_replica_that_failed_after_its_down_window():
    """The down window only says when new requests may try a replica again;
    one that has not answered since it failed (`failures`) is still left
    for one that is up."""
    a, b = Replica(A, None), Replica(B, None)
    pool = _pool(a, b)
    pool.mark_down(a, "UNAVAILABLE")
    a.down_until = 0.0  # its window ended, no answer since
    assert not a.is_down(time.monotonic())
    assert pool.move_from(a) is b
    pool.mark_up(a)
    assert pool.move_from(a) is None


# ---------------------------------------------- the request (RequestSessions)

def test_a_reopen_moves_the_request_off_a_failed_draft_replica():
    """The request's draft call fails UNAVAILABLE: its session there is
    closed in the background and the replica marked down; the re-open goes
    to the live replica, on the whole history, and the pool's counts follow
    the request, let go of once at its end."""
    async def run():
        a, b = Replica(A, _Draft("a")), Replica(B, _Draft("b"))
        pool = _pool(a, b)
        sessions = _sessions(pool)
        assert sessions.draft_replica is a and (a.active, b.active) == (1, 0)
        await sessions.open_draft()
        assert sessions.draft_id == "a1"
        sessions.history.extend([7, 8])
        a.client.dead = True
        sessions.draft_failed(_unavailable())  # a Propose to a failed
        assert sessions.draft_id is None and a.failures == 1
        await sessions.open_draft_if_due()
        assert sessions.draft_replica is b and sessions.draft is b.client and sessions.draft_id == "b1"
        assert sessions.draft_prefix == 5 and a.client.tries == 1  # the whole history, and a not tried again
        assert (a.active, b.active) == (0, 1)
        await asyncio.sleep(0)  # the background close of a's session
        assert a.client.closed == ["a1"]
        sessions.close()
        await sessions.release_draft()
        await sessions.release_draft()  # once only
        assert (a.active, b.active) == (0, 0)
        await asyncio.sleep(0)
        assert b.client.closed == ["b1"]

    asyncio.run(run())


def test_with_no_other_replica_up_the_reopen_tries_the_same_one():
    """Every other replica down (or none): the request retries its own, as
    before, and moves once one is up again."""
    async def run():
        a, b = Replica(A, _Draft("a", dead=True)), Replica(B, _Draft("b"))
        pool = _pool(a, b)
        sessions = _sessions(pool)
        pool.mark_down(b, "health check: UNAVAILABLE")
        await sessions.open_draft()  # a fails: marked down
        assert sessions.draft_id is None and a.failures == 1
        await sessions.open_draft_if_due()  # b is down too: a again
        assert sessions.draft_replica is a and a.client.tries == 2 and b.client.tries == 0
        pool.mark_up(b)  # b answers its health check
        await sessions.open_draft_if_due()
        assert sessions.draft_replica is b and sessions.draft_id == "b1" and a.client.tries == 2
        await sessions.release_draft()
        assert (a.active, b.active) == (0, 0)

    asyncio.run(run())


def test_a_first_open_stays_where_acquire_put_the_request():
    """Only a re-open after the request's own draft failed moves it: a first
    open on a replica whose down window ended is its one more try."""
    async def run():
        a, b = Replica(A, _Draft("a")), Replica(B, _Draft("b"), active=1)
        pool = _pool(a, b)
        pool.mark_down(a, "health check: UNAVAILABLE")
        a.down_until = 0.0  # its window ended: new requests may try it once more
        sessions = _sessions(pool)
        assert sessions.draft_replica is a
        await sessions.open_draft()
        assert sessions.draft_id == "a1" and a.failures == 0 and (a.active, b.active) == (1, 1)
        await sessions.release_draft()

    asyncio.run(run())


# --------------------------------------------------------- real services

N_TOKENS = 120
STOP_AT_CALL = 4  # the request's Propose call before which its draft replica is stopped


def _stop_before_call(pool: ReplicaPool, services: dict, n: int) -> dict:
    """Wrap each draft replica's `propose` so that the replica the request is
    on stops (its service, on its own loop) just before the request's n-th
    Propose to it: mid-request, whatever the speed of the rounds. Returns
    {"dead": the address stopped, once it is, "ahead": {address: the
    speculative Proposes (drafting ahead, `first` given) sent to it}}."""
    stopped = {"dead": None, "ahead": dict.fromkeys(pool.replicas, 0)}
    for replica in pool.replicas.values():
        calls = [0]

        async def propose(*args, _real=replica.client.propose, _calls=calls, _address=replica.address, **kwargs):
            _calls[0] += 1
            stopped["ahead"][_address] += kwargs.get("first") is not None
            if _calls[0] == n and stopped["dead"] is None:
                stopped["dead"] = _address
                service, service_loop = services[_address]
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(service.stop(0), service_loop.loop))
            return await _real(*args, **kwargs)

        replica.client.propose = propose
    return stopped


@pytest.mark.parametrize("pipeline", [False, True], ids=["plain", "pipelined"])
def test_a_request_on_a_draft_replica_that_dies_drafts_again_on_the_other(pipeline):
    """--draft a,b; the replica the running request is on is stopped
    mid-request. The request finishes with the target-only greedy output,
    drafts again on the other replica after a few rounds with the target
    alone (it used to decode with the target alone to its end), and the
    pool holds no request of it afterwards."""
    target = without_eos(tiny_model(seed=0, init_range=0.3))
    draft = perturbed(target, 0.15, seed=1)
    prompt = GREEDY_PROMPTS[2]
    ref = greedy_reference(target, prompt, N_TOKENS)
    with running_target(tiny_engine(model=target)) as (target_svc, _, _), \
            running_draft(tiny_engine(model=draft)) as (draft_a, _, loop_a), \
            running_draft(tiny_engine(model=draft)) as (draft_b, _, loop_b):
        services = {f"127.0.0.1:{draft_a.port}": (draft_a, loop_a), f"127.0.0.1:{draft_b.port}": (draft_b, loop_b)}
        loop = BackgroundLoop()
        orch = None
        try:
            orch = loop.run(start_orchestrator(local_config(), OrchestratorConfig(
                target=f"127.0.0.1:{target_svc.port}", draft=",".join(services), connect_timeout_s=10,
                draft_min_confidence=0.0, speculation_gate=False, draft_retry_s=0.05, health_interval_s=60,
                pipeline_always=True)))
            pool = orch.backends.drafts
            deadline = time.monotonic() + 10
            while len(pool.replicas) < 2:
                assert time.monotonic() < deadline, "the second draft replica did not join"
                time.sleep(0.05)
            stopped = _stop_before_call(pool, services, STOP_AT_CALL)

            async def counts():  # on the orchestrator's loop, which owns the pool
                return {address: r.active for address, r in pool.replicas.items()}

            with Client(f"127.0.0.1:{orch.port}", timeout_s=60) as client:
                result = client.complete(prompt, max_tokens=N_TOKENS, temperature=0, num_draft_tokens=2,
                                         pipeline=pipeline)
            dead, stats, ks = stopped["dead"], result.stats, list(result.stats.k_per_round)
            assert dead is not None, "no draft replica was stopped"
            assert result.token_ids == ref, "the output differs from target-only greedy decoding"
            assert stats.fallback_rounds >= 1, ks
            first_fallback = ks.index(0)
            assert first_fallback >= 1 and sum(ks[first_fallback:]) > 0, \
                f"no round drafted after the draft replica died: {ks}"
            assert all(ks[-20:-1]), f"the last rounds decoded with the target alone: {ks}"
            if pipeline:  # drafting ahead follows the request to the live replica
                live = next(address for address in services if address != dead)
                assert stopped["ahead"][live] >= 1, stopped["ahead"]
            assert loop.run(counts()) == dict.fromkeys(services, 0)
            assert pool.replicas[dead].failures >= 1
        finally:
            if orch is not None:
                loop.run(orch.stop(0))
            loop.close()
