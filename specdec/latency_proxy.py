"""A TCP proxy that adds network latency, jitter and a bandwidth cap.

Tests and `specd bench --draft-rtt-ms X --target-rtt-ms Y` put one in front of
each model service on 127.0.0.1, so the orchestrator sees a network:

    with LatencyProxy("127.0.0.1:50053", delay_ms=10) as proxy:
        channel = grpc.insecure_channel(proxy.address)   # each round trip gains 20 ms

Semantics:

- ``delay_ms`` is ONE-WAY and applies in each direction, so a round trip
  through the proxy gains ``2 * delay_ms``: to emulate a round-trip time X,
  pass ``delay_ms = X / 2``.
- Every chunk read from one side is written to the other side at
  ``time read + delay + jitter`` (plus serialization time, below). Jitter is
  drawn uniformly from ``[0, jitter_ms]`` per chunk, so it only ever adds
  delay. Order is preserved: a chunk is never sent before the previous chunk
  of the same direction, so a chunk that drew a small jitter behind one that
  drew a large jitter waits for it (the delays seen are a running maximum, as
  on a real in-order link).
- ``bandwidth_mbps > 0`` (megabits per second, 10**6 bits) caps each
  direction separately, modelled as a link: a chunk starts transmitting when
  it is read or when the previous chunk has finished transmitting, whichever
  is later, takes ``bytes * 8 / (bandwidth_mbps * 1e6)`` seconds, and then
  travels ``delay + jitter``. 0 means unlimited.
- ``set_delay`` changes the delay (and optionally the jitter) for data read
  from then on; data already in flight keeps its schedule.
- Each accepted connection opens its own upstream connection. An upstream that
  cannot be reached closes the client connection (no data, no error logged
  above debug level). When one side ends its stream (EOF), the data still
  pending for the other side is flushed and the end is passed on as a
  half-close; the connection is torn down once both directions have ended,
  ``half_close_timeout_s`` after the first end at the latest, or at once if a
  side resets.
- A direction holding more than ``max_pending_bytes`` not yet delivered stops
  reading from its source until half of it has drained (TCP flow control then
  slows the sender), so memory stays bounded.

The proxy runs its own asyncio loop in a daemon thread; `start`, `stop`,
`set_delay` and the byte counters may be used from any thread. A writer task
per direction sleeps until the next chunk is due (no polling), so an idle
proxy costs no CPU.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import random
import threading

from specdec.config import MAX_PORT, check_port

log = logging.getLogger(__name__)

__all__ = ["LatencyProxy", "parse_address"]

_READ_CHUNK = 64 * 1024


def parse_address(address: str) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port"."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    if not 1 <= int(port) <= MAX_PORT:
        raise ValueError(f"the port of {address!r} must be in [1, {MAX_PORT}]")
    return host.strip("[]"), int(port)


class LatencyProxy:
    """A latency-, jitter- and bandwidth-shaping TCP proxy to one upstream
    (see the module docstring for the exact semantics)."""

    #: seconds allowed to open the upstream connection for each client
    connect_timeout_s: float = 10.0
    #: after one direction ends, seconds the other may go on before both close
    half_close_timeout_s: float = 30.0
    #: undelivered bytes per direction before reading from its source pauses
    max_pending_bytes: int = 32 * 1024 * 1024

    def __init__(self, upstream: str, delay_ms: float = 0.0, jitter_ms: float = 0.0,
                 bandwidth_mbps: float = 0.0, host: str = "127.0.0.1", port: int = 0):
        self.upstream = upstream
        self._upstream_host, self._upstream_port = parse_address(upstream)
        if bandwidth_mbps < 0:
            raise ValueError(f"bandwidth_mbps must be >= 0, got {bandwidth_mbps}")
        check_port(port, "the port to listen on")  # asyncio would raise OverflowError once the thread runs
        self._check_delay(delay_ms, jitter_ms)
        # One tuple, replaced whole: readers on the loop thread always see a consistent pair.
        self._shape = (delay_ms / 1000.0, jitter_ms / 1000.0)
        self.bandwidth_mbps = float(bandwidth_mbps)
        self.host = host
        self._requested_port = port
        self._port: int | None = None
        self.bytes_up = 0    # client -> upstream, bytes written so far
        self.bytes_down = 0  # upstream -> client
        self._rng = random.Random()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._handlers: set[asyncio.Task] = set()
        self._stopped = False

    # ------------------------------------------------------------ public API

    @staticmethod
    def _check_delay(delay_ms: float, jitter_ms: float) -> None:
        if delay_ms < 0 or jitter_ms < 0:
            raise ValueError(f"delay and jitter must be >= 0, got {delay_ms} ms and {jitter_ms} ms")

    @property
    def delay_ms(self) -> float:
        return self._shape[0] * 1000.0

    @property
    def jitter_ms(self) -> float:
        return self._shape[1] * 1000.0

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the proxy is not listening (call start() first)")
        return self._port

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def set_delay(self, delay_ms: float, jitter_ms: float | None = None) -> None:
        """One-way delay (and jitter, if given) for data read from now on."""
        jitter_s = self._shape[1] if jitter_ms is None else jitter_ms / 1000.0
        self._check_delay(delay_ms, jitter_s * 1000.0)
        self._shape = (delay_ms / 1000.0, jitter_s)

    def start(self) -> LatencyProxy:
        """Listen (in a daemon thread with its own event loop); returns once
        the port is bound. Raises OSError if it cannot bind."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("a stopped LatencyProxy cannot be restarted")
            if self._thread is not None:
                return self
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name=f"latency-proxy->{self.upstream}",
                                      daemon=True)
            thread.start()
            try:
                asyncio.run_coroutine_threadsafe(self._listen(), loop).result(30)
            except BaseException:
                loop.call_soon_threadsafe(loop.stop)
                thread.join(10)
                loop.close()
                raise
            self._loop, self._thread = loop, thread
        log.debug("latency proxy %s -> %s (one-way delay %.1f ms, jitter %.1f ms, %s)", self.address,
                  self.upstream, self.delay_ms, self.jitter_ms,
                  f"{self.bandwidth_mbps} Mbit/s" if self.bandwidth_mbps else "unlimited bandwidth")
        return self

    def stop(self) -> None:
        """Close the listener and every connection, and join the thread.
        Safe to call more than once, and before start()."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(30)
        except Exception:  # pragma: no cover - a shutdown that fails must still stop the thread
            log.debug("latency proxy shutdown failed", exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        if not thread.is_alive():
            loop.close()

    def __enter__(self) -> LatencyProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.address if self._port is not None else "not listening"
        return (f"LatencyProxy({where} -> {self.upstream}, delay_ms={self.delay_ms}, "
                f"jitter_ms={self.jitter_ms}, bandwidth_mbps={self.bandwidth_mbps})")

    # ------------------------------------------------------------ loop side

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self._requested_port,
                                                  limit=_READ_CHUNK)
        self._port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        if handlers:
            await asyncio.gather(*handlers, return_exceptions=True)
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 5)
            except (asyncio.TimeoutError, OSError):  # pragma: no cover
                pass

    def _sample_delay(self) -> float:
        delay, jitter = self._shape
        return delay + (self._rng.uniform(0.0, jitter) if jitter > 0 else 0.0)

    def _count(self, direction: str, n: int) -> None:
        if direction == "up":
            self.bytes_up += n
        else:
            self.bytes_down += n

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._handlers.add(task)
        peer = client_writer.get_extra_info("peername")
        upstream_writer = None
        pipes: list[asyncio.Task] = []
        try:
            try:
                upstream_reader, upstream_writer = await asyncio.wait_for(
                    asyncio.open_connection(self._upstream_host, self._upstream_port, limit=_READ_CHUNK),
                    self.connect_timeout_s)
            except (OSError, asyncio.TimeoutError) as exc:
                log.debug("latency proxy: cannot reach %s for %s: %r", self.upstream, peer, exc)
                return
            log.debug("latency proxy: %s connected through %s", peer, self.address)
            pipes = [asyncio.ensure_future(_Pipe(self, client_reader, upstream_writer, "up").run()),
                     asyncio.ensure_future(_Pipe(self, upstream_reader, client_writer, "down").run())]
            done, pending = await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            if pending and all(t.result() for t in done):  # a clean end: let the other direction finish
                await asyncio.wait(pending, timeout=self.half_close_timeout_s)
        except asyncio.CancelledError:
            pass  # stop(): fall through to closing everything
        except Exception as exc:  # noqa: BLE001 - a connection's failure must not reach the loop's log
            log.debug("latency proxy: connection from %s failed: %r", peer, exc)
        finally:
            for pipe in pipes:
                pipe.cancel()
            if pipes:
                await asyncio.gather(*pipes, return_exceptions=True)
            for writer in (client_writer, upstream_writer):
                if writer is not None:
                    await _close(writer)
            self._handlers.discard(task)
            log.debug("latency proxy: %s closed", peer)


async def _close(writer: asyncio.StreamWriter) -> None:
    """Close after the transport's buffer is flushed; abort a peer that does not read."""
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 2)
    except (OSError, asyncio.TimeoutError, asyncio.CancelledError):
        writer.transport.abort()


