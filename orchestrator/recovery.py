"""Keeping a request alive when its target replica fails.

The orchestrator holds each request's whole token history, so a target
session lost with its process (or its connection) loses nothing that cannot
be rebuilt: the session is re-opened by prefilling the history, on a live
replica, or on the same address once it is back, and the request goes on.
Greedy output is unchanged, and so are a seeded sampled request's tokens: the
target's draws are keyed by (seed, position), not by the session.

`TargetLease` is the request's hold on one target replica (its pool count
and its batcher's request count) and moves that hold when it re-opens the
session elsewhere. `SpeculativeRequest` calls `reopen` when a target call
fails with UNAVAILABLE; the servicer calls `release` when the request ends.

A replica that fails is marked down in its pool (replicas.py), so new
requests go elsewhere until it answers again; a re-open tries the replicas
that are up before those marked down, and waits at most `attempt_s` for
each open, so that one hung replica cannot use up the whole window.

`report_health` is the orchestrator's health loop: it checks every target
and draft replica each interval, marks each up or down by its answer, and
reports readiness (SERVING while some target replica answers). It never ends
while the server runs: one replica's failed check counts it down, and any
other error is logged and the loop goes on.

Limitations: the round in flight when the target failed is run again, so its
draft is asked twice (the drafts are the same: they are keyed by seed and
position too); a replica that keeps failing is retried until the window
closes; a request with no deadline waits at most `window_s` for a replica.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.downstream import CallCost
from orchestrator.replicas import Replica, ReplicaPool
from specdec.errors import DeadlineExceeded, Unavailable

log = logging.getLogger(__name__)

# What a replica answers an open that it will answer again, however long one
# waits: the history itself cannot be opened there.
REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)

# (client, OpenSessionRequest, seconds the caller waits) -> (session id, its cost)
Opener = Callable[[object, object, float], Awaitable[tuple[str, CallCost]]]


@dataclass(frozen=True)
class RecoverySettings:
    window_s: float = 30.0  # how long a request without a (shorter) deadline looks for a replica
    retry_initial_s: float = 0.1  # wait between passes over the replicas, doubled up to retry_max_s
    retry_max_s: float = 1.0
    # The longest wait for one replica's open before trying the next: a
    # replica that hangs (a frozen process the health loop has not yet
    # marked down) must not use up the window. Far longer than a prefill.
    attempt_s: float = 10.0


class TargetLease:
    """The target replica a request is pinned to, re-pinned after a failure."""

    def __init__(self, pool: ReplicaPool, settings: RecoverySettings = RecoverySettings()):
        self.pool = pool
        self.settings = settings
        self.replica: Replica = pool.acquire()
        self.replica.batcher.request_started()
        self._moved_from: Replica | None = None  # the failed replica of the last reopen, until `settle_move`
        self._give_up = 0.0

    @property
    def client(self):
        return self.replica.client

    @property
    def batcher(self):
        return self.replica.batcher

    async def release(self) -> None:
        if self._moved_from is not None:  # a request that ended before `settle_move`
            failed, self._moved_from = self._moved_from, None
            await self._release_failed(failed)
        self.replica.batcher.request_finished()
        await self.pool.release(self.replica)

    async def reopen(self, open_request, deadline: float | None, cause: Exception,
                     open_on: Opener) -> tuple[str, CallCost]:
        """Open a session prefilled with `open_request` (the full history) on
        the first replica that answers: those up first (least loaded first),
        then those marked down, the failed one last. Each open is waited for
        at most `attempt_s` (then the next replica is tried), so a hung
        replica costs that much, not the window. Passes over the replicas
        (re-resolving the name each time) until the request's deadline (then
        DeadlineExceeded) or the recovery window ends (then Unavailable),
        whichever comes first. Each open goes through
        `open_on(client, request, wait_s)`, the request's own
        (`RequestSessions._open_on`): it runs to its end, and a session it
        opens after the request gave up waiting is closed rather than left to
        expire. A pass in which every replica refused the open itself
        (INVALID_ARGUMENT, OUT_OF_RANGE: a replica restarted with a smaller
        context, say) ends the recovery at once: waiting would not change
        their answer. Returns as soon as the session is open, before anything
        else is awaited, so that the caller holds it at once; then
        `settle_move`."""
        failed = self.replica
        log.info("target %s failed (%s); re-opening the session on a live replica", failed.address, cause)
        self.pool.mark_down(failed, str(cause))
        give_up = time.monotonic() + self.settings.window_s
        if deadline is not None:
            give_up = min(give_up, deadline)
        wait = self.settings.retry_initial_s
        last_error = str(cause)
        while True:
            refused = tried = 0
            for replica in self._candidates(failed):
                left = give_up - time.monotonic()
                if left <= 0:
                    break
                tried += 1
                if replica.failures:  # it failed: it may be back as another model (`_refused`)
                    why, is_refusal = await _refused(self.pool, replica, min(left, self.settings.attempt_s))
                    if why is not None:
                        last_error = f"{replica.address}: {why}"
                        if is_refusal:  # `recheck` refused it: the same answer on every pass
                            refused += 1
                        else:  # its ModelInfo could not be read: as a failed call
                            self.pool.mark_down(replica, last_error)
                        continue
                try:
                    session_id, cost = await open_on(replica.client, open_request, min(left, self.settings.attempt_s))
                except DeadlineExceeded:
                    _raise_if_past(deadline)
                    last_error = (f"{replica.address}: still prefilling when the recovery window ended"
                                  if left <= self.settings.attempt_s else
                                  f"{replica.address}: no session within {self.settings.attempt_s:g} s")
                    continue
                except grpc.aio.AioRpcError as exc:
                    last_error = f"{replica.address}: {exc.code().name}: {exc.details()}"
                    if exc.code() == grpc.StatusCode.UNAVAILABLE:
                        self.pool.mark_down(replica, last_error)
                    refused += exc.code() in REFUSALS
                    continue
                self.pool.mark_up(replica)
                self._move_to(replica)
                self._moved_from, self._give_up = failed, give_up
                log.info("target session re-opened on %s (%d tokens prefilled)", replica.address,
                         len(open_request.prompt_token_ids))
                return session_id, cost
            if tried and refused == tried:
                raise Unavailable(f"the target service failed and no replica can re-open the session: {last_error}")
            left = give_up - time.monotonic()
            if left <= 0:
                _raise_if_past(deadline)
                raise Unavailable(f"the target service failed and no replica could re-open the session "
                                  f"within {self.settings.window_s:.0f} s: {last_error}")
            await asyncio.sleep(min(wait, left))
            wait = min(wait * 2, self.settings.retry_max_s)
            await self._refresh()

    async def settle_move(self) -> None:
        """After `reopen`: let the failed replica go (when the session moved
        off it), and re-read the new replica's ModelInfo."""
        failed, self._moved_from = self._moved_from, None
        if failed is not None:
            await self._release_failed(failed)
            await self._reread_info(self.replica, self._give_up)

    @staticmethod
    async def _reread_info(replica: Replica, give_up: float) -> None:
        """The replica's ModelInfo again: a target restarted in place may be
        another version (whether it reads packed q's, ModelInfo.reads_packed_q,
        decides what the drafts send it). Best effort: the old one stays."""
        try:
            await replica.client.fetch_info(min(max(give_up - time.monotonic(), 0.5), 10.0))
        except grpc.aio.AioRpcError as exc:
            log.info("re-reading %s's model info failed: %s", replica.address, exc.code().name)

    def _candidates(self, failed: Replica) -> list[Replica]:
        """The replicas to try, in order: up before down (a replica the
        health loop marked down, a frozen process say, may hang the open),
        the least loaded first, and the failed one last."""
        now = time.monotonic()
        live = [r for r in self.pool.replicas.values() if not r.retired and r is not failed]
        return sorted(live, key=lambda r: (r.is_down(now), r.active)) + [failed]

    def _move_to(self, replica: Replica) -> None:
        if replica is self.replica:
            return
        replica.active += 1
        replica.batcher.request_started()
        self.replica = replica

    async def _release_failed(self, failed: Replica) -> None:
        if failed is not self.replica:
            failed.batcher.request_finished()
            await self.pool.release(failed)

    async def _refresh(self) -> None:
        try:
            await self.pool.refresh()
        except Exception as exc:  # noqa: BLE001 - keep trying the replicas we know
            log.info("re-resolving %s failed: %s", self.pool.address, exc)


