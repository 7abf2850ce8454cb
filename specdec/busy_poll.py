"""Busy polling: an event loop that polls instead of sleeping while a reply
is due, so the message that ends the wait is read at once, by a CPU that
never went idle.

A round's four messages each end a wait: the orchestrator's for the draft's
reply, then the target's; each service's for its next call. A thread that
sleeps in epoll through that wait pays, when the message comes, for its CPU
leaving its idle state (on a VM whose guest halts idle vCPUs, an exit to the
hypervisor), for being scheduled again, and for running its Python with the
caches gone cold. On the 2-core dev VM one 16-byte frame each way after a
3 ms wait cost the waiting side 300-500 µs over the wait, 120-190 µs when
that side's loop kept polling through it (a scratch echo, side by side).

The trick: while a wait is on, a callback on the loop schedules itself again
with `call_soon`. A loop with a callback ready polls its sockets with a zero
timeout (asyncio's and uvloop's alike) and so never blocks; every turn still
reads whatever I/O is ready and runs every other callback, so nothing on the
loop is delayed by it. A turn costs a few microseconds of CPU.

It costs a CPU for the length of each wait, so it is bounded and off unless
asked for (`--busy-poll-us`):
- a caller polls from sending a call until its reply comes (`waiting`), at
  most `max_s` from the call's start, and sleeps after;
- a service keeps polling for `max_s` after each reply it sends (`linger`),
  as its next call usually follows within a round.
It is Linux's SO_BUSY_POLL, done in the event loop: worth it on a machine
with a CPU to spare for each role (a GPU host); on a machine where the roles
share fewer CPUs than they have (the 2-core dev VM), a polling role takes CPU
from one that computes.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import weakref

_max_s = 0.0  # this process's setting (`configure`)
_pollers: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Poller]" = weakref.WeakKeyDictionary()


def configure(max_us: float) -> None:
    """How long, in microseconds, a wait may be polled through (0 or less: never)."""
    global _max_s
    _max_s = max(0.0, max_us / 1e6)
    if not _max_s:
        for poller in list(_pollers.values()):
            poller.stop()


def enabled() -> bool:
    return _max_s > 0


class _Poller:
    """One loop's polling: on while any wait is on (up to its limit) or a
    linger has not ended."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.waits = 0
        self.until = 0.0  # polling stops at this monotonic time, waits or not
        self.linger_until = 0.0
        self.running = False
        self.turns = 0  # turns polled, since start (for tests and `specd overhead`)

    def start(self, until: float) -> None:
        if until > self.until:
            self.until = until
        if not self.running:
            self.running = True
            self.loop.call_soon(self._turn)

    def stop(self) -> None:
        self.until = self.linger_until = 0.0

    def _turn(self) -> None:
        now = time.monotonic()
        if now < self.until and (self.waits > 0 or now < self.linger_until):
            self.turns += 1
            self.loop.call_soon(self._turn)
        else:
            self.running = False


def _poller() -> _Poller:
    loop = asyncio.get_running_loop()
    poller = _pollers.get(loop)
    if poller is None:
        poller = _pollers[loop] = _Poller(loop)
    return poller


class _Waiting:
    """A wait being polled through: ends when its block does."""

    __slots__ = ("poller",)

    def __init__(self, poller: _Poller):
        self.poller = poller

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info) -> None:
        self.poller.waits -= 1


_NOT_POLLING = contextlib.nullcontext()  # what `waiting` is when off: nothing made per call


def waiting():
    """A context manager: poll while its block waits for a reply (at most
    the configured time from now)."""
    if not _max_s:
        return _NOT_POLLING
    poller = _poller()
    poller.waits += 1
    poller.start(time.monotonic() + _max_s)
    return _Waiting(poller)


def linger() -> None:
    """Keep polling for the configured time from now: a reply was just sent,
    and the peer's next call is likely to follow soon."""
    if not _max_s:
        return
    poller = _poller()
    poller.linger_until = until = time.monotonic() + _max_s
    poller.start(until)


def arrived() -> None:
    """A call came: whatever linger waited for it has ended (its handler
    may now hand work to the engine thread, which a polling loop would
    only contend with for the CPU)."""
    if _max_s:
        poller = _pollers.get(asyncio.get_running_loop())
        if poller is not None:
            poller.linger_until = 0.0


def turns() -> int:
    """Turns this thread's running loop has polled (0 when it never polled)."""
    poller = _pollers.get(asyncio.get_running_loop())
    return poller.turns if poller is not None else 0