class _Pipe:
    """One direction of one connection: a reader that timestamps chunks and a
    writer that delivers them when due, in order."""

    def __init__(self, proxy: LatencyProxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 direction: str):
        self.proxy, self.reader, self.writer, self.direction = proxy, reader, writer, direction
        self.queue: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self.queued = asyncio.Event()    # set when the queue gains an item
        self.drained = asyncio.Event()   # set when pending bytes fall below the low-water mark
        self.pending = 0
        self.last_due = 0.0
        self.link_free = 0.0             # when the (bandwidth-capped) link finishes its last chunk

    async def run(self) -> bool:
        """True when the source ended cleanly and the end was passed on;
        False when either side failed (reset, broken pipe)."""
        reading = asyncio.ensure_future(self._read())
        writing = asyncio.ensure_future(self._deliver())
        try:
            await asyncio.wait((reading, writing), return_when=asyncio.FIRST_COMPLETED)
            if not reading.done() or not reading.result():  # the writer only ends first on a failure
                return False
            return await writing
        finally:
            for task in (reading, writing):
                task.cancel()
            await asyncio.gather(reading, writing, return_exceptions=True)

    def _push(self, now: float, data: bytes | None) -> None:
        sent = now  # when the chunk's last bit has left: now, or later behind a bandwidth cap
        if data and self.proxy.bandwidth_mbps > 0:
            sent = max(now, self.link_free) + len(data) * 8 / (self.proxy.bandwidth_mbps * 1e6)
            self.link_free = sent
        due = max(sent + self.proxy._sample_delay(), self.last_due)
        self.last_due = due
        self.queue.append((due, data))
        self.queued.set()

    async def _read(self) -> bool:
        loop = asyncio.get_running_loop()
        limit = self.proxy.max_pending_bytes
        try:
            while True:
                data = await self.reader.read(_READ_CHUNK)
                self._push(loop.time(), data or None)
                if not data:
                    return True
                self.pending += len(data)
                if self.pending > limit:
                    self.drained.clear()
                    await self.drained.wait()
        except (OSError, asyncio.IncompleteReadError) as exc:
            log.debug("latency proxy %s: read failed: %r", self.direction, exc)
            return False

    async def _deliver(self) -> bool:
        loop = asyncio.get_running_loop()
        low_water = self.proxy.max_pending_bytes // 2
        try:
            while True:
                while not self.queue:
                    self.queued.clear()
                    await self.queued.wait()
                due = self.queue[0][0]
                while (now := loop.time()) < due:
                    await asyncio.sleep(due - now)
                # Everything due by now goes out in one write.
                batch, eof = [], False
                while self.queue and self.queue[0][0] <= now:
                    data = self.queue.popleft()[1]
                    if data is None:
                        eof = True
                        break
                    batch.append(data)
                if batch:
                    payload = b"".join(batch)
                    self.proxy._count(self.direction, len(payload))  # before the peer can see it
                    self.writer.write(payload)
                    await self.writer.drain()
                    self.pending -= len(payload)
                    if self.pending <= low_water:
                        self.drained.set()
                if eof:
                    if self.writer.can_write_eof():
                        self.writer.write_eof()
                    return True
        except OSError as exc:
            log.debug("latency proxy %s: write failed: %r", self.direction, exc)
            self.drained.set()
            return False
