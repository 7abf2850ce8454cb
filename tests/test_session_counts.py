"""The model services tell how many sessions they hold and have expired
(GetModelInfo.sessions), and a session whose OpenSession the caller abandoned
is closed, not left to expire: the soak's leak checks rest on both."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from specdec.rpc.session_limits import SessionLimits
from specdec.v1 import common_pb2
from tests.conftest import tiny_engine
from tests.harness import running_draft, running_target


def counts(stub) -> tuple[int, int]:
    reply = stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10)
    return reply.sessions.open, reply.sessions.expired


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.parametrize("role", ["target", "draft"])
def test_open_close_and_expiry_are_counted(role):
    running = running_target if role == "target" else running_draft
    # A lifetime long enough that the open session is still counted open
    # below under CPU load; the expiry is waited for (up to 20 s).
    with running(tiny_engine(), SessionLimits(session_ttl_s=2.0)) as (_, stub, _):
        assert counts(stub) == (0, 0)
        sid = stub.OpenSession(common_pb2.OpenSessionRequest(prompt_token_ids=[3, 4, 5]), timeout=10).session_id
        assert counts(stub) == (1, 0)
        stub.CloseSession(common_pb2.CloseSessionRequest(session_id=sid), timeout=10)
        assert counts(stub) == (0, 0)
        stub.OpenSession(common_pb2.OpenSessionRequest(prompt_token_ids=[3, 4, 5]), timeout=10)
        assert wait_for(lambda: counts(stub) == (0, 1), timeout_s=20.0), counts(stub)


def test_a_session_whose_open_was_abandoned_is_closed():
    with running_target(tiny_engine()) as (service, stub, loop):
        # Hold the engine thread so the open is still queued when the caller's deadline passes.
        gate = threading.Event()
        loop.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(service.worker.run(gate.wait, 30)))
        with pytest.raises(grpc.RpcError) as err:
            stub.OpenSession(common_pb2.OpenSessionRequest(prompt_token_ids=[3, 4, 5]), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        gate.set()
        # The open runs once the engine is free, and its session is closed at once.
        assert wait_for(lambda: service.worker.idle)
        assert wait_for(lambda: counts(stub)[0] == 0), counts(stub)
        assert counts(stub) == (0, 0)


class _EndedCall:
    """The context of a call whose deadline passed while its open ran, before
    the server's cancellation reached the handler."""

    def __init__(self):
        self.aborted = None

    def invocation_metadata(self):
        return ()

    def peer(self):
        return "ipv4:127.0.0.1:1"

    def cancelled(self):
        return False

    def done(self):
        return False

    def time_remaining(self):
        return -0.01

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise grpc.aio.AbortError()


def test_an_open_that_finishes_after_its_call_ended_is_closed():
    with running_target(tiny_engine()) as (service, stub, loop):
        call = _EndedCall()
        with pytest.raises(grpc.aio.AbortError):
            loop.run(service.servicer.OpenSession(common_pb2.OpenSessionRequest(prompt_token_ids=[3, 4, 5]), call))
        assert call.aborted[0] == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_for(lambda: counts(stub) == (0, 0)), counts(stub)


def test_a_close_whose_caller_gave_up_still_closes():
    # A quota of one session: the close must give it back too, or the caller is locked out for good.
    with running_target(tiny_engine(), SessionLimits(max_sessions_per_caller=1)) as (service, stub, loop):
        sid = stub.OpenSession(common_pb2.OpenSessionRequest(prompt_token_ids=[3, 4, 5]), timeout=10).session_id
        # The engine thread is busy, so the close waits in its queue past the caller's deadline.
        gate = threading.Event()
        loop.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(service.worker.run(gate.wait, 30)))
        assert wait_for(lambda: not service.worker.idle)
        with pytest.raises(grpc.RpcError) as err:
            stub.CloseSession(common_pb2.CloseSessionRequest(session_id=sid), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        gate.set()
        assert wait_for(lambda: counts(stub)[0] == 0), counts(stub)
        assert stub.OpenSession(common_pb2.OpenSessionRequest(prompt_token_ids=[3, 4, 5]), timeout=10).session_id
