"""orchestrator/reply_relay.py: a Generate call's replies made ahead of their writes."""
from __future__ import annotations

import asyncio

import pytest

from orchestrator.reply_relay import merged, written_behind
from specdec.errors import DeadlineExceeded
from specdec.v1 import orchestrator_pb2 as pb


def chunk(text: str, *ids: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.TextChunk(text=text, token_ids=list(ids)))


def stats(tokens: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(stats=pb.GenerateStats(completion_tokens=tokens))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_merged_joins_runs_of_chunks_and_keeps_the_rest_in_place():
    out = merged([chunk("a", 1), chunk("b", 2, 3), stats(3), chunk("c", 4)])
    assert [r.WhichOneof("event") for r in out] == ["chunk", "stats", "chunk"]
    assert (out[0].chunk.text, list(out[0].chunk.token_ids)) == ("ab", [1, 2, 3])
    assert out[1].stats.completion_tokens == 3
    assert (out[2].chunk.text, list(out[2].chunk.token_ids)) == ("c", [4])


def test_the_source_runs_on_while_a_write_is_under_way():
    """The loop's next rounds do not wait for the caller's (slow) writes:
    they are made meanwhile, and reach the caller merged, in order."""
    made: list[int] = []

    async def main():
        all_made = asyncio.Event()

        async def source():
            for i in range(5):
                made.append(i)
                yield chunk(str(i), i)
                if i == 4:
                    all_made.set()
                await asyncio.sleep(0)  # a round's awaits
            yield stats(5)

        got = []
        async for reply in written_behind(source()):
            got.append(reply)
            if len(got) == 1:
                # The first write is slow: it lasts until the source has made
                # its other four chunks, which it never does if it waits for
                # the write (then this times out).
                try:
                    await asyncio.wait_for(all_made.wait(), 5)
                except TimeoutError:
                    pytest.fail(f"the source waited for the write: {len(made)} of 5 chunks made")
        return got

    got = run(main())
    assert len(made) == 5
    texts = "".join(r.chunk.text for r in got if r.HasField("chunk"))
    ids = [t for r in got if r.HasField("chunk") for t in r.chunk.token_ids]
    assert (texts, ids) == ("01234", [0, 1, 2, 3, 4])
    assert len(got) == 3  # "0", then "1234" gathered during the slow write, then the statistics
    assert got[-1].HasField("stats")


def test_an_error_comes_after_every_reply_made_before_it():
    async def source():
        yield chunk("a", 1)
        yield chunk("b", 2)
        raise DeadlineExceeded("the deadline passed")

    async def main():
        got = []
        with pytest.raises(DeadlineExceeded, match="deadline passed"):
            async for reply in written_behind(source()):
                got.append(reply)
                await asyncio.sleep(0.01)
        return got

    got = run(main())
    assert "".join(r.chunk.text for r in got) == "ab"


def test_an_error_before_any_reply_is_raised():
    async def source():
        raise ValueError("bad request")
        yield  # pragma: no cover - makes this an async generator

    async def main():
        async for _ in written_behind(source()):
            pass

    with pytest.raises(ValueError, match="bad request"):
        run(main())


@pytest.mark.parametrize("how", ["close", "cancel"])
def test_a_caller_that_stops_ends_the_source_and_its_cleanup_has_run(how):
    """A closed relay, or a cancelled task reading it (a cancelled call: the
    relay itself stays suspended), cancels the source: its finally (the
    loop's: closing the request's sessions) runs, and it makes nothing more."""
    cleaned, made = [], []

    async def source():
        try:
            for i in range(1000):
                made.append(i)
                yield chunk(str(i), i)
                await asyncio.sleep(0.001)
        finally:
            cleaned.append(True)

    async def main():
        relay = written_behind(source())
        if how == "close":
            await relay.__anext__()
            await relay.aclose()
        else:
            async def consume():
                async for _ in relay:
                    await asyncio.sleep(0.001)

            task = asyncio.ensure_future(consume())
            await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0)  # the source's cancellation is delivered
        assert cleaned == [True]
        n = len(made)
        await asyncio.sleep(0.02)
        assert len(made) == n

    run(main())


def test_a_cleanup_that_fails_after_the_caller_stopped_is_logged(caplog):
    """The call has ended, so no status carries it: the log does."""
    async def source():
        try:
            yield chunk("a", 1)
            await asyncio.sleep(10)
        finally:
            raise RuntimeError("closing the sessions failed")

    async def main():
        relay = written_behind(source())
        await relay.__anext__()
        await relay.aclose()

    run(main())
    assert any("cleanup then failed" in r.message and r.exc_info and "closing the sessions" in str(r.exc_info[1])
               for r in caplog.records)


def test_the_sources_own_error_is_raised_not_logged(caplog):
    async def source():
        yield chunk("a", 1)
        raise DeadlineExceeded("the deadline passed")

    async def main():
        async for _ in written_behind(source()):
            pass

    with pytest.raises(DeadlineExceeded):
        run(main())
    assert not [r for r in caplog.records if "cleanup" in r.message]


def test_a_request_that_ends_with_its_own_error_as_the_caller_stops_is_no_cleanup_failure(caplog):
    """The client's deadline and the request's pass at the same moment: grpc
    stops the call while the source raises DeadlineExceeded. That is the
    request's end, not a failed cleanup: logged at INFO, not as an error."""
    import logging

    caplog.set_level(logging.INFO, logger="orchestrator.reply_relay")

    async def source():
        try:
            yield chunk("a", 1)
            await asyncio.sleep(10)
        finally:
            raise DeadlineExceeded("the request's deadline passed while verifying")

    async def main():
        relay = written_behind(source())
        await relay.__anext__()
        await relay.aclose()

    run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("ended as its request did" in r.message and "DeadlineExceeded" in r.message for r in caplog.records)


def test_a_generate_closed_from_another_task_ends_its_span_without_a_detach_error(caplog):
    """grpc cancels a streaming handler's task during a write and leaves its
    generator suspended; whoever closes it later ran the span's detach in
    another context ("Failed to detach context", at ERROR). The request's
    span is now current only in the task that runs the request."""
    import logging

    from opentelemetry import trace
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from orchestrator.servicer import OrchestratorServicer
    from specdec import telemetry as T

    exporter = InMemorySpanExporter()
    telemetry = T.setup_telemetry("orchestrator", T.TelemetrySettings(), span_exporters=[exporter])
    seen = []

    class Context:
        def invocation_metadata(self):
            return ()

        def time_remaining(self):
            return None

    async def generate(request, span, time_remaining):
        seen.append(trace.get_current_span() is span)  # current in the request's task
        while True:
            yield pb.GenerateResponse(chunk=pb.TextChunk(text="x"))
            await asyncio.sleep(0)

    servicer = OrchestratorServicer.__new__(OrchestratorServicer)
    servicer.telemetry = telemetry
    servicer.generate = generate

    async def main():
        replies = servicer.Generate(pb.GenerateRequest(), Context())
        handler = asyncio.ensure_future(replies.__anext__())
        await handler
        await asyncio.ensure_future(replies.aclose())  # from another task, as a collected generator is
        await asyncio.sleep(0.01)

    try:
        with caplog.at_level(logging.ERROR, logger="opentelemetry.context"):
            asyncio.run(asyncio.wait_for(main(), 30))
        telemetry.force_flush()
        assert seen == [True]
        assert [s.name for s in exporter.get_finished_spans()] == [T.SPAN_GENERATE]
        assert not [r for r in caplog.records if "detach" in r.getMessage()]
    finally:
        telemetry.shutdown()
