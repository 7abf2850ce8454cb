"""From a review of the verify path: the batcher's items whose caller is
gone, and a batch whose call fails with something other than a status."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from orchestrator.batcher import VerifyBatcher
from specdec.errors import DeadlineExceeded, SpecdecError, Unavailable
from tests.test_verify_batcher import FakeTarget, item, run


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.001)


def test_a_cancelled_requests_pending_item_is_never_sent():
    """A request cancelled (its client gone) while its item waited for a
    batch: the item left the batcher with it. It was sent all the same, once
    the request's end left it the only one pending, as a Verify of its own:
    a forward pass on the target for a session being closed, which the next
    request's item then waited behind (one batch in flight at a time)."""
    async def main():
        target = FakeTarget(0.05)
        batcher = VerifyBatcher(target, max_batch=16, window_s=10.0)  # only a full round sends
        batcher.request_started()
        batcher.request_started()
        cancelled = asyncio.ensure_future(batcher.verify(item(1), timeout=5.0))
        await asyncio.sleep(0.01)
        assert target.calls == [], "one of two requests: its item waits for the other's"
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        batcher.request_finished()  # its request ended
        await asyncio.sleep(0.01)
        reply = await batcher.verify(item(2), timeout=5.0)
        return target.calls, reply

    calls, reply = run(main())
    assert calls == [["s2"]], calls
    assert reply.result.argmax_token_ids[0] == 2


def test_an_item_past_its_deadline_is_not_sent_with_a_later_batch():
    """An item whose caller's deadline passed while it waited behind a batch
    in flight is no longer anyone's: the batch that follows carries the
    others only (and the request it belonged to ends)."""
    async def main():
        target = FakeTarget(0.2)
        batcher = VerifyBatcher(target, max_batch=16, window_s=0.001)
        for _ in range(3):
            batcher.request_started()
        first = asyncio.ensure_future(batcher.verify(item(0), timeout=5.0))
        await _until(lambda: target.calls == [["s0"]])  # sent after the window, computing for 0.2 s
        hasty = asyncio.ensure_future(batcher.verify(item(1), timeout=0.02))
        patient = asyncio.ensure_future(batcher.verify(item(2), timeout=5.0))
        with pytest.raises(DeadlineExceeded):
            await hasty
        batcher.request_finished()  # hasty's request ends
        await asyncio.gather(first, patient)
        return target.calls

    assert run(main()) == [["s0"], ["s2"]]


@pytest.mark.parametrize("raised, kind", [(grpc.aio.UsageError("Channel is closed."), Unavailable),
                                          (RuntimeError("a bug"), SpecdecError)])
def test_a_batch_whose_call_raises_no_status_fails_its_items_at_once(raised, kind):
    """The target client raising something other than an AioRpcError (a
    channel closed under the call: grpc's UsageError) left the items of a
    batch sent by the batcher's task without a result: each caller waited
    out its whole deadline (rpc_timeout_s, a minute by default) and ended
    DEADLINE_EXCEEDED, where a closed channel is the target's failure
    (recovered on another replica)."""
    class Raising(FakeTarget):
        async def verify(self, items, timeout):
            self.calls.append([i.session_id for i in items])
            if len(self.calls) == 1:
                raise raised
            return await super().verify(items, timeout)

    async def main():
        target = Raising(0.0)
        batcher = VerifyBatcher(target, max_batch=4, window_s=0.001)
        batcher.request_started()
        batcher.request_started()  # two requests: the batch goes from the batcher's task
        results = await asyncio.wait_for(asyncio.gather(batcher.verify(item(1), timeout=30.0),
                                                        batcher.verify(item(2), timeout=30.0),
                                                        return_exceptions=True), 5)
        batcher.request_finished()
        after = await batcher.verify(item(3), timeout=5.0)  # the slot was freed
        return results, after

    results, after = run(main())
    assert all(type(r) is kind for r in results), results
    assert after.result.argmax_token_ids[0] == 3


def test_a_batched_item_that_waits_out_the_calls_limit_is_the_targets_failure_not_the_requests_deadline():
    """A request without a deadline of its own waits for its verify as long
    as a call may take (`rpc_timeout_s`: what `RequestSessions.timeout()`
    gives it). Sent alone, a target that does not answer within that limit
    is the target's failure (UNAVAILABLE: the request is recovered on another
    replica). Batched, the caller's own timer, started before the batch went,
    ended the wait first as DeadlineExceeded ("the request's deadline passed"),
    and the request failed DEADLINE_EXCEEDED instead of being recovered. A
    deadline of the request's own, shorter than the limit, is still its own."""
    async def main():
        target = FakeTarget(30.0)  # hung
        batcher = VerifyBatcher(target, max_batch=4, window_s=0.001, rpc_timeout_s=0.1)
        batcher.request_started()
        batcher.request_started()
        return await asyncio.wait_for(asyncio.gather(batcher.verify(item(1), timeout=0.1),
                                                     batcher.verify(item(2), timeout=0.05),
                                                     return_exceptions=True), 5)

    limit, own = run(main())
    assert type(limit) is Unavailable and "target" in str(limit), repr(limit)
    assert type(own) is DeadlineExceeded, repr(own)
