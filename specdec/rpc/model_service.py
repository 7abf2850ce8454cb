"""What the draft and target services share: settings, per-session sampling
state, and the session RPCs (GetModelInfo, OpenSession, Rollback,
CloseSession). Each service adds its own RPCs on top."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

from specdec.engine import device_health
from specdec.engine.engine import EngineInfo
from specdec.engine.prefill import PrefillJob
from specdec.errors import DeadlineExceeded, InvalidArgument, Unavailable
from specdec.rpc import grpc_errors
from specdec.rpc.call_stream import ServedStreams
from specdec.rpc.lane_methods import LaneMethod
from specdec.rpc.open_batcher import OpenBatcher
from specdec.rpc.serving import EngineWorker
from specdec.rpc.session_limits import SessionLimits
from specdec.rpc.session_quota import SessionQuota
from specdec.sampling.params import SamplingParams
from specdec.telemetry import (A_BATCH_SESSIONS, A_KV_BYTES, A_LENGTH, A_PROMPT_TOKENS, NOOP, SPAN_CLOSE, SPAN_PREFILL,
                               SPAN_ROLLBACK, Telemetry)
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaneCall:
    """The one call a service answers on its lane and on its call stream."""

    method: LaneMethod
    handle: Callable  # (request, trace_context_items) -> response
    handler_name: str  # for the log of our bugs


@dataclass(frozen=True)
class SessionMeta:
    """A session's sampling settings, fixed at open."""

    params: SamplingParams
    seed: int


class EngineBackend:
    """The session RPCs of a backend whose sessions live in a ModelEngine
    (the model drafter and the target's verifier)."""

    def __init__(self, engine):
        self.engine = engine
        self.info = engine.info

    def open(self, prompt, meta: SessionMeta, max_new_tokens: int) -> tuple[str, int, int]:
        session = self.engine.open_session(prompt, max_new_tokens)
        session.meta = meta
        return session.id, session.length, self.engine.slot_bytes

    def start_opening(self, requests) -> EngineOpening:
        """`open` for each (prompt, meta, max_new_tokens) at once, the
        prompts prefilled together one pass a `step()`; more may join
        between passes (`add`), and each is ready as soon as its prompt is
        computed (`take_ready`; specdec/engine/prefill.py)."""
        opening = EngineOpening(self.engine)
        opening.add(requests)
        return opening

    def rollback(self, session_id: str, length: int) -> int:
        return self.engine.rollback(session_id, length)

    def close(self, session_id: str) -> bool:
        return self.engine.close(session_id)

    def expire_idle(self, ttl_s: float) -> list[str]:
        return self.engine.expire_idle(ttl_s)

    def usage(self) -> tuple[int, int]:
        """(open sessions, reserved KV bytes); safe from any thread."""
        return self.engine.num_sessions, self.engine.kv_bytes_reserved


class EngineOpening(PrefillJob):
    """Sessions opening together, as the service opens them: each request a
    (prompt, meta, max_new_tokens), each result as `open` gives it, (session
    id, length, KV bytes), or its error."""

    def __init__(self, engine):
        self.metas: list = []  # by request index, as the job numbers them
        super().__init__(engine)

    def add(self, requests) -> list[int]:
        """(prompt, meta, max_new_tokens) each: opened, to prefill in the next passes."""
        self.metas.extend(meta for _, meta, _ in requests)
        return super().add([(prompt, max_new) for prompt, _, max_new in requests])

    def take_ready(self) -> list[tuple[int, object]]:
        out = []
        for index, session in super().take_ready():
            if isinstance(session, Exception):
                out.append((index, session))
                continue
            session.meta = self.metas[index]
            out.append((index, (session.id, session.length, self.engine.slot_bytes)))
        return out


def caller_gone(context) -> bool:
    """Whether the call behind `context` has ended (cancelled, or its deadline
    passed): a reply written now reaches nobody."""
    if context.cancelled() or context.done():
        return True
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


def sampling_from_wire(msg: common_pb2.SamplingParams) -> SamplingParams:
    try:
        return SamplingParams.from_wire(msg.temperature, msg.top_k, msg.top_p).validate()
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def info_to_wire(info: EngineInfo, limits: SessionLimits, backend: str) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_name=info.model_name,
        vocab_size=info.vocab_size,
        max_context=info.max_context,
        eos_token_ids=list(info.eos_token_ids),
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        device=info.device,
        dtype=info.dtype,
        max_draft_tokens=limits.max_draft_tokens,
        max_verify_batch=limits.max_verify_batch,
        backend=backend,
        kv_bytes_per_token=info.kv_bytes_per_token,
        usable_vocab_size=info.usable_vocab_size or info.vocab_size,
        weights=info.weights,
        weights_fingerprint=info.weights_fingerprint,
    )


