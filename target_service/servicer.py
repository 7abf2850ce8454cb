"""TargetService over the verifier: translates protobuf to the core and back."""
from __future__ import annotations

import time

from specdec.rpc import grpc_errors, lane_methods
from specdec.rpc.model_service import LaneCall, SessionServicer
from specdec.sampling import q_wire
from specdec.telemetry import (A_APPENDED, A_BATCH_ITEMS, A_BATCH_SESSIONS, A_FORWARD_S, A_K, A_TOKENS,
                               SPAN_DECODE, SPAN_VERIFY)
from specdec.v1 import target_pb2, target_pb2_grpc
from target_service.verifier import VerifyRequestItem


class TargetServicer(SessionServicer, target_pb2_grpc.TargetServiceServicer):
    reads_packed_q = True  # Verify takes a draft's q packed (specdec/sampling/q_wire.py)

    @grpc_errors.unary
    async def Verify(self, request, context):
        return await self._verify(request, context.invocation_metadata())

    @grpc_errors.unary
    async def VerifyStream(self, calls, context):
        """Verify calls as messages on one long-lived stream (specdec.rpc.call_stream)."""
        call = self.lane_call()
        await self.call_streams.serve(calls, context, call.handle, call.method.reply_type, call.handler_name)

    def lane_call(self) -> LaneCall:
        return LaneCall(lane_methods.TARGET, self._verify, "TargetServicer.Verify")

    async def _verify(self, request, metadata):
        """One batched call serves several requests: its span is a child of
        the orchestrator's `verify.batch` span, which links the requests."""
        with self.telemetry.leaf_server_span(SPAN_VERIFY, metadata, {A_BATCH_ITEMS: len(request.items)}) as span:
            items = [
                VerifyRequestItem(
                    session_id=it.session_id,
                    keep_length=it.keep_length if it.HasField("keep_length") else None,
                    append=list(it.append_token_ids),
                    drafts=list(it.draft_token_ids),
                    draft_q=[q_wire.received(q) for q in it.draft_q],
                )
                for it in request.items
            ]
            self.telemetry.metrics.record_verify_batch(len(items))
            # Timed where it runs (the engine thread or, when short, the event
            # loop): compute, not the wait for the engine or the hand-offs.
            batch, seconds = await self.worker.run_short("verify", _timed, self.backend.verify, items)
            span.set_attributes({A_BATCH_SESSIONS: batch.batch_size, A_FORWARD_S: seconds})
        results = [_result_to_wire(it.session_id, r) for it, r in zip(items, batch.items)]
        return target_pb2.VerifyResponse(results=results, batch_size=batch.batch_size,
                                         compute_micros=int(seconds * 1e6))

    @grpc_errors.unary
    async def Decode(self, request, context):
        with self.telemetry.leaf_server_span(SPAN_DECODE, context.invocation_metadata(),
                                        {A_K: request.num_tokens, A_APPENDED: len(request.append_token_ids)}) as span:
            start = time.perf_counter()
            tokens, length = await self.worker.run(
                self.backend.decode, request.session_id, _keep(request),
                list(request.append_token_ids), request.num_tokens, list(request.stop_token_ids),
            )
            seconds = time.perf_counter() - start
            span.set_attributes({A_TOKENS: len(tokens), A_FORWARD_S: seconds})
        return target_pb2.DecodeResponse(token_ids=tokens, length=length, compute_micros=int(seconds * 1e6))


def _timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def _result_to_wire(session_id: str, result) -> target_pb2.VerifyResult:
    msg = target_pb2.VerifyResult(session_id=session_id, length=result.length)
    if result.error is not None:
        msg.error.code = grpc_errors.code_number(result.error)
        msg.error.message = str(result.error)
        return msg
    outcome = result.outcome
    if outcome.argmax_ids:
        msg.argmax_token_ids.extend(outcome.argmax_ids)
    else:
        msg.target_probs.extend(outcome.target_probs)
        msg.recovery_token_ids.extend(outcome.recovery_ids)
        msg.bonus_token_id = outcome.bonus_id
    return msg


def _keep(request) -> int | None:
    return request.keep_length if request.HasField("keep_length") else None
