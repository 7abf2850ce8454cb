"""Pin each request to one replica of a service.

Sessions live in one replica's memory, so every call of a request must reach
the replica that opened its sessions. gRPC's own load balancing spreads calls,
not sessions. So the orchestrator resolves a service's name itself (a
Kubernetes headless Service resolves to every ready pod), keeps one channel
(and, for targets, one verify batcher) per replica, and pins each request to
the replica with the fewest active requests.

The name is re-resolved every `refresh_s` seconds whether requests come or
not (`start_refreshing`: an idle orchestrator whose pods were all replaced
must still find the new ones), when a request finds the last resolution
stale, between a recovery's passes, and on `refresh_soon`. One refresh runs
at a time; a caller that finds one running shares it. A refresh never waits
for a replica to answer: a new address is connected in the background and
takes requests once it answered GetModelInfo and `admit` accepted it (the
orchestrator checks it fits the replicas it started with); one that is
refused or never answers has its channel closed, and is tried again at a
later refresh while it is listed. An address that leaves the name is retired:
no new requests, its channel closed once its last request ends (the pool's
last replica stays until another joins, so `acquire` always has one); one
listed again is un-retired. A failed lookup keeps the replicas the pool
knows: a DNS hiccup, or a Service with no ready pod, retires nothing.

A replica that is still listed but not answering (a process that died while
its name still resolves, or an address of a comma-separated `--target`) is
marked down: by a failed call (`mark_down`, from the target's recovery) or
a failed health check (the orchestrator's health loop checks every target
and draft replica every --health-interval-s). New requests go to the replicas that are up; one that
is down gets none until it answers again (`mark_up`) or its down window
ends (1 s, doubled for each failure in a row, at most 30 s), when it gets
one more try. Where every replica is down, they are all tried, least
loaded first, as before. A request pinned to a draft replica that failed
moves, when it re-opens its draft session, to the replica a new request
would get, if one is up (`move_from`; its count moves with it).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from specdec.errors import Unavailable

log = logging.getLogger(__name__)


@dataclass
class Replica:
    address: str
    client: object  # DraftClient or TargetClient
    batcher: object | None = None  # the target's VerifyBatcher
    active: int = 0
    retired: bool = False
    down_until: float = 0.0  # monotonic time before which new requests avoid it (`ReplicaPool.mark_down`)
    failures: int = 0  # failed calls or health checks in a row
    refusal: str = ""  # why `ReplicaPool.recheck` last refused it ("": it did not)

    def is_down(self, now: float) -> bool:
        return now < self.down_until


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


class Unresolved(LookupError):
    """Some name did not resolve (the lookup failed, or found no address).
    `addresses` is what to dial instead: the name itself in its place (grpc
    resolves it on its own), which only a pool that knows no replica uses."""

    def __init__(self, names: list[str], addresses: list[str]):
        super().__init__(f"{', '.join(names)} did not resolve")
        self.addresses = addresses


def _lookup(address: str) -> list[str] | None:
    """Every address one host:port stands for, IPv4 first; an IP literal or
    localhost stands for itself; None when the lookup finds nothing."""
    host, port = split_address(address)
    if host == "localhost":
        return [f"127.0.0.1:{port}"]
    try:
        ipaddress.ip_address(host)
        return [address]
    except ValueError:
        pass
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
        except socket.gaierror:
            continue
        found = {f"[{i[4][0]}]:{port}" if family == socket.AF_INET6 else f"{i[4][0]}:{port}" for i in infos}
        if found:
            return sorted(found)
    return None


def resolve(address: str) -> list[str]:
    """Every address a host:port name stands for (`_lookup`). A
    comma-separated list of names stands for the union of what each stands
    for (replicas on one machine, each on its own port). Raises Unresolved
    when some name does not resolve, rather than guessing: a caller that
    already knows replicas keeps them."""
    found: list[str] = []
    failed: list[str] = []
    for part in filter(None, (p.strip() for p in address.split(","))):
        addresses = _lookup(part)
        if addresses is None:
            failed.append(part)
        found += [a for a in (addresses or [part]) if a not in found]
    if not found:
        raise ValueError(f"no address in {address!r}")
    if failed:
        raise Unresolved(failed, found)
    return found


DOWN_INITIAL_S = 1.0  # a replica's first down window; doubled per failure in a row
DOWN_MAX_S = 30.0
STARTUP_GRACE_S = 2.0  # at start-up, how long the others may still answer once one replica has


class ReplicaPool:
    def __init__(self, address: str, make_replica: Callable[[str], Awaitable[Replica]],
                 close_replica: Callable[[Replica], Awaitable[None]], refresh_s: float = 10.0):
        self.address = address
        self._make = make_replica  # connects; closes what it opened if it fails or is cancelled
        self._close = close_replica
        self.refresh_s = refresh_s
        self.replicas: dict[str, Replica] = {}
        # Raises to refuse a replica that joins (the orchestrator sets it once started); None: take any.
        self.admit: Callable[[Replica], None] | None = None
        self.last_error: Exception | None = None  # why the last replica that tried to join did not
        self._resolved_at = 0.0
        self._refreshing: asyncio.Task | None = None  # the refresh in progress, shared by its callers
        self._joining: dict[str, asyncio.Task] = {}  # addresses being connected, in the background
        self._refresher: asyncio.Task | None = None  # `start_refreshing`'s loop
        self._retry_at: dict[str, float] = {}  # addresses that failed to join: not before then again
        self._unresolved = False  # the last lookup failed (logged once per outage)
        self._closed = False

    async def start(self, timeout_s: float, grace_s: float = STARTUP_GRACE_S) -> None:
        """Resolve the name and connect to every address at once. Returns
        once one replica answered and the others had `grace_s` more (so that
        replicas up together all start, and are all checked); those still
        silent join when they answer: one replica down must not keep the
        orchestrator from serving on the others. Raises why the replicas
        failed if none answered within `timeout_s`."""
        await self._refresh()
        deadline = time.monotonic() + timeout_s
        while not self.replicas:
            pending = set(self._joining.values())
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                raise self.last_error or Unavailable(f"no replica of {self.address} answered within {timeout_s:.0f} s")
            await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        pending = set(self._joining.values())
        if pending:
            await asyncio.wait(pending, timeout=max(0.0, min(grace_s, deadline - time.monotonic())))

    def start_refreshing(self) -> None:
        """Re-resolve every `refresh_s` seconds from now on, requests or not,
        until `close`."""
        if self._refresher is None and not self._closed:
            self._refresher = asyncio.ensure_future(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    async def refresh(self) -> None:
        """Re-resolve the name now, or wait for the refresh in progress.
        Never raises (a failure is logged), and never waits for a new
        replica to answer."""
        if not self._closed:
            await asyncio.shield(self._start_refresh())

    def refresh_soon(self) -> None:
        """Start a refresh in the background unless one is running; returns
        at once. For callers that must not wait: a request's `acquire`, and
        the health loop while no replica is serving (the pool may not know
        the replicas that replaced the dead ones yet)."""
        if not self._closed:
            self._start_refresh()

    def _start_refresh(self) -> asyncio.Task:
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._refresh_logged())
        return self._refreshing

    async def _refresh_logged(self) -> None:
        try:
            await self._refresh()
        except Exception as exc:  # noqa: BLE001 - keep serving on the replicas we know
            log.warning("%s: re-resolving failed: %s", self.address, exc)
        finally:
            self._refreshing = None

    async def _refresh(self) -> None:
        self._resolved_at = time.monotonic()
        try:
            addresses = await asyncio.get_running_loop().run_in_executor(None, resolve, self.address)
        except Unresolved as exc:
            if self.replicas or self._joining:
                if not self._unresolved:
                    log.warning("%s: %s; keeping the replicas known", self.address, exc)
                self._unresolved = True
                return
            log.info("%s: %s; dialing the name itself", self.address, exc)
            addresses = exc.addresses  # nothing known yet: grpc resolves the name
        if self._unresolved:
            log.info("%s: resolves again", self.address)
            self._unresolved = False
        if not self._closed:
            self._apply(addresses)
            await self._close_idle()

    def _apply(self, addresses: list[str]) -> None:
        """The pool follows the name's `addresses`: those gone are retired
        (and their joins stopped) before the new ones start joining."""
        listed = set(addresses)
        for address in [a for a in self._joining if a not in listed]:
            self._joining.pop(address).cancel()
        now = time.monotonic()
        self._retry_at = {a: t for a, t in self._retry_at.items() if a in listed and t > now}
        for address, replica in self.replicas.items():
            if address in listed and replica.retired:
                replica.retired = False
                log.info("%s: replica %s is listed again", self.address, address)
            elif address not in listed and not replica.retired:
                replica.retired = True
                log.info("%s: replica %s removed", self.address, address)
        for address in addresses:
            if address not in self.replicas and address not in self._joining and address not in self._retry_at:
                self._joining[address] = asyncio.ensure_future(self._join(address))

    async def _join(self, address: str) -> None:
        """Connect to a new address in the background; it takes requests
        once it answered and `admit` accepted it. One that failed is tried
        again at the first refresh `refresh_s` later (not at every recovery's)."""
        try:
            replica = await self._make(address)
        except Exception as exc:  # noqa: BLE001 - tried again at a later refresh
            self.last_error = exc
            self._retry_at[address] = time.monotonic() + self.refresh_s
            log.warning("%s: replica %s did not answer: %s; trying again at a later refresh",
                        self.address, address, exc)
            return
        finally:
            if self._joining.get(address) is asyncio.current_task():
                self._joining.pop(address)
        refusal = self._refusal(replica)
        if refusal is not None:
            if refusal:
                self._retry_at[address] = time.monotonic() + self.refresh_s
                log.warning("%s: replica %s refused: %s; its channel is closed", self.address, address, refusal)
            await self._close(replica)
            return
        self.replicas[address] = replica
        log.info("%s: replica %s added", self.address, address)
        await self._close_idle()

    def _refusal(self, replica: Replica) -> str | None:
        """Why `replica` may not join (\"\": no need to say), or None."""
        if self._closed or replica.address in self.replicas:
            return ""
        return self._refusal_of(replica)

    async def _close_idle(self, only: Replica | None = None) -> None:
        """Close the retired replicas (or `only`) that no request holds,
        but never the pool's last one: `acquire` must find one, and a
        replica that left may be listed again."""
        for replica in [only] if only is not None else list(self.replicas.values()):
            if replica.retired and replica.active == 0 and len(self.replicas) > 1 \
                    and self.replicas.get(replica.address) is replica:
                del self.replicas[replica.address]
                await self._close(replica)

    def any(self) -> Replica:
        """A replica, live if there is one (its ModelInfo stands for all: they must agree)."""
        live = [r for r in self.replicas.values() if not r.retired]
        return (live or list(self.replicas.values()))[0]

    def acquire(self) -> Replica:
        """The least-loaded live replica that is not down (any live one if
        all are), pinned until `release`. A replica `recheck` refused (back
        as another model) gets no request: Unavailable if all are refused."""
        now = time.monotonic()
        if now - self._resolved_at > self.refresh_s:
            self.refresh_soon()
        if not self.replicas:
            raise Unavailable(f"no replica of {self.address} is connected")
        allowed = [r for r in self.replicas.values() if not r.refusal]
        if not allowed:
            raise Unavailable(f"every replica of {self.address} is refused: {self.replicas_refusal()}")
        live = [r for r in allowed if not r.retired] or allowed
        up = [r for r in live if not r.is_down(now)]
        replica = self._least_loaded(up or live)
        replica.active += 1
        return replica

    def move_from(self, replica: Replica) -> Replica | None:
        """For a request pinned to `replica` that failed and has not answered
        since (`failures`: marked down, whether or not its down window has
        ended): the replica `acquire` would pin a new request to among the
        others that are up and not retired, pinned to the request from now on
        (the caller then `release`s `replica`: the request's count moves with
        it). None, and nothing counted, when `replica` has not failed or no
        other replica is up: the request stays where it is."""
        if not replica.failures:
            return None
        now = time.monotonic()
        up = [r for r in self.replicas.values()
              if r is not replica and not r.retired and not r.refusal and not r.is_down(now)]
        if not up:
            return None
        moved = self._least_loaded(up)
        moved.active += 1
        return moved

    @staticmethod
    def _least_loaded(replicas: list[Replica]) -> Replica:
        return min(replicas, key=lambda r: r.active)

    async def recheck(self, replica: Replica, timeout_s: float) -> str | None:
        """For a replica that failed and answers again: it may be a process
        restarted at the same address as another version, another model or
        with smaller limits, so its ModelInfo is read again and `admit` runs
        on it as on a replica that joins. Why it is refused (logged once per
        reason), or None. Raises grpc.aio.AioRpcError when the read fails.
        A pool with no `admit` has nothing to check: None, nothing read."""
        if self.admit is None:
            return None
        await replica.client.fetch_info(timeout_s)
        refusal = self._refusal_of(replica)
        if refusal and refusal != replica.refusal:
            log.warning("%s: replica %s answers again but is refused: %s", self.address, replica.address, refusal)
        replica.refusal = refusal or ""
        return refusal

    def replicas_refusal(self) -> str:
        """A refused replica's reason (`recheck`), for a message."""
        return next((f"{r.address}: {r.refusal}" for r in self.replicas.values() if r.refusal), "")

    def _refusal_of(self, replica: Replica) -> str | None:
        """`admit`'s refusal of `replica`, or None."""
        if self.admit is None:
            return None
        try:
            self.admit(replica)
        except Exception as exc:  # noqa: BLE001 - the check's own message says why
            self.last_error = exc
            return str(exc)
        return None

    def mark_down(self, replica: Replica, why: str) -> None:
        """`replica` failed a call or a health check: new requests avoid it
        for a window that doubles with each failure in a row."""
        replica.failures += 1
        window = min(DOWN_INITIAL_S * 2 ** (replica.failures - 1), DOWN_MAX_S)
        replica.down_until = time.monotonic() + window
        if replica.failures == 1:
            log.warning("%s: replica %s is down (%s); new requests go to the others", self.address,
                        replica.address, why)

    def mark_up(self, replica: Replica) -> None:
        """`replica` answered: it takes new requests again."""
        if replica.failures:
            log.info("%s: replica %s is back", self.address, replica.address)
        replica.failures = 0
        replica.down_until = 0.0

    async def release(self, replica: Replica) -> None:
        replica.active -= 1
        await self._close_idle(replica)

    async def close(self) -> None:
        """Stop refreshing and joining (closing the joins' channels), then
        close every replica."""
        self._closed = True
        tasks = [t for t in (self._refresher, self._refreshing) if t is not None] + list(self._joining.values())
        self._joining.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        replicas, self.replicas = list(self.replicas.values()), {}
        for replica in replicas:
            await self._close(replica)
