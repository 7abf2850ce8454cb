"""The bare reference of the transport a round actually uses: one frame each
way on an open lane connection (specdec/rpc/lane.py: a 4-byte length and
the payload, over TCP between two event loops), with none of our code
around it: no call ids, no protobuf, no handler, no deadline. A frame
echo server on `FrameConnection`, the class both halves of a lane use, and
the call that sends one 16-byte frame and waits for it to come back.

The bare grpcio references (bare_grpc.py) are the floor of a gRPC message;
a round's two calls go on the services' lanes instead, so this is the floor
the round's own transport sets. `specd overhead` measures it in the same
run, to a server in a process of its own as each service is (the echo runs
beside the bare grpc echo in `bare_grpc.ChildServer`), and a round's floor
as a round meets it (`bare_grpc.cold_floor`: each frame after the wait of
one service's compute).
"""
from __future__ import annotations

import asyncio
import collections
import statistics
from typing import Awaitable, Callable

from specdec.bench.interleave import Call
from specdec.rpc.lane import FrameConnection

try:
    import resource
except ImportError:  # not a Unix: no per-thread CPU figure
    resource = None

LIMIT = 1 << 20  # bytes a frame may have (the references send 16)
PAYLOAD = b"0123456789abcdef"


class _Echo(FrameConnection):
    """Each frame straight back, from `data_received`, as a lane server
    starts a call's handler."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.start_frames(self.write)


async def start_echo(host: str = "127.0.0.1") -> tuple[asyncio.AbstractServer, int]:
    """The frame echo server on this event loop, on a free port: (server, port)."""
    server = await asyncio.get_running_loop().create_server(lambda: _Echo(LIMIT), host, 0)
    return server, server.sockets[0].getsockname()[1]


async def calls(port: int, host: str = "127.0.0.1") -> tuple[dict[str, Call], Callable[[], Awaitable[None]]]:
    """{"bare lane frame": one frame each way} on a connection to the echo
    at `port`, opened now, and its closer."""
    loop = asyncio.get_running_loop()
    _, connection = await loop.create_connection(lambda: FrameConnection(LIMIT), host, port)
    waiting: collections.deque[asyncio.Future] = collections.deque()
    # Each frame resolves its caller's future from data_received, as a lane client's reply does.
    connection.start_frames(lambda payload: waiting.popleft().set_result(payload))

    async def one_frame() -> None:
        reply = loop.create_future()
        waiting.append(reply)
        connection.write(PAYLOAD)
        if await reply != PAYLOAD:
            raise RuntimeError("the bare lane echo answered another frame")

    async def close() -> None:
        connection.transport.close()
        await connection.ended

    return {"bare lane frame": one_frame}, close


def thread_cpu() -> float | None:
    """This thread's CPU seconds, user and system (None where the platform
    has no per-thread figure)."""
    if not hasattr(resource, "RUSAGE_THREAD"):  # Linux has it
        return None
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime + usage.ru_stime


async def cpu_per_frame(one_frame: Call, idle_s: float, reps: int) -> float | None:
    """Median CPU seconds this thread spends on one bare frame each way,
    each sent after `idle_s` of idle (0: back to back): what a message costs
    the caller's process by itself, before any code of ours. On the 2-core
    dev VM it grew from about 30 µs back to back to about 330 after 10 ms of
    idle, the caches and the CPU gone cold meanwhile."""
    if thread_cpu() is None:
        return None
    spent = []
    for _ in range(reps):
        if idle_s:
            await asyncio.sleep(idle_s)
        start = thread_cpu()
        await one_frame()
        spent.append(thread_cpu() - start)
    return statistics.median(spent)
