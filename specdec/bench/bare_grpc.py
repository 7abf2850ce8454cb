"""The bare grpcio references `specd overhead` compares our calls with: a
grpc.aio echo server, a unary call and one message each way on an open
bidirectional stream (no interceptors, no protobuf: the floor of a call and
of a message), and a round's floor as a round meets it.

Run as a module, it measures the same references in a process of its own,
under the grpc I/O engine its environment chooses (specdec/rpc/grpc_io.py),
and prints them as JSON: `specd overhead` uses that to show, in one run,
the references under grpcio's default EventEngine beside those of the
process it measures in. With `--serve` it only serves the echo server, in a
process of its own as the deployed services are (`ChildServer`), until its
stdin closes: the bare call a deployed service's no-op compares with; the
bare lane echo (bare_lane.py) beside it, the floor of a round's transport.

    python -m specdec.bench.bare_grpc --reps 200 --gaps 0.0057 0.0022
    python -m specdec.bench.bare_grpc --serve      # prints {"port": N, "lane_port": M}
"""
from __future__ import annotations

import argparse
import asyncio
import json
import select
import subprocess
import sys
import tempfile
import time
from typing import Awaitable, Callable

from specdec.bench.interleave import Call, ReportedCompute, interleave

SERVICE = "specdec.bench.Bare"
DEADLINE_S = 60.0
START_S = 30.0  # the most a child server may take to report its port

async def start_server():
    """A grpc.aio server with two generic echo handlers: unary and bidi."""
    import grpc

    async def echo(request: bytes, context) -> bytes:
        return request

    async def echo_stream(requests, context):
        async for message in requests:
            yield message

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "EchoStream": grpc.stream_stream_rpc_method_handler(echo_stream),
    })])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def calls(port: int) -> tuple[dict[str, Call], Callable[[], Awaitable[None]]]:
    """{"bare unary", "bare stream message"} against the server at `port`, and a closer."""
    import grpc

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    unary = channel.unary_unary(f"/{SERVICE}/Echo")
    stream = channel.stream_stream(f"/{SERVICE}/EchoStream")()
    payload = b"0123456789abcdef"

    async def one_message():
        await stream.write(payload)
        await stream.read()

    async def close():
        await stream.done_writing()
        await channel.close()

    return {"bare unary": lambda: unary(payload, timeout=DEADLINE_S), "bare stream message": one_message}, close


def cold_floor(one_message: Call, gaps: tuple[float, float]) -> Call:
    """A round's floor as a round meets it: two bare stream messages, each
    after the caller has waited as long as one service's compute (the
    draft's, then the target's). The wait is reported as compute, so its
    "outside compute" figure is the two messages alone, sent to threads that
    have gone idle: on the dev VM a message after 5 ms of idle costs about
    twice one sent back to back (`specd overhead` prints both)."""

    async def call():
        slept = 0.0
        for gap in gaps:
            start = time.perf_counter()
            await asyncio.sleep(gap)
            slept += time.perf_counter() - start
            await one_message()
        return ReportedCompute(slept)

    return call


class ChildServer:
    """The echo server in a process of its own (`--serve`), started by the
    measuring process and stopped by it: it ends when its stdin closes."""

    def __init__(self, start_s: float = START_S):
        self._stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen([sys.executable, "-m", "specdec.bench.bare_grpc", "--serve"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        try:
            ready, _, _ = select.select([self.process.stdout], [], [], start_s)
            line = self.process.stdout.readline() if ready else b""
            if not line:
                raise RuntimeError(f"the bare echo server's process gave no port within {start_s:.0f} s "
                                   f"(exit code {self.process.poll()}): {self._stderr_tail()}")
            ports = json.loads(line)
            self.port, self.lane_port = int(ports["port"]), int(ports["lane_port"])
        except BaseException:
            self.stop()
            raise

    def _stderr_tail(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-500:].decode(errors="replace").strip() or "no output"

    def stop(self) -> None:
        from specdec.processes import close_stdin_and_wait

        close_stdin_and_wait(self.process, 10.0)
        for pipe in (self.process.stdin, self.process.stdout, self._stderr):
            pipe.close()


async def _serve() -> None:
    from specdec.bench import bare_lane

    server, port = await start_server()
    lane_server, lane_port = await bare_lane.start_echo()
    print(json.dumps({"port": port, "lane_port": lane_port}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    lane_server.close()
    await server.stop(0)


async def _measure_alone(reps: int, gaps: tuple[float, float]) -> dict[str, float]:
    from specdec.bench.overhead_stack import BackgroundLoop

    bg = BackgroundLoop()
    try:
        server, port = bg.run(start_server())
        references, close = await calls(port)
        references["bare cold round floor"] = cold_floor(references["bare stream message"], gaps)
        medians = await interleave(references, reps)
        await close()
        bg.run(server.stop(0))
    finally:
        bg.stop()
    return medians


def main(argv: list[str] | None = None) -> int:
    from specdec import eventloop
    from specdec.rpc import grpc_io

    p = argparse.ArgumentParser(prog="python -m specdec.bench.bare_grpc", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--gaps", type=float, nargs=2, default=(0.005, 0.002),
                   help="seconds of idle before each of the cold floor's two messages")
    p.add_argument("--serve", action="store_true", help="only serve the echo server until stdin closes")
    args = p.parse_args(argv)
    if args.serve:
        eventloop.run(_serve())
        return 0
    medians = eventloop.run(_measure_alone(args.reps, tuple(args.gaps)))
    print(json.dumps({"grpc_io": grpc_io.describe(), "medians": medians}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
