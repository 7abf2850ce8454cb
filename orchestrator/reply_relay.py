"""A Generate call's replies, made ahead of the writes that send them.

The speculative loop yields a chunk each round, and gRPC's Generate wrote it
before the loop went on: grpc.aio's stream handler awaits each message's
write, which hands it to grpc's core and waits for the completion to come
back to the event loop. Every round paid that on its critical path, between
the target's reply and the next round's Propose: a median of 0.59 ms a round
(p90 0.78) on the 2-vCPU development VM with the tiny pair, about 15% of
what a round spent outside the models there.

`written_behind` runs the replies' source in a task of its own and leaves its
replies in a buffer; the caller's writes take whatever has gathered. The
loop's next round starts as soon as the last one's tokens are in the buffer,
and a write overlaps the services' compute instead of preceding it. Chunks
that gather while a write is under way are sent as one (`TextChunk` carries
"the tokens accepted since the previous chunk": merged chunks keep that
contract); the final statistics stay a message of their own, last.

The buffer holds what the client has not read yet: at most the request's own
output, whose length `max_tokens` bounds. A client that stops reading no
longer holds the loop (and its sessions' KV caches) mid-request; grpc's flow
control still bounds what is in flight on the connection. The HTTP front
door needs none of this: its request task already hands replies to the
response writer through a queue (`openai_api/runner.py`).

Errors keep their order: every reply the source made before it failed is
yielded first, then its exception is raised here. The source never outlives
its caller: its task is cancelled when the task that reads the replies ends
(a cancelled call: grpc cancels the handler's task, which leaves this
generator suspended until it is collected), and when this generator is
closed or ends, which also waits for the source's cleanup (closing the
request's sessions) to have run.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
from typing import AsyncIterator

from opentelemetry import context as context_api
from opentelemetry.context import Context

from specdec.errors import SpecdecError
from specdec.v1 import orchestrator_pb2 as pb

log = logging.getLogger(__name__)


def _start_under(coroutine, trace_context: Context | None) -> asyncio.Task:
    """A task for `coroutine` whose context has `trace_context` current: the
    task copies the context it is created in, here a copy of ours with it
    attached (never detached: the copy is the task's alone)."""
    if trace_context is None:
        return asyncio.ensure_future(coroutine)
    context = contextvars.copy_context()
    context.run(context_api.attach, trace_context)
    return context.run(asyncio.ensure_future, coroutine)


async def written_behind(replies: AsyncIterator[pb.GenerateResponse],
                         trace_context: Context | None = None) -> AsyncIterator[pb.GenerateResponse]:
    """`replies`, produced by a task of their own, chunks gathered while a
    write was under way merged into one (see the module docstring). The task
    runs with `trace_context` current (the request's span), when given."""
    buffer: list[pb.GenerateResponse] = []
    arrived = asyncio.Event()

    async def produce() -> None:
        try:
            async for reply in replies:
                buffer.append(reply)
                arrived.set()
        finally:
            arrived.set()  # an end or an error: the writer looks at the task

    producer = _start_under(produce(), trace_context)
    reader = asyncio.current_task()

    def reader_ended(_task) -> None:
        producer.cancel()

    if reader is not None:
        reader.add_done_callback(reader_ended)
    try:
        while True:
            if not buffer:
                if producer.done():
                    producer.result()  # the source's error, after every reply it made
                    return
                await arrived.wait()
                arrived.clear()
                continue
            taken = merged(buffer)
            buffer.clear()
            for reply in taken:
                yield reply
    finally:
        if reader is not None:
            reader.remove_done_callback(reader_ended)
        if not producer.done():
            producer.cancel()
        [ended] = await asyncio.gather(producer, return_exceptions=True)
        # An error the source raised while it was being stopped reaches no
        # caller: the call has ended. The request's own ending (its deadline
        # passing as the client's did, a service gone: the core's errors) is
        # no news; anything else is a cleanup that failed, and is logged so.
        if (isinstance(ended, Exception) and ended is not sys.exc_info()[1]
                and not isinstance(ended, asyncio.CancelledError)):
            if isinstance(ended, SpecdecError):
                log.info("a Generate call ended as its request did: %s: %s", type(ended).__name__, ended)
            else:
                log.error("a Generate call ended; its request's cleanup then failed", exc_info=ended)


def merged(replies: list[pb.GenerateResponse]) -> list[pb.GenerateResponse]:
    """Consecutive chunk replies as one (their texts and token ids in order);
    any other reply (the statistics) as it is. The chunks are merged into
    the first of each run, which is modified."""
    out: list[pb.GenerateResponse] = []
    run: pb.GenerateResponse | None = None  # the chunk reply the next chunks join
    for reply in replies:
        if not reply.HasField("chunk"):
            out.append(reply)
            run = None
        elif run is None:
            out.append(reply)
            run = reply
        else:
            run.chunk.text += reply.chunk.text
            run.chunk.token_ids.extend(reply.chunk.token_ids)
    return out
