"""A request's target recovery and re-opens, against fake replicas: what each
re-open asks for, that no session is left open on any replica however the
recovery ends, and that a refusal ends it at once (orchestrator/sessions.py,
orchestrator/recovery.py). The end-to-end restarts are in test_orchestrator.py."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from orchestrator.downstream import CallCost
from orchestrator.recovery import RecoverySettings, TargetLease
from orchestrator.replicas import Replica, ReplicaPool
from orchestrator.request_stats import RequestSpec, RequestStats
from orchestrator.sessions import RequestSessions
from specdec.errors import Unavailable
from specdec.telemetry import NOOP


class FakeTarget:
    """A replica's client: opens take `prefill_s` (or fail with `refuse`, a
    status), ModelInfo takes `info_s`; it keeps the sessions open on it."""

    name = "target"

    def __init__(self, label: str, prefill_s: float = 0.0, info_s: float = 0.0,
                 refuse: grpc.StatusCode | None = None):
        self.label, self.prefill_s, self.info_s, self.refuse = label, prefill_s, info_s, refuse
        self.open_sessions: set[str] = set()
        self.requests = []
        self.info = None
        self._n = 0

    async def open(self, request, timeout):
        self.requests.append(request)
        if self.refuse is not None:
            raise grpc.aio.AioRpcError(self.refuse, None, None, f"{self.label} refuses")
        await asyncio.sleep(self.prefill_s)
        self._n += 1
        session = f"{self.label}-s{self._n}"
        self.open_sessions.add(session)
        return session, CallCost(self.prefill_s, 10)

    async def close(self, session_id, timeout):
        self.open_sessions.discard(session_id)

    async def fetch_info(self, timeout):
        await asyncio.sleep(self.info_s)


async def _until(condition, timeout_s: float = 20.0) -> bool:
    """Wait for `condition()` (the background closes, the late re-opens), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return condition()


class _Batcher:
    def request_started(self):
        pass

    def request_finished(self):
        pass


def _request(a: FakeTarget, b: FakeTarget, window_s: float = 5.0, max_tokens: int = 8,
             deadline: float | None = None) -> RequestSessions:
    """A request pinned to replica a (b is busier), its target session not yet open."""
    pool = ReplicaPool("target:1", make_replica=None, close_replica=None, refresh_s=3600)
    pool._resolved_at = time.monotonic()
    pool.replicas = {"a": Replica("a", client=a, batcher=_Batcher()), "b": Replica("b", client=b, batcher=_Batcher())}
    pool.replicas["b"].active = 5
    lease = TargetLease(pool, RecoverySettings(window_s=window_s, retry_initial_s=0.01, retry_max_s=0.01))
    assert lease.client is a
    spec = RequestSpec(prompt=[1, 2, 3], max_tokens=max_tokens, temperature=0, top_k=0, top_p=1.0, seed=1,
                       eos_ids=frozenset(), speculate=False, deadline=deadline)
    return RequestSessions(spec, list(spec.prompt), lease.client, lease.batcher, None, RequestStats(), NOOP, lease,
                           rpc_timeout_s=60.0, draft_retry_s=1.0)


def test_a_reopen_asks_for_the_tokens_the_request_may_still_emit():
    """The history carries the tokens emitted so far: the re-open asks for what
    is left of max_tokens, so that history + max_new_tokens is the first
    open's prompt + max_tokens (a service refuses an open beyond its context)."""
    async def run():
        a, b = FakeTarget("a"), FakeTarget("b")
        request = _request(a, b, max_tokens=20)
        await request.open_target()
        request.history.extend([7, 8, 9, 10, 11])
        request.stats.completion_tokens = 5
        a.refuse = grpc.StatusCode.UNAVAILABLE
        await request.recover_target(Unavailable("lane broke"))
        first, reopen = a.requests[0], b.requests[-1]
        assert (len(first.prompt_token_ids), first.max_new_tokens) == (3, 20)
        assert (len(reopen.prompt_token_ids), reopen.max_new_tokens) == (8, 15)
        assert request.target is b and request.target_id in b.open_sessions

    asyncio.run(run())


def test_a_recovery_that_fails_still_closes_the_old_session():
    """The old replica may still live (a Verify past its timeout, a broken
    lane): its session is closed whether the re-open succeeds or not."""
    async def run():
        a, b = FakeTarget("a"), FakeTarget("b", refuse=grpc.StatusCode.UNAVAILABLE)
        request = _request(a, b, window_s=0.2)
        await request.open_target()
        assert len(a.open_sessions) == 1
        a.prefill_s = 1.0  # still prefilling when the window ends
        with pytest.raises(Unavailable, match="within"):
            await request.recover_target(Unavailable("the target service failed: DEADLINE_EXCEEDED"))
        request.close()
        # The late re-open's session (after 1 s) is closed as it comes.
        assert await _until(lambda: len(a.requests) == 2 and not a.open_sessions and not b.open_sessions)

    asyncio.run(run())


@pytest.mark.parametrize("where", ["prefilling", "reading the new replica's info"])
def test_a_request_cancelled_during_its_recovery_leaves_no_session_open(where):
    async def run():
        a = FakeTarget("a")
        b = FakeTarget("b", prefill_s=0.3) if where == "prefilling" else FakeTarget("b", info_s=5.0)
        request = _request(a, b)
        await request.open_target()
        a.refuse = grpc.StatusCode.UNAVAILABLE
        recovering = asyncio.ensure_future(request.recover_target(Unavailable("lane broke")))
        await asyncio.sleep(0.1)
        recovering.cancel()
        with pytest.raises(asyncio.CancelledError):
            await recovering
        request.close()  # what the servicer does as the request ends
        await request.lease.release()
        if where == "prefilling":  # the re-open still runs to its end; its session is then closed
            assert await _until(lambda: b._n == 1)
        assert await _until(lambda: not a.open_sessions and not b.open_sessions)
        assert request.lease.pool.replicas["a"].active == 0  # the failed replica was let go too

    asyncio.run(run())


def test_a_reopen_every_replica_refuses_ends_the_recovery_at_once():
    """INVALID_ARGUMENT or OUT_OF_RANGE (a replica restarted with a smaller
    context) is the same answer on every try: the request fails UNAVAILABLE
    at once, saying why, instead of retrying until the window ends."""
    async def run():
        a, b = FakeTarget("a"), FakeTarget("b", refuse=grpc.StatusCode.INVALID_ARGUMENT)
        request = _request(a, b, window_s=30.0)
        await request.open_target()
        a.refuse = grpc.StatusCode.OUT_OF_RANGE
        start = time.monotonic()
        with pytest.raises(Unavailable, match="no replica can re-open the session: a: OUT_OF_RANGE"):
            await request.recover_target(Unavailable("lane broke"))
        assert time.monotonic() - start < 10.0  # not the 30 s window
        assert len(b.requests) == 1 and len(a.requests) == 2  # one pass: b first, the failed one last

        # One replica that may yet answer (UNAVAILABLE) keeps the recovery going until the window ends.
        a2, b2 = FakeTarget("a"), FakeTarget("b", refuse=grpc.StatusCode.INVALID_ARGUMENT)
        request = _request(a2, b2, window_s=1.0)
        await request.open_target()
        a2.refuse = grpc.StatusCode.UNAVAILABLE
        with pytest.raises(Unavailable, match="within"):
            await request.recover_target(Unavailable("lane broke"))
        assert len(b2.requests) > 1  # passes went on (retries every 10 ms) until the window ended

    asyncio.run(run())
