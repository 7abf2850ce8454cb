"""Pin each request to one replica of a service.

Sessions live in one replica's memory, so every call of a request must reach
the replica that opened its sessions. gRPC's own load balancing spreads calls,
not sessions. So the orchestrator resolves a service's name itself (a
Kubernetes headless Service resolves to every ready pod), keeps one channel
(and, for targets, one verify batcher) per replica, and pins each request to
the replica with the fewest active requests. The name is re-resolved every
`refresh_s` seconds; a replica that disappears is dropped from selection and
its channel closed once its last request ends.

A replica that is still listed but not answering (a process that died while
its name still resolves, or an address of a comma-separated `--target`) is
marked down: by a failed call (`mark_down`, from the target's recovery) or
a failed health check (the orchestrator's health loop checks every target
replica each second). New requests go to the replicas that are up; one that
is down gets none until it answers again (`mark_up`) or its down window
ends (1 s, doubled for each failure in a row, at most 30 s), when it gets
one more try. Where every replica is down, they are all tried, least
loaded first, as before.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

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

    def is_down(self, now: float) -> bool:
        return now < self.down_until


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def resolve(address: str) -> list[str]:
    """Every address a host:port name stands for, IPv4 first; an IP literal
    or localhost stands for itself. A comma-separated list of names stands
    for the union of what each stands for (replicas on one machine, each on
    its own port)."""
    if "," in address:
        found: list[str] = []
        for part in filter(None, (p.strip() for p in address.split(","))):
            found += [a for a in resolve(part) if a not in found]
        if not found:
            raise ValueError(f"no address in {address!r}")
        return found
    host, port = split_address(address)
    if host == "localhost":
        return [f"127.0.0.1:{port}"]
    try:
        ipaddress.ip_address(host)
        return [address]
    except ValueError:
        pass
    found: list[str] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
        except socket.gaierror:
            continue
        for info in infos:
            ip = info[4][0]
            entry = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
            if entry not in found:
                found.append(entry)
        if found:
            break
    return sorted(found) or [address]


DOWN_INITIAL_S = 1.0  # a replica's first down window; doubled per failure in a row
DOWN_MAX_S = 30.0


class ReplicaPool:
    def __init__(self, address: str, make_replica: Callable[[str], Awaitable[Replica]],
                 close_replica: Callable[[Replica], Awaitable[None]], refresh_s: float = 10.0):
        self.address = address
        self._make = make_replica
        self._close = close_replica
        self.refresh_s = refresh_s
        self.replicas: dict[str, Replica] = {}
        self._resolved_at = 0.0
        self._refreshing: asyncio.Task | None = None

    async def refresh(self) -> None:
        addresses = await asyncio.get_running_loop().run_in_executor(None, resolve, self.address)
        self._resolved_at = time.monotonic()
        for address in addresses:
            if address not in self.replicas:
                self.replicas[address] = await self._make(address)
                log.info("%s: replica %s added", self.address, address)
        for address, replica in list(self.replicas.items()):
            if address not in addresses and not replica.retired:
                replica.retired = True
                log.info("%s: replica %s removed", self.address, address)
                await self._close_if_idle(replica)

    async def _close_if_idle(self, replica: Replica) -> None:
        if replica.retired and replica.active == 0:
            self.replicas.pop(replica.address, None)
            await self._close(replica)

    def any(self) -> Replica:
        return next(iter(self.replicas.values()))

    def acquire(self) -> Replica:
        """The least-loaded live replica that is not down (any live one if
        all are), pinned until `release`."""
        now = time.monotonic()
        if now - self._resolved_at > self.refresh_s and self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._background_refresh())
        live = [r for r in self.replicas.values() if not r.retired] or list(self.replicas.values())
        up = [r for r in live if not r.is_down(now)]
        replica = min(up or live, key=lambda r: r.active)
        replica.active += 1
        return replica

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
        await self._close_if_idle(replica)

    async def _background_refresh(self) -> None:
        try:
            await self.refresh()
        except Exception as exc:  # noqa: BLE001 - keep serving on the replicas we know
            log.warning("%s: re-resolving failed: %s", self.address, exc)
        finally:
            self._refreshing = None

    async def close(self) -> None:
        for replica in list(self.replicas.values()):
            await self._close(replica)
        self.replicas.clear()