def _raise_if_past(deadline: float | None) -> None:
    """DeadlineExceeded once the request's own deadline has passed: the
    recovery ended because the request is out of time, not because no
    replica answered within the window."""
    if deadline is not None and time.monotonic() >= deadline:
        raise DeadlineExceeded("the request's deadline passed while its target session was being re-opened")


async def replica_serving(pool: ReplicaPool, replica: Replica, timeout_s: float) -> bool:
    """Whether `replica` answers its health check with SERVING; it is marked
    up or down by its answer. Any failure of the check counts as down: an
    RPC error, a channel closed under the call (CancelledError) or before it
    (UsageError). A replica retired (its name no longer resolves to it) is
    neither checked nor marked: it is on its way out, and its channel may be
    closed, on which even making a stub can crash grpc (a segfault in
    grpcio 1.85's registered-method lookup)."""
    if replica.retired:
        return False
    try:
        reply = await health_pb2_grpc.HealthStub(replica.client.channel).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout_s)
        status = reply.status
        why = f"health check: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # the health loop itself is being stopped
            raise
        status, why = None, "health check: cancelled (its channel was closed)"
    except grpc.aio.AioRpcError as exc:
        status, why = None, f"health check: {exc.code().name}"
    except Exception as exc:  # noqa: BLE001 - a UsageError (closed channel), whatever else: down
        status, why = None, f"health check: {type(exc).__name__}: {exc}"
    if status == health_pb2.HealthCheckResponse.SERVING and replica.failures:
        why, _ = await _refused(pool, replica, timeout_s)  # it may have restarted as another model
        if why is not None:
            status = None
    if replica.retired:
        return False
    if status != health_pb2.HealthCheckResponse.SERVING:
        pool.mark_down(replica, why)
        return False
    pool.mark_up(replica)
    return True


