"""The event loop every role runs on: uvloop's (libuv; grpc.aio and uvicorn
support it) when it is installed, asyncio's own otherwise or when
SPECD_UVLOOP=off.

A gRPC call crosses the event loop several times (the call, grpc's poller
waking the loop, the reply); uvloop makes each crossing cheaper: a bare
grpc.aio unary call on loopback measured 0.73 -> 0.53 ms on the 2-core dev VM
(`specd overhead` prints which loop it ran on).
"""
from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def _uvloop():
    if os.environ.get("SPECD_UVLOOP", "on").strip().lower() in ("off", "0", "false", "no"):
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def loop_name() -> str:
    return "uvloop" if _uvloop() is not None else "asyncio"


def new_event_loop() -> asyncio.AbstractEventLoop:
    uvloop = _uvloop()
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(main: Awaitable[T]) -> T:
    """`asyncio.run(main)` on the loop chosen above."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)



class BackgroundLoop:
    """An event loop on a daemon thread, for servers that sync callers drive
    (tests, `specd overhead`, the fuzzer). `new_loop` picks the loop:
    the roles' own (`new_event_loop`) unless told otherwise."""

    def __init__(self, new_loop: Callable[[], asyncio.AbstractEventLoop] = new_event_loop,
                 timeout_s: float = 120.0, name: str = "background-loop"):
        self.loop = new_loop()
        self.timeout_s = timeout_s
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        """Run `coro` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout or self.timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    stop = close
