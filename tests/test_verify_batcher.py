"""The verification batcher on its own, against a fake target: when batches
go, how many are in flight, and that every item gets its own result."""
from __future__ import annotations

import asyncio

from orchestrator.batcher import VerifyBatcher
from specdec.v1 import target_pb2


class FakeTarget:
    """Answers Verify after `seconds`, echoing each item's session id."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.calls: list[list[str]] = []
        self.in_flight = self.max_in_flight = 0

    async def verify(self, items, timeout):
        self.calls.append([i.session_id for i in items])
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.seconds)
        self.in_flight -= 1
        results = [target_pb2.VerifyResult(argmax_token_ids=[int(i.session_id[1:])]) for i in items]
        return target_pb2.VerifyResponse(results=results, batch_size=len(items), compute_micros=1000), 10


def item(n: int) -> target_pb2.VerifyItem:
    return target_pb2.VerifyItem(session_id=f"s{n}")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_items_arriving_while_a_batch_computes_go_together_when_it_returns():
    async def main():
        target = FakeTarget(0.2)
        batcher = VerifyBatcher(target, max_batch=16, window_s=0.001)
        for _ in range(6):
            batcher.request_started()
        first = asyncio.ensure_future(batcher.verify(item(0)))
        # The first item went alone, after the window; its batch computes (0.2 s) while the others arrive.
        deadline = asyncio.get_running_loop().time() + 10
        while target.calls != [["s0"]]:
            assert asyncio.get_running_loop().time() < deadline, target.calls
            await asyncio.sleep(0.001)
        later = [asyncio.ensure_future(batcher.verify(item(n))) for n in range(1, 6)]
        replies = await asyncio.gather(first, *later)
        return target, replies

    target, replies = run(main())
    assert target.calls == [["s0"], ["s1", "s2", "s3", "s4", "s5"]]
    assert target.max_in_flight == 1
    assert [r.result.argmax_token_ids[0] for r in replies] == [0, 1, 2, 3, 4, 5]
    assert [r.items for r in replies] == [1, 5, 5, 5, 5, 5]


def test_more_batches_in_flight_when_allowed_and_none_held_without_batching():
    async def main(**kwargs):
        target = FakeTarget(0.1)
        batcher = VerifyBatcher(target, max_batch=2, window_s=0.001, **kwargs)
        for _ in range(6):
            batcher.request_started()
        tasks = [asyncio.ensure_future(batcher.verify(item(n))) for n in range(6)]
        await asyncio.gather(*tasks)
        return target

    two = run(main(max_in_flight=2))
    assert two.max_in_flight == 2 and len(two.calls) == 3
    unbatched = run(main(enabled=False))
    assert unbatched.max_in_flight == 6 and len(unbatched.calls) == 6


def test_a_failed_batch_frees_its_slot():
    import grpc

    class Failing(FakeTarget):
        async def verify(self, items, timeout):
            self.calls.append([i.session_id for i in items])
            if len(self.calls) == 1:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "down")
            return await super().verify(items, timeout)

    async def main():
        target = Failing(0.01)
        batcher = VerifyBatcher(target, max_batch=4, window_s=0.001)
        batcher.request_started()
        try:
            await batcher.verify(item(1))
        except Exception as exc:  # the item's own error
            failed = exc
        reply = await batcher.verify(item(2))
        return failed, reply

    failed, reply = run(main())
    assert "target" in str(failed)
    assert reply.result.argmax_token_ids[0] == 2


def test_a_caller_past_its_deadline_gets_deadline_exceeded_and_the_batch_goes_on():
    """`verify(item, timeout)`: past the timeout the caller's wait ends with
    DeadlineExceeded (a timer on its future, no task of its own); the other
    items of the same batch get their results, and the batcher serves the
    next round."""
    import pytest

    from specdec.errors import DeadlineExceeded

    async def main():
        target = FakeTarget(0.2)
        batcher = VerifyBatcher(target, max_batch=4, window_s=0.001)
        batcher.request_started()
        batcher.request_started()
        hasty = asyncio.ensure_future(batcher.verify(item(1), timeout=0.02))
        patient = asyncio.ensure_future(batcher.verify(item(2), timeout=5.0))
        with pytest.raises(DeadlineExceeded, match="deadline passed while verifying"):
            await hasty
        assert not patient.done(), "the other item waits for the batch, not the deadline"
        second = await patient
        third = await batcher.verify(item(3), timeout=5.0)
        return second, third, target.calls

    second, third, calls = run(main())
    assert calls[0] == ["s1", "s2"], "both items went in one batch"
    assert second.result.argmax_token_ids[0] == 2 and third.result.argmax_token_ids[0] == 3


def test_a_lone_requests_item_is_sent_from_its_own_task_under_its_deadline():
    """With no other request on the replica and nothing pending, the item is
    its batch, sent by the caller's task itself (no task of the batcher's to
    start, nor to hand the reply on), bounded by the caller's deadline: past
    it, DeadlineExceeded (not a target failure, which would move the request
    to another replica)."""
    import grpc
    import pytest

    from specdec.errors import DeadlineExceeded, SpecdecError, Unavailable

    class Recording(FakeTarget):
        def __init__(self, seconds, fail=None, short=False):
            super().__init__(seconds)
            self.tasks, self.timeouts, self.fail, self.short = [], [], fail, short

        async def verify(self, items, timeout):
            self.tasks.append(asyncio.current_task())
            self.timeouts.append(timeout)
            if self.fail is not None:
                raise grpc.aio.AioRpcError(self.fail, grpc.aio.Metadata(), grpc.aio.Metadata(), "no")
            reply, size = await super().verify(items, timeout)
            if self.short:
                del reply.results[:]
            return reply, size

    async def main():
        target = Recording(0.01)
        batcher = VerifyBatcher(target, max_batch=4, window_s=0.001, rpc_timeout_s=60.0)
        batcher.request_started()
        reply = await batcher.verify(item(4), timeout=5.0)
        assert reply.result.argmax_token_ids[0] == 4
        assert target.tasks == [asyncio.current_task()] and target.timeouts == [5.0]
        errors = {}
        # 60 s: a request without a deadline of its own waits as long as the call's own limit; the
        # call's end at that limit is the target's failure (another replica may answer), not the request's.
        for code, timeout in ((grpc.StatusCode.DEADLINE_EXCEEDED, 5.0), (grpc.StatusCode.UNAVAILABLE, 5.0),
                              ("limit", 60.0)):
            batcher.target = Recording(0.01, fail=grpc.StatusCode.DEADLINE_EXCEEDED if code == "limit" else code)
            try:
                await batcher.verify(item(5), timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - the test reads it
                errors[code] = exc
        batcher.target = Recording(0.01, short=True)
        with pytest.raises(SpecdecError, match="0 results for 1 items"):
            await asyncio.wait_for(batcher.verify(item(6), timeout=5.0), 5)
        batcher.target = Recording(0.01)
        after = await batcher.verify(item(7), timeout=5.0)  # nothing was left counted in flight
        assert after.result.argmax_token_ids[0] == 7
        return errors

    errors = run(main())
    assert isinstance(errors[grpc.StatusCode.DEADLINE_EXCEEDED], DeadlineExceeded)
    assert isinstance(errors[grpc.StatusCode.UNAVAILABLE], Unavailable)
    assert isinstance(errors["limit"], Unavailable) and not isinstance(errors["limit"], DeadlineExceeded)


def test_an_items_error_keeps_its_status_a_lost_session_is_recovered_and_the_rest_is_internal():
    """What the loop raises for an item the target refused: NOT_FOUND is a
    lost session (recovered); a status the core has an error for reaches the
    client with its code and message (a replica restarted with a lower
    --max-draft-tokens refuses k); anything else is our failure (INTERNAL)."""
    import grpc

    from specdec.errors import InvalidArgument, NotFound, ResourceExhausted, SpecdecError
    from specdec.rpc import grpc_errors

    class Refusing(FakeTarget):
        async def verify(self, items, timeout):
            code = {"s1": grpc.StatusCode.NOT_FOUND, "s2": grpc.StatusCode.INVALID_ARGUMENT,
                    "s3": grpc.StatusCode.RESOURCE_EXHAUSTED, "s4": grpc.StatusCode.INTERNAL}[items[0].session_id]
            result = target_pb2.VerifyResult(session_id=items[0].session_id)
            result.error.code, result.error.message = code.value[0], f"refused {items[0].session_id}"
            return target_pb2.VerifyResponse(results=[result], batch_size=1), 10

    async def main():
        batcher = VerifyBatcher(Refusing(0.0), max_batch=4, window_s=0.001)
        batcher.request_started()
        errors = []
        for n in range(1, 5):
            try:
                await batcher.verify(item(n))
            except SpecdecError as exc:
                errors.append(exc)
        return errors

    errors = run(main())
    assert [type(e) for e in errors] == [NotFound, InvalidArgument, ResourceExhausted, SpecdecError]
    assert "refused s2" in str(errors[1])
    assert grpc_errors.status_for(errors[1])[0] is grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_errors.status_for(errors[3])[0] is grpc.StatusCode.INTERNAL


def test_an_unsampled_request_first_in_a_batch_does_not_hide_the_batch_from_the_others():
    """verify.batch was the first item's child: when that request was not
    sampled (its client sent flags 00), the batch's span and the target's
    under it were dropped for every request in the batch."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from specdec import telemetry as T
    from specdec.rpc.grpc_tracing import trace_metadata

    exporter = InMemorySpanExporter()
    telemetry = T.setup_telemetry("orchestrator", T.TelemetrySettings(), span_exporters=[exporter])
    sent = []

    class Target:
        async def verify(self, items, timeout):
            sent.append(dict(trace_metadata()))
            await asyncio.sleep(0.02)
            results = [target_pb2.VerifyResult(argmax_token_ids=[1]) for _ in items]
            return target_pb2.VerifyResponse(results=results, batch_size=len(items), compute_micros=10), 10

    async def request(batcher, n, traceparent):
        metadata = (("traceparent", traceparent),) if traceparent else ()
        with telemetry.server_span(T.SPAN_GENERATE, metadata):
            with telemetry.span(T.SPAN_TARGET_VERIFY) as span:
                await batcher.verify(target_pb2.VerifyItem(session_id=f"s{n}"), 5)
                return span.get_span_context().trace_id

    async def main():
        batcher = VerifyBatcher(Target(), max_batch=16, window_s=0.01, telemetry=telemetry)
        batcher.request_started()
        batcher.request_started()
        first = asyncio.ensure_future(request(batcher, 0, "00-" + "1" * 32 + "-" + "2" * 16 + "-00"))
        await asyncio.sleep(0)
        _, sampled = await asyncio.gather(first, request(batcher, 1, None))
        return sampled

    try:
        sampled = asyncio.run(asyncio.wait_for(main(), 30))
        assert len(sent) == 1 and int(sent[0]["traceparent"][-2:], 16) & 1  # sampled: the target records its span
        batches = [s for s in exporter.get_finished_spans() if s.name == T.SPAN_VERIFY_BATCH]
        assert [b.context.trace_id for b in batches] == [sampled]
    finally:
        telemetry.shutdown()