async def _refused(pool: ReplicaPool, replica: Replica, timeout_s: float) -> tuple[str | None, bool]:
    """Why a replica that failed and answers again may not take requests,
    or None; and whether that is `ReplicaPool.recheck`'s refusal (restarted
    in place as another model, version or with smaller limits) rather than
    a failure to read its ModelInfo."""
    try:
        refusal = await pool.recheck(replica, timeout_s)
    except grpc.aio.AioRpcError as exc:
        return f"model info: {exc.code().name}", False
    except Exception as exc:  # noqa: BLE001 - a closed channel (UsageError), whatever else: not back
        return f"model info: {type(exc).__name__}: {exc}", False
    return (None, False) if refusal is None else (f"refused: {refusal}", True)


async def any_serving(pool: ReplicaPool, timeout_s: float) -> bool:
    """Whether some live replica of `pool` answers its health check with
    SERVING; each is marked up or down by its answer (`replica_serving`)."""
    replicas = [r for r in pool.replicas.values() if not r.retired]
    return any(await asyncio.gather(*(replica_serving(pool, r, timeout_s) for r in replicas)))


class HealthReporter:
    """The orchestrator's health loop (`report_health`): checks the replicas
    of both services every `interval_s`, and calls `set_serving(bool)` when
    whether some target replica serves changes."""

    def __init__(self, targets: ReplicaPool, set_serving: Callable[[bool], Awaitable[None]],
                 interval_s: float = 1.0, drafts: ReplicaPool | None = None):
        self.targets, self.drafts = targets, drafts
        self.set_serving = set_serving
        self.interval_s = interval_s
        self.serving = True  # what was last reported (start-up reported SERVING)

    async def run(self) -> None:
        """Forever, one check each interval. No single failure ends it: were
        the loop to die, readiness would stay as it was whatever the targets
        did (NOT_SERVING for good, or SERVING with none reachable)."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_once()
            except Exception:  # noqa: BLE001 - logged; the next interval tries again
                log.exception("the health check of %s failed; trying again in %g s", self.targets.address,
                              self.interval_s)

    async def check_once(self) -> None:
        """Check every replica once (targets and drafts together); report a
        change of readiness. Drafts only get marked: without one, requests
        decode with the target alone, so they do not decide readiness."""
        timeout_s = max(0.2, self.interval_s)
        checks = [any_serving(self.targets, timeout_s)]
        if self.drafts is not None:
            checks.append(any_serving(self.drafts, timeout_s))
        now = (await asyncio.gather(*checks))[0]
        if now != self.serving:
            log.log(logging.INFO if now else logging.WARNING, "target %s: %s", self.targets.address,
                    "a replica is back: SERVING" if now else "no replica is reachable: NOT_SERVING")
            await self.set_serving(now)
            self.serving = now
        if not now:
            # Re-resolve the name now rather than at the next `refresh_s`:
            # the targets may be back at new addresses (pods replaced).
            self.targets.refresh_soon()


async def report_health(targets: ReplicaPool, set_serving: Callable[[bool], Awaitable[None]],
                        interval_s: float = 1.0, drafts: ReplicaPool | None = None) -> None:
    """Forever: the orchestrator is SERVING while some target replica is, and
    NOT_SERVING (so balancers route elsewhere) while none is reachable.
    Requests in flight meanwhile wait for one (`TargetLease.reopen`). Draft
    replicas are checked too, so that new requests avoid a dead one."""
    await HealthReporter(targets, set_serving, interval_s, drafts).run()
