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

The trick: while a wait is polled, a callback on the loop schedules itself
again with `call_soon`. A loop with a callback ready polls its sockets with a
zero timeout (asyncio's and uvloop's alike) and so never blocks; every turn
still reads whatever I/O is ready and runs every other callback, so nothing
on the loop is delayed by it. A turn costs a few microseconds of CPU.

Polling costs a CPU while it lasts, so it is bounded and, by default
(`--busy-poll-us -1`, `AUTO`), on only where CPUs are to spare: a role whose
models run on a GPU (for the orchestrator: both its services' do) in a
process that may use at least AUTO_MIN_CPUS CPUs (`usable_cpus`: its
affinity and its cgroup's CPU quota). Where the models compute on the CPUs,
or the CPUs are few, a polling role takes CPU from one that computes. Where
the wait's length can be told from
the waits before it, only its end is polled (hybrid polling, as the kernel's
NVMe driver does it): the loop sleeps until LEAD_S before the shortest of
the last few such waits (`Expected`), then polls.
- A caller polls from then until its reply comes (`waiting`), at most
  `max_s`.
- A service, after each reply it sends, polls likewise until its next call
  comes (`linger`, ended by `arrived`), the gap it expects being the ones
  between its replies and the next calls.
On a machine with a CPU to spare for each role (a GPU host) the whole wait
may be polled at no cost to anyone; on one where the roles share fewer CPUs
than they have (the 2-core dev VM) a polling role takes CPU from a role that
computes, which the hybrid keeps to the wait's end (docs/benchmarks.md).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
import weakref

log = logging.getLogger(__name__)

LEAD_S = 0.0005  # polling starts this long before a wait is expected to end
HISTORY = 8  # the waits `Expected` remembers
AUTO = -1  # --busy-poll-us's default: `choose` decides
# AUTO's choices. On the H200 host (16 cores, 2026-11-28) every role polling
# up to 50 ms a wait took a greedy round's overhead from 1.01-1.17 ms to 0.89
# (docs/benchmarks.md); with 4 CPUs a polling role still leaves its process's
# other threads (the engine's, grpc's, the span exporter's) CPUs to run on.
AUTO_US = 50_000
AUTO_MIN_CPUS = 4

_max_s = 0.0  # how long a wait may be polled now: the setting, or 0 while paused
_configured_s = 0.0  # this process's setting (`configure`)
_pauses = 0  # `paused()` blocks open
_pollers: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Poller]" = weakref.WeakKeyDictionary()


def choose(setting: int, models_on_gpu: bool) -> tuple[int, str]:
    """The microseconds a wait may be polled for a --busy-poll-us `setting`:
    itself, or for AUTO (any negative setting), AUTO_US where the role's
    models run on a GPU and this process may use AUTO_MIN_CPUS CPUs, else 0;
    and how they were chosen (for a log or a report)."""
    if setting >= 0:
        return setting, f"--busy-poll-us {setting}"
    cpus = usable_cpus()
    max_us = AUTO_US if models_on_gpu and cpus >= AUTO_MIN_CPUS else 0
    return max_us, (f"--busy-poll-us -1 (auto): models on {'a GPU' if models_on_gpu else 'the CPU'}, "
                    f"{cpus} usable CPU{'s' if cpus != 1 else ''}")


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, capped by its cgroup's
    CPU quota (a container's `resources.limits.cpu`), rounded down."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cpus, int(quota))) if quota is not None else cpus


def _cgroup_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """The CPU quota of this process's cgroup in CPUs (cgroup v2's cpu.max,
    else v1's cfs quota over its period); None where there is none."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def configure(max_us: float, why: str = "") -> None:
    """How long, in microseconds, a wait may be polled (0 or less: never);
    `why`: how that was chosen, for the log. Within `paused()`, it takes
    effect when the pause ends."""
    global _max_s, _configured_s
    _configured_s = max(0.0, max_us / 1e6)
    if not _pauses:
        _max_s = _configured_s
    if _configured_s:
        log.info("busy polling: the end of each wait for a reply is polled, up to %d us a wait%s",
                 max_us, f" ({why})" if why else "")
    else:
        if why:
            log.info("busy polling off (%s)", why)
        for poller in list(_pollers.values()):
            poller.stop()


def configure_auto(setting: int, models_on_gpu: bool) -> int:
    """`configure` with `choose(setting, models_on_gpu)`, saying why; the microseconds."""
    max_us, why = choose(setting, models_on_gpu)
    configure(max_us, why)
    return max_us


def enabled() -> bool:
    return _max_s > 0


@contextlib.contextmanager
def paused():
    """No polling in this process within the block (what was configured, after
    it): for work that runs the models here, whose threads a polling loop
    would hold the GIL and a CPU from (`specd overhead`'s in-process compute)."""
    global _max_s, _pauses
    _pauses += 1
    _max_s = 0.0
    for poller in list(_pollers.values()):
        poller.stop()
    try:
        yield
    finally:
        _pauses -= 1
        if not _pauses:
            _max_s = _configured_s


class Expected:
    """How long one kind of wait lasts: the last HISTORY of them. The loop
    may sleep until LEAD_S before the shortest (none seen yet: not at all)."""

    __slots__ = ("recent",)

    def __init__(self) -> None:
        self.recent: collections.deque[float] = collections.deque(maxlen=HISTORY)

    def note(self, seconds: float) -> None:
        self.recent.append(seconds)

    def sleep_s(self) -> float:
        """How long a new wait of this kind may sleep before it polls."""
        return min(self.recent) - LEAD_S if self.recent else 0.0


class _Poller:
    """One loop's polling: on while a polled wait is on, or a linger has not
    ended, up to `until`."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.waits = 0  # waits being polled now
        self.until = 0.0  # polling stops at this monotonic time, whatever is on
        self.lingering = False
        self.linger_timer: asyncio.TimerHandle | None = None
        self.linger_since = 0.0  # when the last reply went (what the gap to the next call is timed from)
        self.running = False
        self.turns = 0  # turns polled, since start (for tests and `specd overhead`)

    def start(self) -> None:
        """Poll from now, for up to the configured time."""
        until = time.monotonic() + _max_s
        if until > self.until:
            self.until = until
        if not self.running and _max_s:
            self.running = True
            self.loop.call_soon(self._turn)

    def stop(self) -> None:
        self.until = 0.0
        self.lingering = False

    def _turn(self) -> None:
        if time.monotonic() < self.until and (self.waits > 0 or self.lingering):
            self.turns += 1
            self.loop.call_soon(self._turn)
        else:
            self.running = False

    def start_lingering(self) -> None:
        self.linger_timer = None
        self.lingering = True
        self.start()


def _when_due(loop: asyncio.AbstractEventLoop, expected: Expected | None, start) -> asyncio.TimerHandle | None:
    """Call `start` now, or, when `expected` says such waits last longer
    than the lead, from a timer shortly before they end (returned)."""
    sleep_s = expected.sleep_s() if expected is not None else 0.0
    if sleep_s > 0:
        return loop.call_later(sleep_s, start)
    start()
    return None


def _poller() -> _Poller:
    loop = asyncio.get_running_loop()
    poller = _pollers.get(loop)
    if poller is None:
        poller = _pollers[loop] = _Poller(loop)
    return poller


class _Waiting:
    """One wait for a reply: polled from its start, or from a timer that
    fires shortly before it is expected to end; its length noted on exit."""

    __slots__ = ("poller", "expected", "start", "timer", "polling")

    def __init__(self, poller: _Poller, expected: Expected | None):
        self.poller = poller
        self.expected = expected
        self.polling = False
        self.start = time.monotonic()
        self.timer = _when_due(poller.loop, expected, self._poll)  # None once polling

    def _poll(self) -> None:
        self.timer = None
        self.polling = True
        self.poller.waits += 1
        self.poller.start()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.polling:
            self.poller.waits -= 1
        elif self.timer is not None:
            self.timer.cancel()
        if self.expected is not None and exc_type is None:
            self.expected.note(time.monotonic() - self.start)


_NOT_POLLING = contextlib.nullcontext()  # what `waiting` is when off: nothing made per call


def waiting(expected: Expected | None = None):
    """A context manager: poll while its block waits for a reply, from the
    start or, with `expected`, from LEAD_S before such waits have ended
    lately; at most the configured time."""
    if not _max_s:
        return _NOT_POLLING
    return _Waiting(_poller(), expected)


def linger(expected: Expected | None = None) -> None:
    """A reply was just sent: poll until the peer's next call comes
    (`arrived`), from now or, with `expected` (the gaps between replies and
    the next calls), from LEAD_S before that gap has ended lately; at most
    the configured time."""
    if not _max_s:
        return
    poller = _poller()
    if poller.linger_timer is not None:
        poller.linger_timer.cancel()
    poller.linger_since = time.monotonic()
    poller.lingering = False
    poller.linger_timer = _when_due(poller.loop, expected, poller.start_lingering)


def arrived(expected: Expected | None = None) -> None:
    """A call came: the linger after the last reply has done its work (the
    call's handler may now hand work to the engine thread, which a polling
    loop would only contend with for the CPU); with `expected`, the gap is
    noted there."""
    if not _max_s:
        return
    poller = _pollers.get(asyncio.get_running_loop())
    if poller is None:
        return
    if poller.linger_timer is not None:
        poller.linger_timer.cancel()
        poller.linger_timer = None
    if expected is not None and poller.linger_since:
        expected.note(time.monotonic() - poller.linger_since)
    poller.linger_since = 0.0
    poller.lingering = False


def turns() -> int:
    """Turns this thread's running loop has polled (0 when it never polled)."""
    poller = _pollers.get(asyncio.get_running_loop())
    return poller.turns if poller is not None else 0