class SessionServicer:
    """The session RPCs over a backend with open/rollback/close/expire_idle/
    usage/info. Each traced RPC opens one server span, a child of the
    caller's span when the call carries a trace context.

    The servicer exists before its backend (the model loads after the server
    binds); until `attach()` every call answers UNAVAILABLE.
    """

    backend_kind = "model"
    reads_packed_q = False  # ModelInfo.reads_packed_q: whether Verify reads a packed q (targets)

    def __init__(self, worker: EngineWorker, limits: SessionLimits, backend=None, telemetry: Telemetry = NOOP):
        self._backend = backend
        self.worker = worker
        self.limits = limits
        self.telemetry = telemetry
        self._reaper: asyncio.Task | None = None
        self.quota = SessionQuota(limits.max_sessions_per_caller)
        self.expired_sessions = 0  # closed by idle expiry since start: sessions a caller leaked
        self.call_streams = ServedStreams()  # the service's long-lived call streams, ended by a drain
        self.opens = OpenBatcher(worker, lambda: self.backend)  # OpenSession calls arriving together share prefill passes
        self.lane_port = 0  # the lane's port once it listens (0: none)
        # Called once the device stops computing (specdec/engine/device_health.py);
        # start_model_service makes it drain the service so the process exits.
        self.on_device_failure: Callable[[str], Awaitable[None]] | None = None
        self._device_watch: asyncio.Task | None = None

    def lane_call(self) -> LaneCall:
        """The call this service's lane answers (the round's one call to it)."""
        raise NotImplementedError

    def attach(self, backend) -> None:
        self._backend = backend
        self.telemetry.metrics.observe_sessions(backend.usage)
        self.start_reaper()
        device = getattr(getattr(backend, "engine", None), "device", None)
        if device_health.watched(device):
            self._device_watch = asyncio.ensure_future(self._watch_device(device))

    @property
    def backend(self):
        if self._backend is None:
            raise Unavailable("the model is still loading; retry when the health check reports SERVING")
        return self._backend

    def start_reaper(self) -> None:
        self._reaper = asyncio.ensure_future(self._reap_idle_sessions())

    def stop_reaper(self) -> None:
        """Stop the background tasks: the idle-session reaper and the device watch."""
        for task in (self._reaper, self._device_watch):
            if task is not None:
                task.cancel()

    async def _watch_device(self, device) -> None:
        """Every PROBE_INTERVAL_S, whether the model's device still computes
        (`device_health.probe`, queued on the engine thread like any job);
        the first time it does not, `on_device_failure`, and the watch ends."""
        while True:
            await asyncio.sleep(device_health.PROBE_INTERVAL_S)
            why = await self.worker.run(device_health.probe, device)
            if why is not None:
                log.critical("the model's device %s no longer computes (%s): this service stops serving and "
                             "exits, to be restarted", device, why)
                if self.on_device_failure is not None:
                    await self.on_device_failure(f"the model's device {device} failed: {why}")
                return

    async def _reap_idle_sessions(self) -> None:
        period = max(0.05, min(self.limits.session_ttl_s / 4, 30.0))
        while True:
            await asyncio.sleep(period)
            expired = await self.worker.run(self.backend.expire_idle, self.limits.session_ttl_s)
            self.sessions_closed(expired)
            if expired:
                self.expired_sessions += len(expired)
                log.info("expired %d idle sessions", len(expired))

    @grpc_errors.unary
    async def GetModelInfo(self, request, context):
        backend = self.backend
        info = info_to_wire(backend.info, self.limits, self.backend_kind)
        info.lane_port = self.lane_port
        info.reads_packed_q = self.reads_packed_q
        counts = common_pb2.SessionCounts(open=backend.usage()[0], expired=self.expired_sessions)
        return common_pb2.GetModelInfoResponse(info=info, sessions=counts)

    @grpc_errors.unary
    async def OpenSession(self, request, context):
        with self.telemetry.leaf_server_span(SPAN_PREFILL, context.invocation_metadata(),
                                        {A_PROMPT_TOKENS: len(request.prompt_token_ids)}) as span:
            meta = SessionMeta(params=sampling_from_wire(request.sampling), seed=request.seed)
            # UNAVAILABLE at once while the model loads (the load holds the engine thread), and
            # before the caller's quota is counted: a refused open must not keep a reservation.
            self.backend  # noqa: B018 - raises while loading
            caller = self.quota.admit(context)
            try:
                # A caller that gives up (cancelled, or its deadline passed) while its
                # prefill runs leaves a session nobody will learn of: the batcher closes
                # it as soon as it is open, instead of holding its KV slot until it expires.
                session_id, length, kv_bytes, shared = await self.opens.open(
                    list(request.prompt_token_ids), meta, request.max_new_tokens)
            except BaseException:
                self.quota.abandon(caller)
                raise
            if caller_gone(context):
                # Its deadline passed as the open finished, and the cancellation has not
                # reached this task (it may never, once the reply is written): nobody
                # would learn of the session.
                self.quota.abandon(caller)
                self.opens.close_orphan(session_id)
                raise DeadlineExceeded("the call's deadline passed while its session opened; the session is closed")
            self.quota.opened(caller, session_id)
            span.set_attribute(A_KV_BYTES, kv_bytes)
            span.set_attribute(A_BATCH_SESSIONS, shared)
        return common_pb2.OpenSessionResponse(session_id=session_id, length=length, kv_bytes=kv_bytes)

    def sessions_closed(self, session_ids) -> None:
        """`session_ids` were closed (by their caller, or expired): forget what was kept of them."""
        self.quota.closed(session_ids)

    @grpc_errors.unary
    async def Rollback(self, request, context):
        with self.telemetry.leaf_server_span(SPAN_ROLLBACK, context.invocation_metadata(), {A_LENGTH: request.length}):
            length = await self.worker.run_quick(self.backend.rollback, request.session_id, request.length)
        return common_pb2.RollbackResponse(length=length)

    @grpc_errors.unary
    async def CloseSession(self, request, context):
        with self.telemetry.leaf_server_span(SPAN_CLOSE, context.invocation_metadata()):
            # Shielded: a close the caller stops waiting for (its deadline
            # passed while the engine thread was busy) still happens; dropped
            # from the queue, the session would be held until it expires.
            # What is kept of the session (its caller's quota) is forgotten
            # with it, in the same shielded task.
            closed = await asyncio.shield(asyncio.ensure_future(self._close(request.session_id)))
        return common_pb2.CloseSessionResponse(closed=closed)

    async def _close(self, session_id: str) -> bool:
        try:
            return await self.worker.run_quick(self.backend.close, session_id)
        finally:
            self.sessions_closed((session_id,))
