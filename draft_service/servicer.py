"""DraftService over a drafter: translates protobuf to the core and back."""
from __future__ import annotations

import functools

from draft_service.step_batcher import DraftStepBatcher
from specdec.rpc import grpc_errors, lane_methods
from specdec.rpc.model_service import LaneCall, SessionServicer
from specdec.sampling import q_wire
from specdec.telemetry import A_APPENDED, A_K, A_MIN_CONFIDENCE, A_TOKENS, NOOP, SPAN_PROPOSE
from specdec.v1 import draft_pb2, draft_pb2_grpc


class DraftServicer(SessionServicer, draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, worker, limits, backend_kind: str = "model", drafter=None, telemetry=NOOP):
        super().__init__(worker, limits, backend=drafter, telemetry=telemetry)
        self.backend_kind = backend_kind
        self._steps: DraftStepBatcher | None = None

    @property
    def steps(self) -> DraftStepBatcher:
        """The step batcher of the attached drafter (made once it is loaded)."""
        if self._steps is None or self._steps.drafter is not self.backend:
            self._steps = DraftStepBatcher(self.worker, self.backend)
        return self._steps

    def sessions_closed(self, session_ids) -> None:
        super().sessions_closed(session_ids)
        if self._steps is not None:
            self._steps.forget(session_ids)

    @grpc_errors.stream
    async def Propose(self, request, context):
        with self._span(request, context.invocation_metadata()) as span:
            self.steps.note_caller(request.session_id)
            stream = await self._start(request)
            sent = 0
            # Each step is one forward pass on the engine thread, shared with
            # the other requests' streams; the token is on the wire as soon as
            # it is drafted.
            async for draft, seconds in self.steps.stream(stream):
                sent += 1
                yield draft_to_wire(draft, seconds, request.packed_q)
            span.set_attribute(A_TOKENS, sent)

    @grpc_errors.unary
    async def ProposeAll(self, request, context):
        return await self._propose_all(request, context.invocation_metadata())

    @grpc_errors.unary
    async def ProposeAllStream(self, calls, context):
        """ProposeAll calls as messages on one long-lived stream (specdec.rpc.call_stream)."""
        call = self.lane_call()
        await self.call_streams.serve(calls, context, call.handle, call.method.reply_type, call.handler_name)

    def lane_call(self) -> LaneCall:
        return LaneCall(lane_methods.DRAFT, self._propose_all, "DraftServicer.ProposeAll")

    async def _propose_all(self, request, metadata):
        """Propose answered in one message: one message on the wire instead
        of k, and the k steps back to back in one engine-thread job when no
        other stream shares them (`DraftStepBatcher.collect`)."""
        request = request.propose
        with self._span(request, metadata) as span:
            drafts = await self.steps.start_and_collect(functools.partial(_validate, self.backend, request),
                                                        request.session_id, len(request.append_token_ids))
            span.set_attribute(A_TOKENS, len(drafts))
        return drafts_to_wire(drafts, request.packed_q)

    def _span(self, request, metadata):
        attributes = {A_K: request.num_draft_tokens, A_APPENDED: len(request.append_token_ids),
                      A_MIN_CONFIDENCE: request.min_confidence}
        return self.telemetry.leaf_server_span(SPAN_PROPOSE, metadata, attributes)

    async def _start(self, request):
        """The call's DraftStream, validated on the engine thread."""
        return await self.worker.run(_validate, self.backend, request)


def _validate(backend, request):
    """The call's DraftStream (run on the engine thread; `backend` is taken on
    the event loop, which answers UNAVAILABLE while the model loads)."""
    return backend.propose(request.session_id, request.keep_length if request.HasField("keep_length") else None,
                           list(request.append_token_ids), request.num_draft_tokens, request.min_confidence,
                           request.call_number, request.first_is_guess)


def drafts_to_wire(drafts, packed_q: bool) -> draft_pb2.ProposeAllResponse:
    """A ProposeAll's reply: the (draft, seconds) pairs, each made in place in
    the reply, not made alone and then copied in (of a cold round's 85 µs for
    four drafts on the dev VM, ~30)."""
    reply = draft_pb2.ProposeAllResponse()
    add = reply.drafts.add
    for draft, seconds in drafts:
        draft_to_wire(draft, seconds, packed_q, add)
    return reply


def draft_to_wire(draft, seconds: float, packed_q: bool,
                  make=draft_pb2.ProposeResponse) -> draft_pb2.ProposeResponse:
    """A drafted token as the service sends it; its q packed or as lists
    (specdec/sampling/q_wire.py). `make`: the message's constructor, or a
    repeated field's `add` to make it in place there."""
    msg = make(index=draft.index, token_id=draft.token_id, length=draft.length,
               compute_micros=round(seconds * 1e6), confidence=draft.confidence)
    if draft.q is not None:
        q_wire.write(msg.q, draft.q, packed_q)
    return msg
